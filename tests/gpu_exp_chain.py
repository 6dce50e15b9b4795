"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_chain.py [tinyllama|llama2-7b ...]`; not part
of the test suite): where the decode step's time goes inside the CUDA graph, where kernels overlap
through programmatic dependent launch and per-kernel timings alone do not add up.

For a random-weight q4 model it replays variants of the step graph and prints us per token:
the whole step, the step without each kernel role (the difference is that role's share of the
critical path), the GEMV grids capped at one block per SM (leaving room on every SM for the next
kernel's blocks to start their weight loads early), and a chain of as many empty PDL kernels (the
floor of one graph node after another)."""
import sys
import tempfile
from pathlib import Path

import numpy as np
import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_random import SHAPES  # noqa: E402
from tinyinfer.kernels import attention as attn_k  # noqa: E402
from tinyinfer.kernels import gemv as gemv_k  # noqa: E402
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


def time_step(backend, prompt, launches) -> float:
    backend.graph = backend.capture(launches)
    return graph_step_us(backend, prompt, STEPS)


def null_chain_us(backend, prompt, n_kernels, blocks, threads) -> float:
    kernel = cp.RawModule(code=NULL_SRC, options=("-arch=sm_90a",)).get_function("null_step")
    out = cp.zeros(blocks, cp.float32)
    launches = [Launch("null", kernel, (blocks,), (threads,), (out,), waits=True) for _ in range(n_kernels)]
    return time_step(backend, prompt, launches)


def run(shape: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{shape}.tinf"
        write_random_model(path, tinf_config(SHAPES[shape]), "q4", 64, reuse_layers=True)
        with load(path, device="cuda") as model:
            b = model.backend
            prompt = bench_prompt(model, 16)
            tuning = b.tuning
            print(f"{shape} q4 tuning {[(r, c.row_tiles, c.warps) for r, c in tuning.items()]}", flush=True)
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
            n = len(b.step)
            for blocks, threads in ((b.n_sms, 256), (2 * b.n_sms, 256), (4 * 32, 128)):
                us = null_chain_us(b, prompt, n, blocks, threads)
                print(f"{n} empty PDL kernels, {blocks}x{threads}: {us:.1f} us per chain, {us / n:.2f} us per kernel",
                      flush=True)
            source_variants(b, prompt, tuning)
            b.graph = b.capture(b.step)


# (label, file, [(old, new), ...]): kernels edited to leave a stage out or change a constant.
ATTENTION_VARIANTS = [
    ("attention returns after pdl_wait", [("    pdl_wait();\n    if (begin < end)\n", "    pdl_wait();\n    return;\n    if (begin < end)\n")]),
    ("attention without the slice merge", [("#if ATT_USE_CLUSTER\n    if (active == 1) return;", "#if ATT_USE_CLUSTER\n    return;")]),
    ("attention granule 32", [("#define ATT_GRANULE 16 ", "#define ATT_GRANULE 32 ")]),
    ("attention granule 64", [("#define ATT_GRANULE 16 ", "#define ATT_GRANULE 64 ")]),
]
def edited(name, edits, exprs=()):
    src = expanded_source(name)
    for old, new in edits:
        assert old in src, f"{name} changed: update the variant ({old[:40]}...)"
        src = src.replace(old, new)
    return cp.RawModule(code=src, options=compile_options(b_cc), name_expressions=list(exprs))


def old_attention(b):
    """The attention kernel of git HEAD~N (the global-merge, register-batch version), as a module and
    its shared-memory formula, for comparison."""
    src = Path(OLD_ATTENTION_FILE).read_text()
    common = expanded_source("common.cuh")
    mod = cp.RawModule(code=src.replace('#include "common.cuh"', common), options=compile_options(b.compute_capability),
                       name_expressions=["attention<true>", "attention<false>"])

    def shared(n_heads, n_kv, hd, slices, tile):
        group = n_heads // n_kv
        chunks = -(-group // (4 if tile else 1))
        parts = max(1, 4 // chunks)
        floats = (1 + parts) * group * hd + (2 * parts * group + 3) // 4 * 4
        return 4 * floats + 2 * 2 * hd + 4 * 8 * slices
    return mod, shared


OLD_ATTENTION = "9080c1c"
OLD_ATTENTION_FILE = "gpu_assets/old_attention.cu"   # git show 9080c1c:kernels/attention.cu


def with_slices(b, slices):
    b.slices = slices
    b.part_o = cp.zeros(b.n_heads * slices * b.head_dim, cp.float32)
    b.part_ml = cp.zeros(b.n_heads * slices * 2, cp.float32)


def source_variants(b, prompt, tuning) -> None:
    global b_cc
    b_cc = b.compute_capability
    base_attn, base_slices, base_shared = b.attn_module, b.slices, attn_k.shared_bytes
    whole = time_step(b, prompt, b.build_step(tuning))
    print(f"  base step {whole:.1f} us", flush=True)
    for label, edits in ATTENTION_VARIANTS:
        b.attn_module = edited("attention.cu", edits, ("attention<true>", "attention<false>"))
        print(f"  {label}: {time_step(b, prompt, b.build_step(tuning)) - whole:+.1f} us", flush=True)
    global_slices = attn_k.n_slices(b.n_kv, b.max_context, b.n_sms, False)
    for halves in (2048, 4096):
        attn_k.STAGE_HALVES = halves
        stage = [("#define ATT_STAGE_HALVES 4096 ", f"#define ATT_STAGE_HALVES {halves} ")]
        for cluster in (True, False):
            b.attn_module = edited("attention.cu", stage + ([] if cluster else [
                ("#ifndef ATT_USE_CLUSTER ", "#define ATT_USE_CLUSTER 0\n#ifndef ATT_USE_CLUSTER ")]),
                ("attention<true>", "attention<false>"))
            with_slices(b, base_slices if cluster else global_slices)
            step = b.build_step(tuning)
            line = f"  stage {halves} halves, {'cluster' if cluster else 'global'} merge: {time_step(b, prompt, step) - whole:+.1f} us"
            for launch in step:
                try:
                    launch.kernel.preferred_shared_memory_carveout = 100
                except Exception as e:  # noqa: BLE001
                    line += f" (carveout: {e})"
                    break
            print(line + f"; all kernels carveout 100: {time_step(b, prompt, step) - whole:+.1f} us", flush=True)
            for launch in step:
                try:
                    launch.kernel.preferred_shared_memory_carveout = -1
                except Exception:  # noqa: BLE001
                    break
    attn_k.STAGE_HALVES = 4096
    b.attn_module, attn_k.shared_bytes = old_attention(b)
    with_slices(b, global_slices)
    print(f"  attention of {OLD_ATTENTION}: {time_step(b, prompt, b.build_step(tuning)) - whole:+.1f} us", flush=True)
    b.attn_module, attn_k.shared_bytes = base_attn, base_shared
    with_slices(b, base_slices)


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["tinyllama", "llama2-7b"]:
        run(shape)
