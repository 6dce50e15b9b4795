"""s17: the fused MLP (kernels/mlp.cu) against the two GEMVs in the decode step. Tune afresh (the
tuner's own fusion contest), then alternate: unfused, and every fused configuration, with the same
GEMV choices (us per token, graph replays).
  python3 tests/gpu_exp_mlp_ab_mlp.py SHAPE:QUANT ..."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests"))
import gpu_exp_chain as chain  # noqa: E402
from tinyinfer.kernels import mlp as mlp_k  # noqa: E402
from tinyinfer.runtime import autotune  # noqa: E402

autotune.load_cached = lambda key: None      # every tune() measures
labels = lambda t: [(r, c.label) for r, c in t.items()]

for spec in sys.argv[1:]:
    shape, quant = spec.split(":")
    with chain.random_backend(shape, quant) as (b, prompt):
        tick = time.time()
        t = b.tune()
        print(f"{spec}: tuned in {time.time() - tick:.2f} s; {labels(t)}", flush=True)
        contest = b.step_contests.get("mlp", {})
        print(f"{spec} fusion contest: " + ", ".join(f"{c.label if c else 'unfused'} {us:.1f}" for c, us in contest.items()),
              flush=True)
        base = {r: c for r, c in t.items() if r != "mlp"}
        sides = {"unfused": base} | {c.label: {**base, "mlp": c} for c in mlp_k.CANDIDATES}
        res = {k: [] for k in sides}
        for rnd in range(3):
            for k, tt in sides.items():
                res[k].append(round(chain.time_step(b, prompt, b.build_step(tt)), 1))
        for k, v in res.items():
            print(f"{spec} {k}: {v}", flush=True)
        b.use_tuning(t)
