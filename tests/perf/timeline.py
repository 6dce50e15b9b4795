"""Run by hand on a GPU (`python3 tests/perf/timeline.py [SHAPE[:QUANT] ...] [--twice ROLE]`): a timeline of the
decode step inside its CUDA graph, from the per-block timestamps that the kernels write when they are built
with TINYINFER_TIMELINE=1 (common.cuh: TimelineProbe).

Per kernel role it prints medians over layers and steps, in us. Relative to `prev`, the moment the
previous kernel's last block ended:
  start    the first block starts (negative: launched early through PDL)
  release  the first block returns from pdl_wait: the latency of the dependency itself
  spread   the last block's wait return minus the first's
then the median block's time between consecutive marks that the kernel records (SM clock; a mark a
block did not reach counts in the next one), named by the later mark, e.g. GEMV: m2 x landed (thread
0), m3 input staged, m4 first weights landed, m5 first item multiplied, m6 last item multiplied,
m7 partial sums reduced, m9 end (kernels/*.cu, TI_MARK); and
  tail     the last block's end minus the median block's end
  total    the last block's end minus prev: this kernel's share of the step
A second table splits each kernel's blocks by when they started: at least EARLY_US before the previous
kernel's last block ended (their weights in flight long before the release), or later (they started
when that kernel's blocks left their SM); per part the share of blocks and the median release, x
landed (m2) and staged (m3), in us.
With $OUT set, the raw records are saved there (timeline-SHAPE-QUANT[-twice-ROLE].npz) for offline
analysis.

`--twice ROLE` (repeatable) also times a step in which every layer's ROLE GEMV (or attention) is
launched a second time right after the first (into a scratch output): what that kernel costs when
its code, weights and input were just used on the same SMs.
"""
import os
import sys
from pathlib import Path

os.environ["TINYINFER_TIMELINE"] = "1"       # before any kernel is compiled

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from chain import random_backend  # noqa: E402
from tinyinfer.kernels.build import Launch  # noqa: E402
from tinyinfer.runtime.bench import graph_step_us  # noqa: E402

CAPACITY, MARKS = 1 << 17, 10       # TI_TIMELINE_CAPACITY, TI_MARKS in common.cuh
WORDS = 2 + 2 * MARKS
T0, C0 = 2, 2 + MARKS                # columns of the first global time and the first clock
STEPS = 3                # 7B: ~36K records a step
WARMUP = 128             # steps replayed after the 16-token prompt before recording
EARLY_US = 1.0           # by_start: blocks that started this long before the previous kernel ended


def probe_arrays(module):
    count = cp.ndarray((1,), cp.uint32, memptr=module.get_global("ti_timeline_count"))
    data = cp.ndarray((CAPACITY, WORDS), cp.uint64, memptr=module.get_global("ti_timeline"))
    return count, data


def modules(b):
    """Every module of the step: each holds its own probe buffer (with the MLP fused, also the fused
    kernel's and those of the GEMVs that read its pending sums)."""
    fused = []
    if b.tuning.get("mlp") is not None:
        from tinyinfer.kernels import gemv as gemv_k
        from tinyinfer.kernels import mlp as mlp_k

        cc = b.compute_capability
        fused.append(mlp_k.compile_mlp(b.mlp_shape(), b.tuning["mlp"], cc))
        fused += gemv_k.GemvModules([(b.pending_shape(r), b.pending_config(r, b.tuning[r]))
                                     for r in ("wqkv", "wo", "output")], cc).modules
    return (*b.gemv_module.modules, *fused, b.attn_module, b.sample_module)


def collect(b, prompt) -> np.ndarray:
    """Records of STEPS graph replays at about the middle of a 256-token benchmark's context."""
    graph_step_us(b, prompt, WARMUP)
    with b.stream:
        for m in modules(b):
            probe_arrays(m)[0].fill(0)
        for _ in range(STEPS):
            b.graph.launch(b.stream)
    b.stream.synchronize()
    rows = []
    for m in modules(b):
        count, data = probe_arrays(m)
        n = int(count.get()[0])
        if n > CAPACITY:
            raise SystemExit(f"{n} records for a capacity of {CAPACITY}: lower STEPS")
        rows.append(data[:n].get())
    return np.concatenate(rows)


def launches(records: np.ndarray) -> list[np.ndarray]:
    """Records grouped by launch, in order of each launch's first block start. A graph node keeps its
    grid id over replays, so blocks of one grid id that start more than 20 us apart are separate
    launches."""
    grids = {}
    for row in records:
        grids.setdefault(int(row[0]), []).append(row)
    groups = []
    for rows in grids.values():
        rows = np.array(sorted(rows, key=lambda r: r[T0]))
        cuts = np.nonzero(np.diff(rows[:, T0].astype(np.int64)) > 20_000)[0] + 1
        groups += np.split(rows, cuts)
    return sorted(groups, key=lambda g: g[:, T0].min())


def cycles_per_ns(records: np.ndarray) -> float:
    t = records[:, T0 + MARKS - 1].astype(np.float64) - records[:, T0]
    c = records[:, C0 + MARKS - 1].astype(np.float64) - records[:, C0]
    long = t > 2000
    return float(c[long].sum() / t[long].sum())


def timer_step_ns(records: np.ndarray) -> int:
    stamps = records[:, T0:T0 + MARKS]
    steps = np.diff(np.unique(stamps[stamps > 0]))
    return int(steps[steps > 0].min()) if len(steps) else 0


def mark_intervals(c: np.ndarray) -> np.ndarray:
    """[blocks, MARKS] clock stamps -> time from the previous reached mark (from mark 1 on), NaN where a
    mark was not reached."""
    out = np.full(c.shape, np.nan)
    for b in range(len(c)):
        last = c[b, 1] if c[b, 1] > 0 else np.nan
        for m in range(2, MARKS):
            if c[b, m] > 0:
                out[b, m] = c[b, m] - last
                last = c[b, m]
    return out


def measures(group: np.ndarray, prev_end: float, clock: float) -> dict:
    t = group[:, T0:T0 + MARKS].astype(np.float64)
    c = group[:, C0:C0 + MARKS].astype(np.float64)
    waited = t[:, 1] > 0
    end = t[:, MARKS - 1]
    row = {"blocks": len(group), "start": t[:, 0].min() - prev_end,
           "release": t[waited, 1].min() - prev_end if waited.any() else np.nan,
           "spread": t[waited, 1].max() - t[waited, 1].min() if waited.any() else np.nan}
    steps = mark_intervals(c) / clock
    for m in range(2, MARKS):
        column = steps[:, m][~np.isnan(steps[:, m])]
        row[f"m{m}"] = np.median(column) if len(column) else np.nan
    row.update({"tail": end.max() - np.median(end), "total": end.max() - prev_end})
    return {k: v / 1000.0 if k != "blocks" else v for k, v in row.items()}


def by_start(names: list[str], groups: list, clock: float) -> None:
    """Per kernel role, its blocks in two parts by start (EARLY_US): share, median release, m2 and m3."""
    parts = {}
    for i in range(1, len(groups)):
        prev_end = float(groups[i - 1][:, T0 + MARKS - 1].max())
        t = groups[i][:, T0:T0 + MARKS].astype(np.float64)
        c = groups[i][:, C0:C0 + MARKS].astype(np.float64)
        reached = (c[:, 1] > 0) & (c[:, 2] > 0) & (c[:, 3] > 0)
        early = (t[:, 0] - prev_end) / 1000.0 <= -EARLY_US
        rows = np.stack([early, (t[:, 1] - prev_end) / 1000.0, (c[:, 2] - c[:, 1]) / clock / 1000.0,
                         (c[:, 3] - c[:, 2]) / clock / 1000.0], axis=1)[reached]
        parts.setdefault(names[i % len(names)], []).append(rows)
    print(f"  by start (at least {EARLY_US:.0f} us before the previous kernel ended, or later): "
          "share of blocks, release, x landed (m2), staged (m3)", flush=True)
    for role, chunks in parts.items():
        rows = np.concatenate(chunks)
        if not len(rows):
            continue
        cells = []
        for label, mask in (("early", rows[:, 0] == 1), ("late", rows[:, 0] == 0)):
            if mask.any():
                med = np.median(rows[mask, 1:], axis=0)
                cells.append(f"{label} {mask.mean() * 100:3.0f}%: {med[0]:.2f} {med[1]:.2f} {med[2]:.2f}")
        print(f"  {role:<16}" + "   ".join(cells), flush=True)


def report(names: list[str], records: np.ndarray, step_us: float) -> None:
    groups = launches(records)
    if len(groups) != STEPS * len(names):
        print(f"  {len(groups)} launches recorded for {STEPS} x {len(names)}: names may not line up", flush=True)
    clock = cycles_per_ns(records)
    print(f"  SM clock {clock:.2f} GHz (from the records), global timer step {timer_step_ns(records)} ns, "
          f"step {step_us:.1f} us by events", flush=True)
    by_role = {}
    for i in range(1, len(groups)):
        prev_end = float(groups[i - 1][:, T0 + MARKS - 1].max())
        by_role.setdefault(names[i % len(names)], []).append(measures(groups[i], prev_end, clock))
    columns = ["start", "release", "spread"] + [f"m{m}" for m in range(2, MARKS)] + ["tail", "total"]
    print(f"  {'kernel':<16}{'n':>4}{'blocks':>7}" + "".join(f"{c:>8}" for c in columns) + f"{'sum':>8}", flush=True)
    step_sum = 0.0
    for role, rows in by_role.items():
        med = {}
        for c in columns:
            values = [r[c] for r in rows if not np.isnan(r[c])]
            med[c] = float(np.median(values)) if values else np.nan
        role_sum = float(np.sum([r["total"] for r in rows])) / STEPS
        step_sum += role_sum
        print(f"  {role:<16}{len(rows):>4}{rows[0]['blocks']:>7}" +
              "".join(f"{med[c]:>8.2f}" if not np.isnan(med[c]) else f"{'-':>8}" for c in columns) +
              f"{role_sum:>8.1f}", flush=True)
    print(f"  sum of totals per step {step_sum:.1f} us (the first launch of the first step is left out)", flush=True)
    by_start(names, groups, clock)


def launched_twice(step: list, role: str) -> list:
    """The step with each `gemv ROLE` (or `attention`) launch followed by a copy writing into a scratch
    output (a second attention launch appends the same K/V row again)."""
    out = []
    for launch in step:
        out.append(launch)
        if launch.name in (role, f"gemv {role}"):
            scratch = cp.zeros_like(launch.args[-1])
            out.append(Launch(f"{launch.name} again", launch.kernel, launch.grid, launch.block,
                              launch.args[:-1] + (scratch,), launch.shared_mem, waits=True))
    return out


def run(shape: str, quant: str, twice: list[str]) -> None:
    with random_backend(shape, quant) as (b, prompt):
        for role in [None] + twice:
            step = b.step if role is None else launched_twice(b.step, role)
            label = "" if role is None else f"-twice-{role}"
            if role is not None:
                print(f"{shape} {quant}, {role} launched twice:", flush=True)
            b.graph = b.capture(step)
            step_us = graph_step_us(b, prompt, 64)
            records = collect(b, prompt)
            names = [launch.name for launch in step]
            report(names, records, step_us)
            if os.environ.get("OUT"):
                np.savez_compressed(Path(os.environ["OUT"]) / f"timeline-{shape}-{quant}{label}.npz",
                                    records=records, names=np.array(names), step_us=step_us)
        b.graph = b.capture(b.step)


if __name__ == "__main__":
    args, twice = sys.argv[1:], []
    while "--twice" in args:
        i = args.index("--twice")
        twice.append(args[i + 1])
        del args[i:i + 2]
    for spec in args or ["tinyllama", "llama2-7b"]:
        run(*(spec.split(":") + ["q4"])[:2], twice)
