"""CI without a GPU: every kernel source compiles with nvcc for Turing, Ampere and Hopper.

Templates are instantiated explicitly in a small wrapper file (NVRTC instantiates them at run time
through name expressions). Skipped when nvcc is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tinyinfer.kernels.build import SOURCES, source_text

NVCC = shutil.which("nvcc")
ARCHES = ["sm_75", "sm_86", "sm_90"]
GEMV_ARGS = ("(const unsigned char*, const __half*, int, int, int, const float*, const float*, float, float*, long long*, "
             "unsigned long long*, const float*)")
MLP_ARGS = ("(const unsigned char*, const __half*, const unsigned char*, const __half*, int, int, int, int, const float*, "
            "const float*, float, long long*)")
# (encoding, group, row tiles, input, output, split, ring depth, refill, blocked, wide): every encoding and
# group, every R, every fusion, split-K clusters, every ring depth the tuner tries (gemv.STEP_DEPTHS),
# the refilled ring (gemv.can_refill) and the register-tightest kernels (q4 R = 2 with RMSNorm and
# SwiGLU; f16 R = 2, which once kept its load ring in local memory; the refilled rings, which hold
# more), in the 8-row block layout the models use (kernels/layout.py) and some row-major (odd sizes),
# and wide blocks (16 warps, launch bounds of 512 threads) of the tightest kinds.
GEMV_INSTANCES = [("W_F16", 0, 1, "IN_RMSNORM", "OUT_STORE", 1, 4, 0, 1, 0), ("W_F16", 0, 2, "IN_PLAIN", "OUT_ADD", 1, 2, 0, 1, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 2, 0, 1, 0), ("W_Q8", 32, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 2, 0, 1, 0),
                  ("W_Q8", 64, 2, "IN_PLAIN", "OUT_ADD", 1, 1, 0, 1, 0), ("W_Q8", 128, 1, "IN_RMSNORM", "OUT_STORE", 1, 2, 0, 1, 0),
                  ("W_Q4", 32, 2, "IN_RMSNORM", "OUT_STORE", 1, 1, 0, 1, 0), ("W_Q4", 64, 1, "IN_RMSNORM", "OUT_SWIGLU", 1, 4, 0, 1, 0),
                  ("W_Q4", 64, 2, "IN_PLAIN", "OUT_STORE", 1, 2, 0, 1, 0), ("W_Q4", 128, 2, "IN_PLAIN", "OUT_ADD", 1, 2, 0, 1, 0),
                  ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD", 2, 4, 0, 1, 0), ("W_Q8", 64, 2, "IN_PLAIN", "OUT_ADD", 2, 2, 0, 1, 0),
                  ("W_F16", 0, 2, "IN_PLAIN", "OUT_STORE", 2, 1, 0, 1, 0), ("W_Q4", 64, 1, "IN_RMSNORM", "OUT_STORE", 1, 1, 0, 1, 0),
                  ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD", 1, 3, 0, 1, 0), ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 0, 1, 0),
                  ("W_Q8", 64, 1, "IN_PLAIN", "OUT_ADD", 2, 2, 0, 1, 0), ("W_F16", 0, 1, "IN_RMSNORM", "OUT_SWIGLU", 1, 3, 0, 1, 0),
                  ("W_F16", 0, 1, "IN_PLAIN", "OUT_ADD", 2, 1, 0, 1, 0), ("W_F16", 0, 1, "IN_PLAIN", "OUT_ADD", 1, 2, 0, 1, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 2, 1, 1, 0), ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 1, 1, 0),
                  ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD", 2, 4, 1, 1, 0), ("W_Q8", 64, 2, "IN_PLAIN", "OUT_ADD", 2, 1, 1, 1, 0),
                  ("W_Q8", 64, 1, "IN_RMSNORM", "OUT_STORE", 1, 3, 1, 1, 0), ("W_F16", 0, 1, "IN_RMSNORM", "OUT_SWIGLU", 1, 4, 1, 1, 0),
                  ("W_F16", 0, 2, "IN_PLAIN", "OUT_ADD", 2, 2, 1, 1, 0), ("W_F16", 0, 1, "IN_PLAIN", "OUT_STORE", 1, 2, 1, 1, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 2, 0, 0, 0), ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD", 2, 4, 1, 0, 0),
                  ("W_Q8", 64, 1, "IN_RMSNORM", "OUT_STORE", 1, 3, 1, 0, 0), ("W_F16", 0, 2, "IN_PLAIN", "OUT_ADD", 2, 2, 1, 0, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 0, 1, 1), ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD", 2, 4, 1, 1, 1),
                  ("W_F16", 0, 2, "IN_RMSNORM", "OUT_STORE", 1, 2, 1, 1, 1), ("W_Q8", 64, 1, "IN_PLAIN", "OUT_ADD", 1, 2, 0, 1, 1),
                  ("W_Q4", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 4, 1, 1, 0),
                  ("W_Q4", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 3, 0, 1, 1),
                  ("W_Q4", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 2, 1, 1, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 2, 0, 1, 0),
                  ("W_Q8", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 4, 0, 1, 0),
                  ("W_Q8", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 2, 0, 1, 1),
                  ("W_F16", 0, 2, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 2, 1, 1, 1),
                  ("W_Q4", 64, 1, "IN_PLAIN", "OUT_ADD_PENDING", 2, 4, 1, 1, 0),
                  ("W_Q4", 64, 2, "IN_PLAIN", "OUT_ADD_PENDING", 2, 2, 0, 1, 0),
                  ("W_F16", 0, 2, "IN_PLAIN", "OUT_ADD_PENDING", 1, 2, 1, 1, 1),
                  ("W_Q4", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 2, 1, 1, 0),
                  ("W_Q4", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 1, 0, 1, 0),
                  ("W_Q4", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 3, 0, 1, 1),
                  ("W_Q8", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 2, 0, 1, 1),
                  ("W_F16", 0, 2, "IN_RMSNORM", "OUT_STORE_ARGMAX", 1, 2, 1, 1, 1),
                  ("W_Q4", 64, 1, "IN_RMSNORM", "OUT_STORE_ARGMAX", 1, 4, 1, 1, 0)]
# The staggered first item (an 11th argument, STAGGER = 1; RMSNorm inputs at ring depth 1 only,
# gemv.can_stagger): Llama-2-7B q4's roles as tuned (R = 2, wide), R = 1, the refilled rings, every
# encoding, and the fused step's readers of the pending sums.
GEMV_INSTANCES += [("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 0, 1, 1, 1), ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_STORE", 1, 1, 0, 1, 1, 1),
                   ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_STORE_ARGMAX", 1, 1, 0, 1, 1, 1), ("W_Q4", 64, 1, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 0, 1, 0, 1),
                   ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 1, 1, 0, 1), ("W_Q8", 64, 2, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 1, 1, 1, 1),
                   ("W_Q8", 64, 1, "IN_RMSNORM", "OUT_STORE", 1, 1, 0, 1, 0, 1), ("W_F16", 0, 2, "IN_RMSNORM", "OUT_STORE", 1, 1, 1, 1, 1, 1),
                   ("W_F16", 0, 1, "IN_RMSNORM", "OUT_SWIGLU", 1, 1, 0, 1, 0, 1),
                   ("W_Q4", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 1, 0, 1, 1, 1), ("W_Q4", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE", 1, 1, 1, 1, 0, 1),
                   ("W_Q8", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 1, 0, 1, 1, 1),
                   ("W_F16", 0, 2, "IN_RMSNORM_PENDING", "OUT_STORE_ARGMAX", 1, 1, 1, 1, 1, 1)]
# Qwen2's Q/K/V projection with its bias added as it stores (OUT_STORE_BIAS): every encoding, R = 1 and
# 2, the fused step's reader of the pending sums, wide blocks, refilled and staggered rings.
GEMV_INSTANCES += [("W_Q4", 64, 1, "IN_RMSNORM", "OUT_STORE_BIAS", 1, 1, 0, 1, 0), ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_STORE_BIAS", 1, 2, 1, 1, 1),
                   ("W_Q8", 64, 2, "IN_RMSNORM", "OUT_STORE_BIAS", 1, 2, 0, 1, 0), ("W_F16", 0, 1, "IN_RMSNORM", "OUT_STORE_BIAS", 1, 4, 1, 1, 0),
                   ("W_Q4", 64, 1, "IN_RMSNORM_PENDING", "OUT_STORE_BIAS", 1, 3, 0, 1, 0),
                   ("W_Q8", 64, 2, "IN_RMSNORM_PENDING", "OUT_STORE_BIAS", 1, 2, 1, 1, 1),
                   ("W_Q4", 64, 2, "IN_RMSNORM", "OUT_STORE_BIAS", 1, 1, 0, 1, 1, 1),
                   ("W_F16", 0, 1, "IN_RMSNORM_PENDING", "OUT_STORE_BIAS", 1, 1, 1, 1, 0, 1)]
# q4's default group is 32 (the converter's): every other q4 instance above at group 32 too (the group
# only changes the scale's index arithmetic; half of them keep the compile time down).
GEMV_INSTANCES += [("W_Q4", 32, *rest) for encoding, group, *rest in GEMV_INSTANCES
                   if (encoding, group) == ("W_Q4", 64)][::2]
# The fused MLP (mlp.cu: encoding, group, tiles, row tiles, ring depth, wide): every encoding, the
# shallowest and deepest rings the tuner tries (mlp.CANDIDATES), both row tiles, and 16 warps.
MLP_INSTANCES = [(e, g, 4, rt, d, w) for e, g in [("W_F16", 0), ("W_Q8", 64), ("W_Q4", 64), ("W_Q4", 32)]
                 for rt in (1, 2) for d in (1, {1: 4, 2: 2}[rt]) for w in (0, 1)]


def wrapper(name: str) -> str:
    """Source that includes `name` and instantiates its templates."""
    lines = [f'#include "{name}"']
    if name == "gemv.cu":
        lines += [f"template __global__ void gemv<{','.join(str(a) for a in instance)}>{GEMV_ARGS};"
                  for instance in GEMV_INSTANCES]
    if name == "mlp.cu":
        lines += [f"template __global__ void mlp<{e},{g},{t},{r},{d},{w}>{MLP_ARGS};" for e, g, t, r, d, w in MLP_INSTANCES]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kernels")
    for name in SOURCES:
        (folder / name).write_text(source_text(name))
    return folder


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", [n for n in SOURCES if n.endswith(".cu")])
def test_kernel_compiles_with_nvcc(kernel_dir, name, arch):
    source = kernel_dir / f"check_{name}"
    source.write_text(wrapper(name))
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-I", str(kernel_dir),
                             "-o", str(kernel_dir / f"{name}.{arch}.cubin"), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "spill stores" in result.stderr                      # ptxas reported on every kernel
    if arch != "sm_90":
        return                                                   # (sm_75 spills 8 bytes in one GEMV variant)
    function = ""
    for line in result.stderr.splitlines():                      # on Hopper nothing spills to local memory
        if "Function properties for" in line:
            function = line.split("for", 1)[1].strip()           # (mangled: the template arguments are in it)
        if "spill stores" in line:
            assert line.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"), \
                f"{function}: {line.strip()}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("name", ["gemv.cu", "mlp.cu", "attention.cu", "sampling.cu"])
def test_timeline_probe_compiles(kernel_dir, name):
    """The diagnostic build (TINYINFER_TIMELINE=1 adds -DTI_TIMELINE: per-block timestamps read by
    tests/perf/timeline.py) compiles for Hopper, where it is used."""
    source = kernel_dir / f"check_timeline_{name}"
    source.write_text(wrapper(name))
    result = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-DTI_TIMELINE", "-cubin", "-I", str(kernel_dir),
                             "-o", str(kernel_dir / f"{name}.timeline.cubin"), str(source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


CUOBJDUMP = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or (
    str(Path(NVCC).parent / "cuobjdump") if NVCC and (Path(NVCC).parent / "cuobjdump").is_file() else None)
# Global loads each kernel launched with programmatic dependent launch may issue before
# griddepcontrol.wait (SASS ACQBULK), with how many of each at most: GEMVs stream weights past L1
# (load_stream) and their fp16 scales; attention reads the position (one 32-bit load, written two
# kernels back) and copies cached K/V rows into shared memory (attention) or loads them into
# registers (attention_rows: 16-byte ld.global.nc; its activations go through ld.global.cg, and
# the chunked kernel reads none 16 bytes at a time); the sampler nothing. Anything else there reads
# an activation before the previous kernel has written it. The GEMVs that add Qwen2's bias
# (OUT_STORE_BIAS, template argument 5 of 5) also load one bias value per thread, a weight.
PRE_WAIT_LOADS = {
    "gemv.cu": {"LDG.E.NA.128.CONSTANT": None, "LDG.E.U16.CONSTANT": None},
    "mlp.cu": {"LDG.E.NA.128.CONSTANT": None, "LDG.E.U16.CONSTANT": None},
    "attention.cu": {"LDG.E.CONSTANT": 1, "LDGSTS.E.BYPASS.128": None, "LDG.E.128.CONSTANT": None},
    "sampling.cu": {},
    # The batched step (batch.cu): the GEMV's weights and scales, the tensor-core attention's cached
    # K/V rows below the position (16-byte ld.global.nc, as attention.cu's); elsewhere only 32-bit
    # ld.global.nc of norm weights, RoPE tables, biases and the row table, which the host writes
    # before the graph (the activations' pointers carry no __restrict__, so they are never read
    # through ld.global.nc).
    "batch.cu": {"LDG.E.NA.128.CONSTANT": None, "LDG.E.U16.CONSTANT": None, "LDG.E.CONSTANT": None,
                 "LDG.E.128.CONSTANT": None},
}
STORE_BIAS = 5      # gemv.cu OUT_STORE_BIAS


def pre_wait_loads(name: str, function: str) -> dict:
    """The loads a function of `name` may issue before its PDL wait (PRE_WAIT_LOADS)."""
    allowed = dict(PRE_WAIT_LOADS[name])
    template = re.search(r"gemvILi(-?\d+)ELi(-?\d+)ELi(-?\d+)ELi(-?\d+)ELi(-?\d+)E", function)
    if template and int(template.group(5)) == STORE_BIAS:
        allowed["LDG.E.CONSTANT"] = 1
    return allowed


def loads_before_wait(sass: str) -> dict:
    """function -> (global loads that precede its first ACQBULK, whether it has one)."""
    found, function, waited = {}, None, False
    for line in sass.splitlines():
        if "Function :" in line:
            function, waited = line.split("Function :")[1].strip(), False
            found[function] = ([], False)
        elif function and "ACQBULK" in line:
            found[function], waited = (found[function][0], True), True
        elif function and not waited:
            match = re.search(r"\b(LDGSTS[A-Z0-9.]*|LDG[A-Z0-9.]*)", line)
            if match:
                found[function][0].append(match.group(1))
    return found


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("name", sorted(PRE_WAIT_LOADS))
def test_no_activation_is_read_before_the_pdl_wait(kernel_dir, name):
    """Under programmatic dependent launch a kernel starts while the previous one still writes its
    input. ptxas may move ld.global.nc loads above griddepcontrol.wait: it did for x in one GEMV
    staging variant, and the decode graph read stale activations while the kernel tests, launched
    without PDL, passed. So the machine code itself is checked."""
    source = kernel_dir / f"check_pdl_{name}"
    source.write_text(wrapper(name))
    cubin = kernel_dir / f"{name}.pdl.cubin"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-cubin", "-I", str(kernel_dir), "-o", str(cubin), str(source)],
                   check=True, capture_output=True, timeout=600)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    functions = loads_before_wait(sass)
    assert functions, "no kernels in the disassembly"
    for function, (loads, waits) in functions.items():
        allowed = pre_wait_loads(name, function)
        assert waits, f"{function}: no griddepcontrol.wait"
        for load in set(loads):
            assert load in allowed, f"{function} issues {load} before griddepcontrol.wait"
            limit = allowed[load]
            assert limit is None or loads.count(load) <= limit, f"{function}: {loads.count(load)} x {load} before the wait"


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("function", ["attention_rows", "attention_mma64", "attention_mma128"])
def test_attention_loads_cached_rows_before_the_pdl_wait(kernel_dir, function):
    """attention_rows and attention_mma exist to have their first pass of K/V rows in flight while
    the previous kernel runs. ptxas placed griddepcontrol.wait above those loads when their
    addresses depended on the position (loaded first) or when it could predicate them, silently:
    the kernel stayed correct, only slower. So the machine code must show every first-pass load
    (K and V: ATT_ROW_REGS rows each for attention_rows; for attention_mma 2 tiles of 8 rows per
    16-row block, 128 / head_dim blocks, head_dim / 32 pieces of each row per lane, and the position's
    two RoPE rows, head_dim / 64 pieces of 8 floats per lane each, two loads a piece) before the wait."""
    source = kernel_dir / f"check_{function}.cu"
    source.write_text(wrapper("attention.cu"))
    cubin = kernel_dir / f"{function}.cubin"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-cubin", "-I", str(kernel_dir), "-o", str(cubin), str(source)],
                   check=True, capture_output=True, timeout=600)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    loads, waits = loads_before_wait(sass)[function]
    rope = 0
    if function == "attention_rows":
        per_kind = int(re.search(r"#define ATT_ROW_REGS (\d+)", source_text("attention.cu")).group(1))
    else:
        head_dim = int(function.removeprefix("attention_mma"))
        per_kind = 2 * (128 // head_dim) * (head_dim // 32)
        rope = 2 * 2 * (head_dim // 64)
    assert waits and loads.count("LDG.E.128.CONSTANT") == 2 * per_kind + rope, loads


def nvrtc_and_headers():
    """(the nvrtc module, a folder with cuda_fp16.h) when both are present here, else None."""
    import glob
    import sysconfig

    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception:
        return None
    candidates = glob.glob(f"{sysconfig.get_paths()['purelib']}/nvidia/cu*/include") + ["/usr/local/cuda/include"]
    for folder in candidates:
        if Path(folder, "cuda_fp16.h").is_file():
            return nvrtc, folder
    return None


@pytest.mark.parametrize("cc", [75, 86, 90])
@pytest.mark.parametrize("name", [n for n in SOURCES if n.endswith(".cu")])
def test_kernel_compiles_with_nvrtc(name, cc):
    """What CuPy does at run time: NVRTC, our options, templates through name expressions."""
    from tinyinfer.kernels import batch, build
    from tinyinfer.kernels import mlp
    from tinyinfer.kernels.gemv import STEP_DEPTHS, WIDE_WARPS, GemvConfig, GemvShape, name_expression

    found = nvrtc_and_headers()
    if found is None:
        pytest.skip("NVRTC (cupy + nvidia-cuda-nvrtc) or the CUDA headers are not installed")
    nvrtc, include = found
    expressions = {
        "gemv.cu": [name_expression(GemvShape(e, g, rows, 256, 256, i, o), GemvConfig(rt, warps, split, depth))
                    for e, g in [("q4", 64), ("q8", 32), ("f16", 0)] for rt in (1, 2) for warps in (8, WIDE_WARPS)
                    for rows in (8, 9)       # in 8-row blocks and row-major
                    for depth in (min(STEP_DEPTHS[rt]), max(STEP_DEPTHS[rt]))
                    for i, o, split in [("rmsnorm", "store", 1), ("plain", "add", 1), ("rmsnorm", "swiglu", 1),
                                        ("plain", "add", 2), ("rmsnorm_pending", "store", 1),
                                        ("plain", "add_pending", 2), ("rmsnorm", "store_argmax", 1),
                                        ("rmsnorm_pending", "store_argmax", 1)]],
        "mlp.cu": [mlp.name_expression(mlp.MlpShape(GemvShape(e, g, 512, 256, 256, "rmsnorm", "swiglu"),
                                                    GemvShape(e, g, 256, 256, 256, "plain", "add")), config)
                   for e, g in [("q4", 64), ("q8", 32), ("f16", 0)] for config in mlp.CANDIDATES],
        "batch.cu": [batch.gemv_name(e, 8 * nb) for e in batch.ENCODING_ID for nb in batch.GEMV_NB],
    }.get(name, [])
    program = nvrtc.createProgram(build.expanded_source(name), name, [], [])
    for expression in expressions:
        nvrtc.addNameExpression(program, expression)
    options = [o for o in build.compile_options(cc) if not o.startswith("-arch")]
    options += [f"-arch=compute_{cc}", "--device-as-default-execution-space", "-ftz=true", f"-I{include}"]
    try:
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError:
        pytest.fail(nvrtc.getProgramLog(program)[-3000:])
    for expression in expressions:
        assert nvrtc.getLoweredName(program, expression)


@pytest.mark.skipif(NVCC is None or CUOBJDUMP is None, reason="needs nvcc and cuobjdump")
def test_batch_attention_prefetches_cached_rows_before_the_pdl_wait(kernel_dir):
    """batch_attention prefetches its first pass of cached K rows into L1 (BA_UNROLL per lane) before
    the wait, and no other kernel of batch.cu prefetches before its wait (the tensor-core attention
    loads its first pass into registers instead)."""
    source = kernel_dir / "check_batch_attention.cu"
    source.write_text(wrapper("batch.cu"))
    cubin = kernel_dir / "batch_attention.cubin"
    subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-cubin", "-I", str(kernel_dir), "-o", str(cubin), str(source)],
                   check=True, capture_output=True, timeout=600)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    unroll = int(re.search(r"#define BA_UNROLL (\d+)", source_text("batch.cu")).group(1))
    prefetches, function, waited = {}, None, False
    for line in sass.splitlines():
        if "Function :" in line:
            function, waited = line.split("Function :")[1].strip(), False
            prefetches[function] = 0
        elif function and "ACQBULK" in line:
            waited = True
        elif function and not waited and "CCTL.E.PF1" in line:
            prefetches[function] += 1
    scalar = ("batch_attention", "batch_attention_wide")
    assert prefetches and all(count == (2 * unroll if function in scalar else 0)
                              for function, count in prefetches.items()), prefetches
