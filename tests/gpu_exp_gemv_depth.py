"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_gemv_depth.py`; not part of the test suite):
the decode GEMV with other ring depths / register caps, on the
model's q4 shapes. Each launch alone in a CUDA graph of launches over rotating weight copies (no L2
reuse). us per launch and GB/s."""
import numpy as np
import cupy as cp
from tinyinfer.formats import tensor_nbytes
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels.build import expanded_source
from tinyinfer.runtime.bench import random_encoded

from gpu_timing import graph_us_per_launch

SRC = expanded_source("gemv.cu")
SHAPES = [("tl wqkv", 2560, 2048, "rmsnorm", "store"), ("tl wo", 2048, 2048, "plain", "add"),
          ("tl gate_up", 11264, 2048, "rmsnorm", "swiglu"), ("tl down", 2048, 5632, "plain", "add"),
          ("7b wqkv", 12288, 4096, "rmsnorm", "store"), ("7b wo", 4096, 4096, "plain", "add"),
          ("7b gate_up", 22016, 4096, "rmsnorm", "swiglu"), ("7b down", 4096, 11008, "plain", "add")]
VARIANTS = [(4, 2, 2), (2, 2, 2), (2, 1, 2), (3, 2, 2), (2, 2, 3), (1, 1, 2)]   # (depth RT1, depth RT2, min blocks)
rng = np.random.default_rng(0)
data = {}
for label, rows, cols, inp, outp in SHAPES:
    t = random_encoded("q4", (rows, cols), 64, rng, 1 / np.sqrt(cols))
    raw = np.zeros(tensor_nbytes("q4", (rows, cols), 64), np.uint8)
    for off, arr in t.parts():
        b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        raw[off: off + b.size] = b
    copies = max(2, int(np.ceil(300e6 / raw.nbytes)))
    data[label] = (gemv_k.shape_of(t, inp, outp), [cp.asarray(raw) for _ in range(copies)], raw.nbytes)
x = cp.asarray(rng.standard_normal(2 * 11008).astype(np.float32))
aux = cp.ones(11008, cp.float32)
y = cp.zeros(32000, cp.float32)
BOUNDS = "__launch_bounds__(WIDE ? 512 : 256, WIDE ? 1 : 2) gemv("
assert BOUNDS in SRC, "gemv.cu changed: update the sweep"
for d1, d2, minb in VARIANTS:     # (min blocks: of the 256-thread kernels; wide blocks keep one per SM)
    src = SRC.replace(BOUNDS, f"__launch_bounds__(WIDE ? 512 : 256, WIDE ? 1 : {minb}) gemv(")
    depth = {1: d1, 2: d2}
    exprs = sorted({gemv_k.name_expression(s, gemv_k.GemvConfig(rt, depth=depth[rt])) for s, _, _ in data.values()
                    for rt in (1, 2)})
    mod = cp.RawModule(code=src, options=("--std=c++17", "-arch=sm_90a"), name_expressions=exprs)
    out = []
    for label, (shape, ws, nbytes) in data.items():
        best = None
        for rt, warps in gemv_k.CANDIDATES:
            config = gemv_k.GemvConfig(rt, warps, depth=depth[rt])
            launches = [gemv_k.make_gemv(mod, shape, config, w, x, y, aux, 1e-5) for w in ws]
            us = graph_us_per_launch(launches, 3)
            if best is None or us < best[0]:
                best = (us, f"R{rt}w{warps}", launches[0].kernel.num_regs)
        out.append(f"{label} {best[0]:.2f}us {nbytes / best[0] / 1e3:.0f}GB/s {best[1]} {best[2]}r")
    print(f"depth {d1}/{d2} minblocks {minb}: " + " | ".join(out), flush=True)
