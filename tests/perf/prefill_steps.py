"""Run by hand on a GPU (`python3 tests/perf/prefill_steps.py`): where one 2048-token prefill's time goes. CUDA
events around every step of runtime/cuda_prefill.py (GEMMs, dequantization, attention, SwiGLU, RMSNorm, RoPE)
of a random-weight TinyLlama and Llama-2-7B q4 model; needs TINYINFER_SHARED (or ../shared) for the real
configs."""
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # tests/: conftest's SHARED
from conftest import SHARED  # noqa: E402
from tinyinfer.kernels import prefill as prefill_k  # noqa: E402
from tinyinfer.runtime import cuda_prefill, load  # noqa: E402
from tinyinfer.runtime.bench import bench_prompt, tinf_config, write_random_model  # noqa: E402

MODELS = {"tinyllama": "tinyllama-1.1b-chat-v1.0/config.json", "llama-2-7b": "llama-2-7b-hf/config.json"}
STEPS = ("embed", "rmsnorm", "linear", "rope_store", "attention", "swiglu", "logits")


def profile(path, n_tokens: int = 2048) -> tuple[float, dict]:
    """(ms of the whole prefill, ms per step) for one prefill of n_tokens from position 0."""
    with load(path, device="cuda") as model:
        backend = model.backend
        prefill = cuda_prefill.Prefill(backend)
        timed = []

        def wrap(name, fn):
            def run(*args, **kwargs):
                start = backend.stream.record()
                result = fn(*args, **kwargs)
                timed.append((name, start, backend.stream.record()))
                return result
            return run

        dequant = prefill_k.dequant
        prefill_k.dequant = wrap("dequant", dequant)       # called inside linear(): subtracted below
        for name in STEPS:
            setattr(prefill.ops, name, wrap(name, getattr(prefill.ops, name)))
        try:
            prompt = bench_prompt(model, n_tokens)
            prefill.run(prompt, 0, "last")                   # warm-up
            backend.stream.synchronize()
            timed.clear()
            start = backend.stream.record()
            prefill.run(prompt, 0, "last")
            end = backend.stream.record()
            end.synchronize()
        finally:
            prefill_k.dequant = dequant
        steps = defaultdict(float)
        for name, a, b in timed:
            steps[name] += cp.cuda.get_elapsed_time(a, b)
        steps["linear"] -= steps["dequant"]
        return cp.cuda.get_elapsed_time(start, end), dict(steps)


if __name__ == "__main__":
    for shape in sys.argv[1:] or list(MODELS):
        with tempfile.TemporaryDirectory() as tmp:
            config = tinf_config(json.loads((SHARED / "assets" / MODELS[shape]).read_text()))
            path = write_random_model(Path(tmp) / f"{shape}.tinf", config, "q4", 64, reuse_layers=True)
            total, steps = profile(path)
            print(f"{shape} q4 pp2048 {total:.1f} ms ({2048 / total * 1e3:.0f} tok/s): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1])), flush=True)
