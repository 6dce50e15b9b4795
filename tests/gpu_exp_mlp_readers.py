"""s17 (branch exp/fused-mlp): what each reader of the pending sums costs in the step, with pending
all zero (no fused MLP): the qkv GEMV's input, the o projection's fold, the output head's input."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))
import gpu_exp_chain as chain  # noqa: E402
from tinyinfer.runtime.cuda_backend import CudaBackend  # noqa: E402

CudaBackend.mlp_candidates = lambda self: []   # tune the GEMVs only

for spec in sys.argv[1:]:
    shape, quant = spec.split(":")
    with chain.random_backend(shape, quant) as (b, prompt):
        t = b.tuning

        def step(readers):
            out = []
            for layer in range(b.n_layers):
                out.append(b.gemv_launch("wqkv", layer, t["wqkv"], pending="wqkv" in readers))
                out.append(b.attention_launch(layer, b.attn_plan.slices))
                out.append(b.gemv_launch("wo", layer, t["wo"], pending="wo" in readers))
                out.append(b.gemv_launch("w_gate_up", layer, t["w_gate_up"]))
                out.append(b.gemv_launch("w_down", layer, t["w_down"]))
            out.append(b.gemv_launch("output", 0, t["output"], pending="output" in readers))
            out.append(b.sampler_launch())
            return out

        sides = {"none": (), "wqkv": ("wqkv",), "wo": ("wo",), "output": ("output",), "all": ("wqkv", "wo", "output")}
        res = {k: [] for k in sides}
        for rnd in range(3):
            for k, readers in sides.items():
                res[k].append(round(chain.time_step(b, prompt, step(readers)), 1))
        for k, v in res.items():
            print(f"{spec} pending read by {k}: {v}", flush=True)
        b.use_tuning(t)
