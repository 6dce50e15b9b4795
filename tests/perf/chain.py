"""Run by hand on a GPU (`python3 tests/perf/chain.py [SHAPE[:QUANT] ...] [--only PART]`): where the decode
step's time goes inside the CUDA graph, where kernels overlap through programmatic dependent launch and
per-kernel timings alone do not add up.

For a random-weight model (q4 unless SHAPE:QUANT says otherwise) it replays variants of the step graph and prints us per token:
the whole step, the step without each kernel role (the difference is that role's share of the
critical path), the GEMV grids capped at one block per SM (leaving room on every SM for the next
kernel's blocks to start their weight loads early), a chain of as many empty PDL kernels (the
floor of one graph node after another), attention variants (a stage left out, the slice
granule, threads per block, cluster or global merge) and GEMV variants (every GEMV returning right
after its PDL wait or after staging its input, or staging without reading x: upper bounds of what
each stage costs, with wrong results)."""
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from bench_random import SHAPES  # noqa: E402
from tinyinfer.kernels import attention as attn_k  # noqa: E402
from tinyinfer.kernels import gemv as gemv_k  # noqa: E402
from tinyinfer.kernels import build  # noqa: E402
from tinyinfer.kernels.build import Launch, compile_options, expanded_source  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.bench import bench_prompt, graph_step_us, tinf_config, write_random_model  # noqa: E402

NULL_SRC = r"""
extern "C" __global__ void null_step(float* out) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (threadIdx.x == 0) out[blockIdx.x] += 1.f;
}
"""
STEPS = 128
uncapped = gemv_k.resident_blocks


def capped(limit):
    def resident(kernel, threads, shared):
        per_sm, sms = uncapped(kernel, threads, shared)
        return min(per_sm, limit), sms
    return resident


def roles_and_grids(b, prompt, tuning) -> None:
    """The whole step, and without each role, with the GEMV grids as tuned and capped at 1 block/SM."""
    for label, limit in (("grid as tuned", 64), ("gemv <= 1 block/SM", 1)):
        gemv_k.resident_blocks = capped(limit)
        step = b.build_step(tuning)
        whole = time_step(b, prompt, step)
        line = [f"{label}: step {whole:.1f} us ({1e6 / whole:.0f} tok/s)"]
        for role in ("gemv wqkv", "attention", "gemv wo", "gemv w_gate_up", "gemv w_down"):
            rest = [x for x in step if not x.name.startswith(role)]
            line.append(f"without {role.split()[-1]} -{whole - time_step(b, prompt, rest):.1f}")
        print("; ".join(line), flush=True)
    gemv_k.resident_blocks = uncapped


def null_chains(b, prompt, tuning) -> None:
    n = len(b.step)
    for blocks, threads in ((b.n_sms, 256), (2 * b.n_sms, 256), (4 * 32, 128)):
        us = null_chain_us(b, prompt, n, blocks, threads)
        print(f"{n} empty PDL kernels, {blocks}x{threads}: {us:.1f} us per chain, {us / n:.2f} us per kernel",
              flush=True)


def time_step(backend, prompt, launches) -> float:
    backend.graph = backend.capture(launches)
    return graph_step_us(backend, prompt, STEPS)


def timed_in_turn(backend, prompt, steps: dict, rounds: int) -> dict:
    """key -> the times of steps[key] (a step's launches), each timed `rounds` times in turn, the order
    reversed every other round, so drifts of the machine hit every step alike."""
    times = {key: [] for key in steps}
    keys = list(steps)
    for round_ in range(rounds):
        for key in keys if round_ % 2 == 0 else keys[::-1]:
            times[key].append(time_step(backend, prompt, steps[key]))
    return times


def print_in_turn(times: dict, name=str) -> None:
    """For timed_in_turn's result: each step's range, median and tok/s, and the change of its median
    from the first step's; name(key) labels it."""
    median = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
    base = median[next(iter(times))]
    for key, t in times.items():
        print(f"  {name(key)}: {min(t):.1f}-{max(t):.1f} us, median {median[key]:.1f} "
              f"({1e6 / median[key]:.0f} tok/s, {(median[key] / base - 1) * 100:+.2f}%)", flush=True)


def null_chain_us(backend, prompt, n_kernels, blocks, threads) -> float:
    kernel = cp.RawModule(code=NULL_SRC, options=("-arch=sm_90a",)).get_function("null_step")
    out = cp.zeros(blocks, cp.float32)
    launches = [Launch("null", kernel, (blocks,), (threads,), (out,), waits=True) for _ in range(n_kernels)]
    return time_step(backend, prompt, launches)


@contextmanager
def random_backend(shape: str, quant: str):
    """(CUDA backend, 16-token prompt) of a random-weight model with the real shape, tuning printed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{shape}.tinf"
        write_random_model(path, tinf_config(SHAPES[shape]), quant, 64, reuse_layers=True)
        with load(path, device="cuda") as model:
            b = model.backend
            print(f"{shape} {quant} tuning {[(r, c.label) for r, c in b.tuning.items()]}", flush=True)
            yield b, bench_prompt(model, 16)


def run(shape: str, quant: str) -> None:
    with random_backend(shape, quant) as (b, prompt):
        for part in PARTS:
            part(b, prompt, b.tuning)
        b.graph = b.capture(b.step)


# (label, [(old, new), ...]): the attention kernel edited to leave a stage out or change a constant.
def attention_variants(cluster: bool):
    merge = "#if ATT_USE_CLUSTER\n    if (active == 1) return;" if cluster else "#else\n    if (active == 1) return;"
    return [
        ("attention returns after pdl_wait", [("    pdl_wait();\n    TI_MARK(1);\n    if (begin < end) {\n",
                                               "    pdl_wait();\n    return;\n    if (begin < end) {\n")]),
        ("attention without the slice merge", [(merge, merge.replace("if (active == 1) return;", "return;"))]),
        ("attention granule 32", [("#define ATT_GRANULE 16 ", "#define ATT_GRANULE 32 ")]),
        ("attention granule 64", [("#define ATT_GRANULE 16 ", "#define ATT_GRANULE 64 ")]),
    ]


def edited_attention(b, edits, cluster: bool):
    src = expanded_source("attention.cu")
    for old, new in edits:
        assert old in src, f"attention.cu changed: update the variant ({old[:40]}...)"
        src = src.replace(old, new)
    options = compile_options(b.compute_capability) + (f"-DATT_USE_CLUSTER={int(cluster)}",)
    return cp.RawModule(code=src, options=options)


def with_plan(b, plan):
    """The backend set to an attention plan, with merge buffers for its slices."""
    b.attn_plan = plan
    b.part_o = cp.zeros(b.n_heads * plan.slices * b.head_dim, cp.float32)
    b.part_ml = cp.zeros(b.n_heads * plan.slices * 2, cp.float32)


def source_variants(b, prompt, tuning) -> None:
    """Edits of the chunked attention kernel (forced for the measurement: TinyLlama's plan is
    attention_rows) and its merge variants, against the step as planned."""
    base_attn, base_plan = b.attn_module, b.attn_plan
    whole = time_step(b, prompt, b.build_step(tuning))
    print(f"  base step {whole:.1f} us (attention: {base_plan.kernel}, {base_plan.threads} threads, "
          f"{'in clusters' if base_plan.cluster else 'in global memory'})", flush=True)
    chunked = attn_k.plan(b.n_heads, b.n_kv, b.head_dim, b.max_context, b.n_sms, b.compute_capability, "chunked")
    with_plan(b, chunked)
    b.attn_module = edited_attention(b, [], chunked.cluster)
    print(f"  chunked kernel: {time_step(b, prompt, b.build_step(tuning)) - whole:+.1f} us", flush=True)
    for label, edits in attention_variants(chunked.cluster):
        b.attn_module = edited_attention(b, edits, chunked.cluster)
        print(f"  {label}: {time_step(b, prompt, b.build_step(tuning)) - whole:+.1f} us", flush=True)
    for threads in (128, 256):
        for cluster in (True, False):
            b.attn_module = edited_attention(b, [], cluster)
            with_plan(b, replace(chunked, cluster=cluster, threads=threads,
                                 slices=attn_k.n_slices(b.n_kv, b.max_context, b.n_sms, cluster)))
            us = time_step(b, prompt, b.build_step(tuning)) - whole
            print(f"  {threads} threads, {'cluster' if cluster else 'global'} merge: {us:+.1f} us", flush=True)
    b.attn_module = base_attn
    with_plan(b, base_plan)


GEMV_VARIANTS = [   # (label, [(old, new, count), ...]) edits of gemv.cu (results wrong, time only)
    ("gemv returns after pdl_wait", [("        pdl_wait();\n", "        pdl_wait();\n        return;\n", 2)]),
    ("gemv returns after staging x", [("    if (!OWN) __syncthreads();\n    TI_MARK(3);",
                                       "    if (!OWN) __syncthreads();\n    return;\n    TI_MARK(3);", 1)]),
    ("gemv stages zeros (no x reads)", [("load8_input<IN>(x, pending, 8 * b, v);",
                                         "for (int e = 0; e < 8; ++e) v[e] = 0.f;", 1),
                                        ("load8_input<IN>(x, pending, 8 * b, v[i], true);",
                                         "for (int e = 0; e < 8; ++e) v[i][e] = 0.f;", 1)]),
]
PACKAGE_SOURCE = build.source_text


def use_sources(version: str | None) -> None:
    """Kernels compiled from here on use the sources of `version` (None: the package's): a gemv.cu
    file, or a folder holding any of the package's kernel sources, which replace the package's own."""
    files = {}
    if version:
        path = Path(version)
        files = {f.name: f for f in path.iterdir()} if path.is_dir() else {"gemv.cu": path}
    build.source_text = lambda name: files[name].read_text() if name in files else PACKAGE_SOURCE(name)
    build.module.cache_clear()


def step_with(b, version: str | None, tuning: dict | None = None) -> list:
    """The step's launches for `tuning` (default: the tuned one), with every gemv.cu-based kernel (the
    tuned GEMVs, the variants that read the fused step's fixed-point residual, the fused MLP) built
    from `version`'s sources (None: the package's). Leaves b.gemv_module holding the version's GEMVs."""
    tuning = b.tuning if tuning is None else tuning
    use_sources(version)
    try:
        tuned = [(b.shapes[role], config) for role, config in tuning.items() if role in b.shapes]
        b.gemv_module = gemv_k.compile_gemvs(tuned, b.compute_capability)
        return b.build_step(tuning)
    finally:
        use_sources(None)


def edited_step(b, edits) -> list:
    """The tuned step with the package's gemv.cu edited by (old, new, count) edits (step_with)."""
    src = PACKAGE_SOURCE("gemv.cu")
    for old, new, count in edits:
        assert src.count(old) == count, f"gemv.cu changed: update the variant ({old[:40]}...)"
        src = src.replace(old, new)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemv.cu"
        path.write_text(src)
        return step_with(b, str(path))


def gemv_variants(b, prompt, tuning) -> None:
    base = b.gemv_module
    whole = time_step(b, prompt, b.build_step(tuning))
    print(f"  base step {whole:.1f} us", flush=True)
    for label, edits in GEMV_VARIANTS:
        print(f"  {label}: {time_step(b, prompt, edited_step(b, edits)) - whole:+.1f} us", flush=True)
    b.gemv_module = base


# Where the kernels let their dependents start (griddepcontrol.launch_dependents): at the top, as
# submitted, every kernel lets the next one start at once, so several kernels ahead are resident and
# prefetching weights while the current one reads its input; later triggers keep fewer ahead.
GEMV_TOP = ("    pdl_launch_dependents();\n    // OUT_ADD", "    // OUT_ADD", 1)
ATT_TOP = ("    pdl_launch_dependents();\n    const int pos", "    const int pos")
TRIGGER = "pdl_launch_dependents();\n"
GEMV_AFTER_WAIT = ("        TI_MARK(1);\n", "        TI_MARK(1);\n        " + TRIGGER, 2)
ATT_AFTER_WAIT = ("    TI_MARK(1);\n", "    TI_MARK(1);\n    " + TRIGGER)
TRIGGER_VARIANTS = [   # (label, gemv.cu edits (old, new, count), attention.cu edits (old, new))
    ("gemv triggers after its wait", [GEMV_TOP, GEMV_AFTER_WAIT], []),
    ("gemv triggers after staging", [GEMV_TOP, ("    TI_MARK(3);", "    " + TRIGGER + "    TI_MARK(3);", 1)], []),
    ("gemv triggers after its products",
     [GEMV_TOP, ("        if (ti == my_tiles - 1) TI_MARK(6);", "        " + TRIGGER + "        if (ti == my_tiles - 1) TI_MARK(6);", 1)],
     []),
    ("attention triggers after its wait", [], [ATT_TOP, ATT_AFTER_WAIT]),
    ("both after the wait", [GEMV_TOP, GEMV_AFTER_WAIT], [ATT_TOP, ATT_AFTER_WAIT]),
]


def trigger_variants(b, prompt, tuning) -> None:
    base_gemv, base_attn = b.gemv_module, b.attn_module
    whole = time_step(b, prompt, b.build_step(tuning))
    print(f"  base step {whole:.1f} us", flush=True)
    for label, gemv_edits, attention_edits in TRIGGER_VARIANTS:
        b.attn_module = edited_attention(b, attention_edits, b.attn_plan.cluster)
        print(f"  {label}: {time_step(b, prompt, edited_step(b, gemv_edits)) - whole:+.1f} us", flush=True)
    b.gemv_module, b.attn_module = base_gemv, base_attn


def tune_in_graph(b, prompt, tuning) -> None:
    """Each role's GEMV configuration chosen by the whole step's graph time (one role at a time, the
    others as tuned), against the load-time tuner's choice from kernels timed alone."""
    best = dict(tuning)
    base = time_step(b, prompt, b.build_step(best))
    for role in best:
        times = {}
        for config in gemv_k.configs_for(b.shapes[role], b.compute_capability):
            times[config] = time_step(b, prompt, b.build_step({**best, role: config}))
        best[role] = min(times, key=times.get)
        print(f"  in-graph tuning {role}: " + ", ".join(f"{c.label} {t:.1f}" for c, t in times.items()), flush=True)
    final = time_step(b, prompt, b.build_step(best))
    print(f"  in-graph tuning: {base:.1f} -> {final:.1f} us", flush=True)


PARTS = [roles_and_grids, null_chains, source_variants, gemv_variants, trigger_variants, tune_in_graph]

if __name__ == "__main__":
    # python3 tests/perf/chain.py [SHAPE[:QUANT] ...] [--only PART]   (PART: a function name in PARTS)
    args = sys.argv[1:]
    if "--only" in args:
        only = args[args.index("--only") + 1]
        PARTS = [p for p in PARTS if p.__name__ == only]
        args = [a for a in args if a not in ("--only", only)]
    for spec in args or ["tinyllama", "llama2-7b"]:
        run(*(spec.split(":") + ["q4"])[:2])
