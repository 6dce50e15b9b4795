"""Pick the fastest configuration of each GEMV shape at load time, and remember it.

Each distinct (shape, fusion) is timed over its candidate configurations (row tiles R x warps per
block, x split-K where it can run) on the model's own weights: one launch per layer, so every
launch streams weights that are not in L2, after an L2 flush and behind a GPU-side wait so the
host's launch cost stays out of the measurement. Where timing alone is known to mislead (a split-K
pick, a tie), the whole decode step settles it (confirm_in_step), and the ring depth, the grid's
balance and the ring's refill, which only show in the step, are chosen there (variants_in_step),
last with a contest's loser tried again together with its neighbour's depths (moves_in_step).
The choices are saved in a user cache keyed by the file's tensor checksums, the GPU, its compute
capability and the kernel sources, so a second load of the same file does not re-tune.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from pathlib import Path

CACHE_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("TINYINFER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tinyinfer")
    return Path(root) / "autotune"


def cache_key(tinf, gpu_name: str, compute_capability: int, kernel_hash: str) -> str:
    """The file is identified by its tensor directory (names, layout, CRC-32 of every tensor)."""
    digest = hashlib.sha256()
    for name in tinf.names:
        info = tinf.info(name)
        digest.update(f"{name}|{info.encoding}|{list(info.shape)}|{info.group}|{info.offset}|{info.crc32};".encode())
    digest.update(f"{gpu_name}|{compute_capability}|{kernel_hash}|{CACHE_VERSION}".encode())
    return digest.hexdigest()[:24]


def load_cached(key: str) -> dict | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("choices") if isinstance(data, dict) else None


def save_cached(key: str, choices: dict, about: dict) -> Path | None:
    """Write atomically; a read-only home only costs a re-tune next time."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"choices": choices, **about}, indent=1, sort_keys=True))
        os.replace(tmp, folder / f"{key}.json")
        return folder / f"{key}.json"
    except OSError:
        return None


def time_launches(launches, stream, wait_factory, flush=None, repeats: int = 3, early: bool = False) -> float:
    """Median microseconds per launch of the sequence `launches`, run back to back on the GPU
    (early: with programmatic dependent launch, as in the decode graph)."""
    import cupy as cp

    times = []
    for _ in range(repeats):
        if flush is not None:
            flush(stream)
        wait_factory(20_000 * len(launches) + 50_000)(stream)   # covers the host's enqueue time
        start = stream.record()
        for launch in launches:
            launch(stream, early=early)
        end = stream.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / len(launches))
    return statistics.median(times)


# Configurations timed within this fraction of the fastest count as tied.
TIE = 0.03


def tied(times: dict) -> list:
    """The configurations timed within TIE of the fastest, fastest first."""
    fastest = min(times.values())
    return sorted((config for config, us in times.items() if us <= fastest * (1 + TIE)), key=times.get)


def pick(times: dict):
    """The fastest configuration; among those tied with it, one without split-K, then one of
    ordinary width (not gemv's wide block), then the one with the fewest row tiles.

    Timed alone, R = 1 and R = 2 often tie on small matrices, and which one wins follows noise; in
    the decode step the smaller tiles (twice the blocks) were the faster every time it was measured
    (runtime/README.md, "Tuning"). A split-K cluster occupies twice the block slots, which the next
    kernel's early blocks would otherwise use, so it must win outright; so must a wide block, which
    takes a whole SM."""
    return min(tied(times), key=lambda config: (config.split, config.wide, config.row_tiles, times[config]))


# In the whole step, a challenger must beat the incumbent by at least this fraction.
STEP_MARGIN = 0.005


def step_contest(chosen, times: dict):
    """(incumbent, challengers) to settle in the whole decode step, or None.

    Kernels timed alone mislead in two known ways (runtime/README.md, "Tuning"): a split-K cluster
    can win alone and still slow the step (its second block per tile takes register-file room the
    next kernel's early blocks would use), so an unsplit configuration is the incumbent against it;
    and a tie given to fewer row tiles can cost the step, so every configuration tied with the
    fastest alone (TIE) challenges the tie's winner, not only the fastest. A wide block (16 warps)
    is held to the same test as split-K: it too can be fastest alone and slow the step."""
    incumbent = chosen
    if chosen.split > 1 or chosen.wide:
        incumbent = pick({c: us for c, us in times.items() if c.split == 1 and not c.wide})
    challengers = [c for c in dict.fromkeys([chosen, *tied(times)]) if c != incumbent]
    return (incumbent, challengers) if challengers else None


# A contest's loser is tried again (at other depths, then with its neighbour's depths) only while its
# best step time is within this fraction of the fastest timed for its role: the losers that later won
# were well within it, those far behind never won, and each try costs a step timing
# (runtime/README.md, "Tuning").
RIVAL_NEAR = 0.05


def near(us: float, times) -> bool:
    """Whether a step time `us` is within RIVAL_NEAR of the fastest of `times`."""
    return us <= min(times) * (1 + RIVAL_NEAR)


def confirm_in_step(best: dict, timings: dict, step_us, rounds: int = 1) -> tuple[dict, dict]:
    """Settle each role's contest (step_contest) by the whole step's time, one role at a time, each
    side timed `rounds` times, alternated (one round: two rounds tuned no faster steps and made a
    first load slower; runtime/README.md, "Tuning").

    best: role -> config picked from kernels timed alone; timings: role -> {config: us alone};
    step_us(tuning) -> GPU microseconds per decode step with that tuning. Returns (the choices,
    role -> {config: step us} for every contest held)."""
    held = {}
    for role in list(best):
        contest = step_contest(best[role], timings.get(role, {})) if timings.get(role) else None
        if contest is None:
            continue
        incumbent, challengers = contest
        times = {config: [] for config in [incumbent, *challengers]}
        for _ in range(rounds):                         # alternated, so drifts hit all alike
            for config in times:
                times[config].append(step_us({**best, role: config}))
        held[role] = {config: min(us) for config, us in times.items()}
        challenger = min(challengers, key=held[role].get)
        wins = held[role][challenger] < held[role][incumbent] * (1 - STEP_MARGIN)
        best = {**best, role: challenger if wins else incumbent}
    return best, held


def variants_in_step(best: dict, variants: dict, step_us) -> tuple[dict, dict]:
    """Each role's configuration among `variants` by the whole step's time, one role after the
    other (in the order of `variants`).

    Used for what only shows in the step. The ring depth: alone, the depths barely differ; in the
    step, where other kernels' blocks run beside it, they do (kernels/README.md, "Ring depth"). The
    grid's balance (gemv.grid_units), which changes which block slots the next kernels find free.
    The ring's refill during the products (gemv.cu REFILL), which won or lost by role and model. variants: role -> the configurations to try (e.g. the
    role's configuration at each depth, and the loser of its step contest at each depth:
    CudaBackend.depth_options). One replaces the current choice only when the step is faster by
    STEP_MARGIN. Returns (the choices, role -> {config: step us} for every configuration timed)."""
    held = {}
    if not variants:
        return best, held
    current = step_us(best)
    for role, options in variants.items():
        times = {best[role]: current}
        for config in options:
            if config not in times:
                times[config] = step_us({**best, role: config})
        held[role] = times
        fastest = min(times, key=times.get)
        if times[fastest] < current * (1 - STEP_MARGIN):
            best, current = {**best, role: fastest}, times[fastest]
    return best, held


def moves_in_step(best: dict, moves: list, step_us) -> tuple[dict, dict]:
    """The fastest of `moves` (each {role: config, ...}, changing one or more roles at once) by the
    whole step's time, taken when it beats the current choices by STEP_MARGIN. Returns (the
    choices, {move as a tuple of (role, config): step us}).

    For what one role at a time cannot find: in the step, a kernel's configuration interacts with
    its neighbours' (which blocks can start early beside which): two changes that each slow the
    step alone can speed it up together (runtime/README.md, "Tuning")."""
    held = {}
    if not moves:
        return best, held
    current = step_us(best)
    for move in moves:
        held[tuple(move.items())] = step_us({**best, **move})
    fastest = min(held, key=held.get)
    if held[fastest] < current * (1 - STEP_MARGIN):
        best = {**best, **dict(fastest)}
    return best, held


def tune(candidates: dict, stream, wait_factory, flush=None, early: bool = False) -> tuple[dict, dict]:
    """candidates: key -> {config: [Launch per layer]}. Returns (key -> chosen config, key -> {config: us}).

    early: launch with programmatic dependent launch as the decode graph does, so each layer's
    launch overlaps the previous one's tail; without it, the ranking can differ from the step's
    (runtime/README.md, "Tuning")."""
    best, timings = {}, {}
    for key, by_config in candidates.items():
        timings[key] = {config: time_launches(launches, stream, wait_factory, flush, early=early)
                        for config, launches in by_config.items()}
        best[key] = pick(timings[key])
    return best, timings
