"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_graph_ab.py A.cu B.cu SHAPE[:QUANT] ...`; not
part of the test suite): two versions of gemv.cu compared inside the whole decode step. For each
random-weight model (tuned with the package's sources), each version builds every kernel of the
step that includes gemv.cu: the tuned GEMVs, the variants that read the fused step's fixed-point
residual, and the fused MLP (mlp.cu includes gemv.cu). The two steps are then timed alternately,
ROUNDS times each; prints each side's range and median us per token. Alternating in one process
keeps both sides on the same machine, clocks and tuned configurations."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_exp_chain import random_backend, time_step  # noqa: E402
from tinyinfer.kernels import build  # noqa: E402
from tinyinfer.kernels import gemv as gemv_k  # noqa: E402

ROUNDS = 4
PACKAGE_SOURCE = build.source_text


def use_gemv_source(path: str | None) -> None:
    """Kernels compiled from here on include the gemv.cu at `path` (None: the package's)."""
    text = Path(path).read_text() if path else None
    build.source_text = (lambda name: text if name == "gemv.cu" else PACKAGE_SOURCE(name)) if text else PACKAGE_SOURCE
    build.module.cache_clear()


def step_with(b, path: str) -> list:
    """The tuned step's launches, with every gemv.cu-based kernel built from `path`."""
    use_gemv_source(path)
    try:
        tuned = [(b.shapes[role], config) for role, config in b.tuning.items() if role in b.shapes]
        b.gemv_module = gemv_k.compile_gemvs(tuned, b.compute_capability)
        return b.build_step(b.tuning)
    finally:
        use_gemv_source(None)


def compare(a_path: str, b_path: str, shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        package_module = b.gemv_module
        steps = {"A": step_with(b, a_path), "B": step_with(b, b_path)}
        b.gemv_module = package_module
        times = {"A": [], "B": []}
        for round_ in range(ROUNDS):
            for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                times[side].append(time_step(b, prompt, steps[side]))
        median = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
        for side, t in times.items():
            print(f"  {side} {min(t):.1f}-{max(t):.1f} us, median {median[side]:.1f} ({1e6 / median[side]:.0f} tok/s)",
                  flush=True)
        print(f"  B - A {median['B'] - median['A']:+.1f} us ({(median['B'] / median['A'] - 1) * 100:+.2f}%)", flush=True)


if __name__ == "__main__":
    a_path, b_path = sys.argv[1:3]
    for spec in sys.argv[3:] or ["tinyllama", "llama2-7b"]:
        compare(a_path, b_path, *(spec.split(":") + ["q4"])[:2])
