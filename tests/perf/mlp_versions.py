"""Run by hand on a GPU (`python3 tests/perf/mlp_versions.py A B [C ...] SHAPE:QUANT ...`): versions of the
kernel sources (folders, as in graph_ab.py) compared in the decode step with the fused MLP forced in at each
of several configurations, the other roles as tuned, and the unfused step beside them. A version folder may
hold a file `shared_extra` (a number of bytes): its fused MLP is then launched with that much more dynamic
shared memory than mlp.py's layout, for variants that keep something after it. Per configuration the steps are
timed in turn (ROUNDS times, the order reversed every other round; us per token, range and median, change from
the first version), and each step is replayed once more from the same state: its logits against the first
version's (max |difference|; 0 for a version that only reorders loads)."""
import sys
from pathlib import Path

from chain import random_backend, step_with, time_step, timed_in_turn
from tinyinfer.kernels import mlp as mlp_k

ROUNDS = 4
CONFIGS = [mlp_k.MlpConfig(8, 2, 2), mlp_k.MlpConfig(8, 1, 2), mlp_k.MlpConfig(8, 4, 1), mlp_k.MlpConfig(8, 2, 1)]
LAYOUT_BYTES = mlp_k.shared_bytes


def version_step(b, version: str | None, tuning: dict) -> list:
    extra_file = Path(version) / "shared_extra" if version else None
    extra = int(extra_file.read_text()) if extra_file and extra_file.exists() else 0
    mlp_k.shared_bytes = lambda shape, config: LAYOUT_BYTES(shape, config) + extra
    try:
        return step_with(b, version, tuning)
    finally:
        mlp_k.shared_bytes = LAYOUT_BYTES


def compare(paths: list, shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        package_module = b.gemv_module
        unfused = {role: c for role, c in b.tuning.items() if role != "mlp"}
        for config in CONFIGS:
            if not mlp_k.fits(b.mlp_shape(), config):
                continue
            steps = {Path(p).name: version_step(b, p, {**unfused, "mlp": config}) for p in paths}
            steps["unfused"] = version_step(b, None, unfused)
            b.gemv_module = package_module
            times = timed_in_turn(b, prompt, steps, ROUNDS)
            median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
            base = median[Path(paths[0]).name]
            print(f"  {config.label}: " + "; ".join(
                f"{key} {min(t):.1f}-{max(t):.1f} median {median[key]:.1f} ({(median[key] / base - 1) * 100:+.2f}%)"
                for key, t in times.items()), flush=True)
            logits = {}
            for key, step in steps.items():
                time_step(b, prompt, step)
                logits[key] = b.logits.get()
            first = logits[Path(paths[0]).name]
            print("    logits, max |difference| from the first: "
                  + ", ".join(f"{key} {abs(v - first).max():.3g}" for key, v in logits.items()), flush=True)


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if Path(a).exists()]
    specs = [a for a in sys.argv[1:] if not Path(a).exists()]
    for spec in specs or ["tinyllama:f16"]:
        compare(paths, *(spec.split(":") + ["q4"])[:2])
