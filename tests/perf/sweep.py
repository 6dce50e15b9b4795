"""Run by hand on a GPU (`python3 tests/perf/sweep.py SHAPE:QUANT ...`): what the load-time tuner leaves in the
decode step, one role at a time.

From a fresh tuning, every configuration the tuner can choose for a role (gemv.all_configs: each R,
width, split, depth, grid and refill; for the fused MLP its candidates) is timed in the step with the
other roles as tuned, as the tuner times steps (CudaBackend.step_us). Configurations that run the same
kernel on the same grid as another are timed once. Per role the three fastest are then timed again
against the tuned step (graph replays after the benchmark's prompt, ROUNDS rounds, order reversed
every other round), and the roles whose best beats the tuned step by more than 0.3% are timed
together."""
import sys

from chain import random_backend, timed_in_turn
from tinyinfer.kernels import build
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import mlp as mlp_k

ROUNDS = 3
WINS = 0.997             # a role's best counts when its median step is this fraction of the tuned one's


def label(tuning: dict, tuned: dict) -> str:
    return ",".join(f"{role}={c.label}" for role, c in tuning.items() if tuned.get(role) != c) or "tuned"


def alternated(b, prompt, tunings: list, tuned: dict) -> dict:
    """Median us per step of each tuning (label -> us), timed in alternated rounds; printed."""
    times = timed_in_turn(b, prompt, {label(t, tuned): b.build_step(t) for t in tunings}, ROUNDS)
    median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    for key in times:
        print(f"    {key}: {min(times[key]):.1f}-{max(times[key]):.1f}, median {median[key]:.1f} "
              f"({(median[key] / median['tuned'] - 1) * 100:+.2f}%)", flush=True)
    return median


def distinct_options(b, role: str, tuned: dict, fused: bool) -> list:
    """Every configuration of `role` but the tuned one, one per (kernel, grid) the step would run."""
    cc = b.compute_capability
    configs = gemv_k.all_configs(b.shapes[role], cc)
    if fused:        # the variants that read the fixed-point residual, built in parallel first
        build.compile_all(gemv_k.GemvModules([(b.pending_shape(role), b.pending_config(role, c)) for c in configs],
                                             cc).modules)
    seen, options = set(), []
    for config in configs:
        shape, kernel = (b.pending_shape(role), b.pending_config(role, config)) if fused else (b.shapes[role], config)
        runs = (gemv_k.name_expression(shape, kernel), b.gemv_launch(role, 0, config, pending=fused).grid)
        if runs not in seen and config != tuned[role]:
            seen.add(runs)
            options.append(config)
    return options


def sweep(shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        tuned = dict(b.tuning)
        fused = tuned.get("mlp") is not None
        roles = ["wqkv", "wo", "output"] + ([] if fused else ["w_gate_up", "w_down"])
        options = {role: distinct_options(b, role, tuned, fused) for role in roles}
        if fused:
            options["mlp"] = [c for c in mlp_k.CANDIDATES if c != tuned["mlp"]]
        print(f"{shape} {quant}: configurations per role {[(r, len(o)) for r, o in options.items()]}", flush=True)
        winners = {}
        for role, configs in options.items():
            times = {config: b.step_us({**tuned, role: config}) for config in configs}
            top = sorted(times, key=times.get)[:3]
            print(f"  {role} (tuned {tuned[role].label}, step {b.step_us(tuned):.1f} us): fastest "
                  + ", ".join(f"{c.label} {times[c]:.1f}" for c in top), flush=True)
            median = alternated(b, prompt, [tuned] + [{**tuned, role: c} for c in top], tuned)
            best = min(top, key=lambda c: median[label({**tuned, role: c}, tuned)])
            if median[label({**tuned, role: best}, tuned)] < median["tuned"] * WINS:
                winners[role] = best
        if len(winners) > 1:
            print(f"  together: {[(r, c.label) for r, c in winners.items()]}", flush=True)
            alternated(b, prompt, [tuned, {**tuned, **winners}], tuned)
        b.use_tuning(tuned)


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["llama2-7b:q4", "tinyllama:f16"]:
        sweep(*(spec.split(":") + ["q4"])[:2])
