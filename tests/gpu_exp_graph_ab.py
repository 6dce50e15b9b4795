"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_graph_ab.py A.cu B.cu SHAPE[:QUANT] ...`; not
part of the test suite): two versions of gemv.cu compared inside the whole decode step. For each
random-weight model, both versions are compiled into the same backend (tuned with the package's
gemv.cu) and the step graph is timed alternately, four times each; prints the median us per token.
Alternating in one process keeps both sides on the same machine, clocks and tuned configurations."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_exp_chain import gemv_module, random_backend, time_step  # noqa: E402
from tinyinfer.kernels.build import INCLUDE, source_text  # noqa: E402

ROUNDS = 4


def expanded(path: str) -> str:
    """A gemv.cu from anywhere, with the package's headers inlined."""
    return INCLUDE.sub(lambda m: source_text(m.group(1)).replace("#pragma once", ""), Path(path).read_text())


def compare(a_path: str, b_path: str, shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        modules = {"A": gemv_module(b, expanded(a_path)), "B": gemv_module(b, expanded(b_path))}
        times = {"A": [], "B": []}
        for _ in range(ROUNDS):
            for side, module in modules.items():
                b.gemv_module = module
                times[side].append(time_step(b, prompt, b.build_step(b.tuning)))
        median = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
        print(f"  A {median['A']:.1f} us ({1e6 / median['A']:.0f} tok/s), B {median['B']:.1f} us "
              f"({1e6 / median['B']:.0f} tok/s), B - A {median['B'] - median['A']:+.1f} us", flush=True)


if __name__ == "__main__":
    a_path, b_path = sys.argv[1:3]
    for spec in sys.argv[3:] or ["tinyllama", "llama2-7b"]:
        compare(a_path, b_path, *(spec.split(":") + ["q4"])[:2])
