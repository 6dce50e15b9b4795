"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_graph_ab.py A.cu B.cu SHAPE[:QUANT] ...`; not
part of the test suite): two versions of gemv.cu compared inside the whole decode step. For each
random-weight model, both versions are compiled into the same backend (tuned with the package's
gemv.cu) and the step graph is timed alternately, four times each; prints the median us per token.
Alternating in one process keeps both sides on the same machine, clocks and tuned configurations."""
import sys
import tempfile
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_random import SHAPES  # noqa: E402
from gpu_exp_chain import time_step  # noqa: E402
from tinyinfer.kernels import gemv as gemv_k  # noqa: E402
from tinyinfer.kernels.build import INCLUDE, compile_options, source_text  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.bench import bench_prompt, tinf_config, write_random_model  # noqa: E402

ROUNDS = 4


def expanded(path: str) -> str:
    """A gemv.cu from anywhere, with the package's headers inlined."""
    return INCLUDE.sub(lambda m: source_text(m.group(1)).replace("#pragma once", ""), Path(path).read_text())


def compare(a_path: str, b_path: str, shape: str, quant: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{shape}.tinf"
        write_random_model(path, tinf_config(SHAPES[shape]), quant, 64, reuse_layers=True)
        with load(path, device="cuda") as model:
            b = model.backend
            prompt = bench_prompt(model, 16)
            items = [(s, rt) for s in b.shapes.values() for rt, _ in gemv_k.CANDIDATES]
            expressions = sorted({gemv_k.name_expression(s, rt) for s, rt in items})
            modules = {side: cp.RawModule(code=expanded(p), options=compile_options(b.compute_capability),
                                          name_expressions=expressions)
                       for side, p in (("A", a_path), ("B", b_path))}
            times = {"A": [], "B": []}
            for _ in range(ROUNDS):
                for side, module in modules.items():
                    b.gemv_module = module
                    times[side].append(time_step(b, prompt, b.build_step(b.tuning)))
            median = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
            print(f"{shape} {quant} tuning {[(r, c.row_tiles, c.warps) for r, c in b.tuning.items()]}: "
                  f"A {median['A']:.1f} us ({1e6 / median['A']:.0f} tok/s), B {median['B']:.1f} us "
                  f"({1e6 / median['B']:.0f} tok/s), B - A {median['B'] - median['A']:+.1f} us", flush=True)


if __name__ == "__main__":
    a_path, b_path = sys.argv[1:3]
    for spec in sys.argv[3:] or ["tinyllama", "llama2-7b"]:
        compare(a_path, b_path, *(spec.split(":") + ["q4"])[:2])
