"""Each CUDA kernel against its NumPy reference, on fresh random inputs of every shape class.

Outputs are poisoned (NaN) before every launch so an element the kernel forgets to write fails.
Error is ||gpu - ref|| / ||ref|| <= 1e-3 (the kernels round the input vector / KV cache to fp16 and
accumulate in fp32); argmax and sampling must match exactly.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tinyinfer.kernels import attention as attn_k
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import misc as misc_k
from tinyinfer.kernels import sampling as sample_k
from tinyinfer.kernels.build import device_compute_capability
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import random_encoded
from tinyinfer.runtime.sampling import SamplingParams, sample

from sampling_samples import SAMPLING  # noqa: E402
from tinf_samples import device_bytes  # noqa: E402

pytestmark = pytest.mark.gpu
MAX_ERROR = 1e-3

# (rows, cols): the fused TinyLlama and Llama-2-7B matrices, and odd sizes (cols not a multiple of
# the group, rows not a multiple of 16).
SHAPES = {
    "tinyllama-qkv": (2560, 2048), "tinyllama-down": (2048, 5632), "llama7b-down": (4096, 11008),
    "llama7b-gate-up": (22016, 4096), "tinyllama-gate-up": (11264, 2048), "odd": (100, 200),
    "odd-small": (37, 72), "odd-gate-up": (74, 200), "tiny": (16, 8), "qwen2.5-qkv": (1152, 896), "odd-bias": (100, 200),
}
FUSIONS = {   # shape -> (input, output) as the model uses that matrix
    "tinyllama-qkv": ("rmsnorm", "store"), "tinyllama-down": ("plain", "add"), "llama7b-down": ("plain", "add"),
    "llama7b-gate-up": ("rmsnorm", "swiglu"), "tinyllama-gate-up": ("rmsnorm", "swiglu"), "odd": ("plain", "add"),
    "odd-small": ("rmsnorm", "store"), "odd-gate-up": ("plain", "swiglu"), "tiny": ("plain", "store"),
    "qwen2.5-qkv": ("rmsnorm", "store_bias"), "odd-bias": ("rmsnorm", "store_bias"),
}


def relative_error(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def cc(cupy_gpu):
    return device_compute_capability()


@pytest.fixture(scope="module")
def misc_module(cc):
    return misc_k.compile_misc(cc)


def run_gemv(cp, cc, tensor, input, output, config, rng, x=None, mod=None):
    shape = gemv_k.shape_of(tensor, input, output)
    if mod is None:
        mod = gemv_k.compile_gemvs([(shape, config)], cc)
    k = tensor.cols
    x = rng.standard_normal(k).astype(np.float32) if x is None else x
    aux = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32) if input == "rmsnorm" else None
    residual = rng.standard_normal(tensor.rows).astype(np.float32) if output == "add" else None
    bias = 3 * rng.standard_normal(tensor.rows).astype(np.float32) if output == "store_bias" else None
    y = cp.asarray(residual) if residual is not None else cp.full(gemv_k.output_rows(shape), np.nan, dtype=cp.float32)
    launch = gemv_k.make_gemv(mod, shape, config, cp.asarray(device_bytes(tensor, shape)), cp.asarray(x), y,
                              cp.asarray(aux) if aux is not None else None, 1e-5,
                              bias=cp.asarray(bias) if bias is not None else None)
    launch()
    cp.cuda.Device().synchronize()
    expected = gemv_k.gemv_reference(tensor, x, input, aux, 1e-5, residual, output, bias)
    got = y.get()
    assert np.isfinite(got).all(), "unwritten or non-finite outputs"
    return relative_error(got, expected)


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_every_shape_class(cupy_gpu, cc, encoding, name):
    rng = np.random.default_rng(zlib.crc32(f"{encoding}{name}".encode()))
    rows, cols = SHAPES[name]
    tensor = random_encoded(encoding, (rows, cols), None if encoding == "f16" else 64, rng, 1 / np.sqrt(cols))
    error = run_gemv(cupy_gpu, cc, tensor, *FUSIONS[name], gemv_k.GemvConfig(), rng)
    assert error <= MAX_ERROR, f"{encoding} {name}: relative error {error:.2e}"


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("row_tiles,warps", gemv_k.CANDIDATES)
def test_gemv_every_tuning_candidate(cupy_gpu, cc, encoding, row_tiles, warps):
    rng = np.random.default_rng(row_tiles * 10 + warps)
    tensor = random_encoded(encoding, (1000, 1000), None if encoding == "f16" else 64, rng, 1 / np.sqrt(1000))
    for input, output in [("plain", "add"), ("rmsnorm", "swiglu"), ("rmsnorm", "store_bias")]:
        error = run_gemv(cupy_gpu, cc, tensor, input, output, gemv_k.GemvConfig(row_tiles, warps), rng)
        assert error <= MAX_ERROR, f"R={row_tiles} warps={warps} {input}>{output}: {error:.2e}"


# Plain-input shapes for split-K clusters: the models' down and o projections, odd sizes, a single
# chunk (the second block of each cluster has no columns), and many tiles per cluster (the peer
# block's sums are double-buffered by tile).
SPLIT_SHAPES = {"tinyllama-down": (2048, 5632), "llama7b-down": (4096, 11008), "tinyllama-wo": (2048, 2048),
                "odd": (100, 200), "tiny": (16, 8), "many-tiles": (9000, 264)}


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("name", list(SPLIT_SHAPES))
def test_gemv_split_k_in_clusters(cupy_gpu, cc, encoding, name):
    if cc < gemv_k.SPLIT_MIN_COMPUTE_CAPABILITY:
        pytest.skip("thread-block clusters need compute capability 9.0")
    rng = np.random.default_rng(zlib.crc32(f"split{encoding}{name}".encode()))
    rows, cols = SPLIT_SHAPES[name]
    tensor = random_encoded(encoding, (rows, cols), None if encoding == "f16" else 64, rng, 1 / np.sqrt(cols))
    for rt, warps in gemv_k.CANDIDATES:
        for output in ("add", "store"):
            error = run_gemv(cupy_gpu, cc, tensor, "plain", output, gemv_k.GemvConfig(rt, warps, 2), rng)
            assert error <= MAX_ERROR, f"{encoding} {name} R={rt} warps={warps} split {output}: {error:.2e}"


# Ring depths (items in flight per warp): a long input (many items per warp), an RMSNorm input of two
# groups per thread (whose last ring slot loads after the staging, none before the wait at depth 1),
# an odd size with a partial chunk, and many tiles per block (the ring runs across tile boundaries).
DEPTH_SHAPES = {"tinyllama-down": ((2048, 5632), "plain", "add"), "norm-two-groups": ((600, 4096), "rmsnorm", "swiglu"),
                "odd": ((100, 200), "rmsnorm", "store"), "many-tiles": ((9000, 264), "plain", "store"),
                "qwen2.5-qkv-bias": ((1152, 896), "rmsnorm", "store_bias")}


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("name", list(DEPTH_SHAPES))
def test_gemv_every_ring_depth(cupy_gpu, cc, encoding, name):
    """Every configuration the tuner can choose (gemv.all_configs: each depth, with and without
    split-K) on shapes that exercise the ring's corners, from one module per shape."""
    rng = np.random.default_rng(zlib.crc32(f"depth{encoding}{name}".encode()))
    (rows, cols), input, output = DEPTH_SHAPES[name]
    tensor = random_encoded(encoding, (rows, cols), None if encoding == "f16" else 64, rng, 1 / np.sqrt(cols))
    shape = gemv_k.shape_of(tensor, input, output)
    configs = gemv_k.all_configs(shape, cc)
    assert {c.depth for c in configs} == {1, 2, 3, 4}
    mod = gemv_k.compile_gemvs([(shape, c) for c in configs], cc)
    for config in configs:
        error = run_gemv(cupy_gpu, cc, tensor, input, output, config, rng, mod=mod)
        assert error <= MAX_ERROR, f"{encoding} {name} {config.label}: {error:.2e}"


def test_gemv_split_k_is_repeatable_bit_for_bit(cupy_gpu, cc):
    """The two blocks' sums meet in a fixed order (no atomics): the same input gives the same bits."""
    if cc < gemv_k.SPLIT_MIN_COMPUTE_CAPABILITY:
        pytest.skip("thread-block clusters need compute capability 9.0")
    cp = cupy_gpu
    rng = np.random.default_rng(3)
    tensor = random_encoded("q4", (4096, 11008), 64, rng, 1 / np.sqrt(11008))
    shape = gemv_k.shape_of(tensor, "plain", "store")
    config = gemv_k.GemvConfig(1, 8, 2)
    mod = gemv_k.compile_gemvs([(shape, config)], cc)
    y = cp.full(4096, np.nan, dtype=cp.float32)
    launch = gemv_k.make_gemv(mod, shape, config, cp.asarray(device_bytes(tensor, shape)),
                              cp.asarray(rng.standard_normal(11008).astype(np.float32)), y)
    results = []
    for _ in range(5):
        y.fill(np.nan)
        launch()
        results.append(y.get())
    assert np.isfinite(results[0]).all() and all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("encoding", ["q8", "q4"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("cols", [1000, 4096, 96])
def test_gemv_every_group_size(cupy_gpu, cc, encoding, group, cols):
    rng = np.random.default_rng(group + cols)
    tensor = random_encoded(encoding, (300, cols), group, rng, 1 / np.sqrt(cols))
    error = run_gemv(cupy_gpu, cc, tensor, "rmsnorm", "store", gemv_k.GemvConfig(2, 4), rng)
    assert error <= MAX_ERROR, f"{encoding} g{group} K={cols}: {error:.2e}"


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
def test_gemv_inputs_with_outliers_and_zeros(cupy_gpu, cc, encoding):
    """x is staged in shared memory in a narrower format than fp32 (fp16 hi + lo; q4: 16-bit integers
    per section of 32 columns): inputs spanning 12 orders of magnitude (a few "massive activations",
    tiny values, all-zero stretches) must keep the products within the bound."""
    rng = np.random.default_rng(11)
    k = 4096
    x = rng.standard_normal(k).astype(np.float32)
    x[rng.choice(k, 6, replace=False)] *= 2000.0
    x[512:1024] *= 1e-6
    x[1024:1280] = 0.0
    tensor = random_encoded(encoding, (512, k), None if encoding == "f16" else 64, rng, 1 / np.sqrt(k))
    for input, output in [("plain", "store"), ("rmsnorm", "add")]:
        error = run_gemv(cupy_gpu, cc, tensor, input, output, gemv_k.GemvConfig(2, 8), rng, x)
        assert error <= MAX_ERROR, f"{encoding} {input}>{output}: {error:.2e}"


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("row_tiles,warps", [(1, 8), (2, 16)])
def test_gemv_small_inputs_keep_their_precision(cupy_gpu, cc, encoding, row_tiles, warps):
    """Inputs of small values: a small activation, or a small residual, which RMSNorm stages as
    x * w before its factor (gemv.cu stage_input). f16 and q8 stage x as fp16 hi + lo, and the
    rounding error lo of a value of 1e-3 is a subnormal fp16. Staged scaled up (LO_SCALE), it keeps
    the error of the products what it is for the same input at ordinary size; at 1e-5, where hi
    itself is subnormal, within the bound. (q4 stages integers scaled per section: any size.)"""
    k = 2048
    x = np.random.default_rng(12).standard_normal(k).astype(np.float32)
    tensor = random_encoded(encoding, (512, k), None if encoding == "f16" else 64, np.random.default_rng(13),
                            1 / np.sqrt(k))
    config = gemv_k.GemvConfig(row_tiles, warps)
    for input, output in [("plain", "store"), ("rmsnorm", "store"), ("rmsnorm", "swiglu")]:
        ordinary, small, tiny = (run_gemv(cupy_gpu, cc, tensor, input, output, config, np.random.default_rng(14),
                                          x * np.float32(scale)) for scale in (1, 1e-3, 1e-5))
        label = f"{encoding} {input}>{output}: {ordinary:.2e} at 1, {small:.2e} at 1e-3, {tiny:.2e} at 1e-5"
        assert small <= 2 * ordinary + 1e-6 and tiny <= MAX_ERROR, label


def test_gemv_quantized_by_the_format_encoder(cupy_gpu, cc):
    """A tensor quantized by formats.encode (scale search), not random codes."""
    from tinyinfer.formats import encode

    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 768)).astype(np.float32)
    for encoding in ("q4", "q8", "f16"):
        error = run_gemv(cupy_gpu, cc, encode(w, encoding, 64), "plain", "store", gemv_k.GemvConfig(), rng)
        assert error <= MAX_ERROR, f"{encoding}: {error:.2e}"


# (rows, cols): TinyLlama's output head, and an odd head (rows not a multiple of 16, several tiles per block).
ARGMAX_SHAPES = {"tinyllama-head": (32000, 2048), "odd": (1001, 264)}


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("name", list(ARGMAX_SHAPES))
def test_gemv_folds_the_greedy_argmax(cupy_gpu, cc, encoding, name):
    """The output head's store_argmax: y as the reference, and the uint64 word is the argmax of the
    y it stored, the lowest row among equal values. Rows repeat in runs of 7 (identical codes give
    identical outputs), so the largest value lies in several rows, across tiles and blocks."""
    from tinyinfer.formats import encode

    cp = cupy_gpu
    rng = np.random.default_rng(zlib.crc32(f"argmax{encoding}{name}".encode()))
    rows, cols = ARGMAX_SHAPES[name]
    base = rng.standard_normal((-(-rows // 7), cols)).astype(np.float32) / np.sqrt(cols)
    tensor = encode(np.repeat(base, 7, axis=0)[:rows], encoding, 64)
    shape = gemv_k.shape_of(tensor, "rmsnorm", "store_argmax")
    configs = gemv_k.configs_for(shape, cc)
    mod = gemv_k.compile_gemvs([(shape, c) for c in configs], cc)
    weights = cp.asarray(device_bytes(tensor, shape))
    best = cp.zeros(1, dtype=cp.uint64)
    for config in configs:
        x = rng.standard_normal(cols).astype(np.float32)
        aux = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
        y = cp.full(rows, np.nan, dtype=cp.float32)
        best.fill(0)
        gemv_k.make_gemv(mod, shape, config, weights, cp.asarray(x), y, cp.asarray(aux), 1e-5, best=best)()
        got = y.get()
        error = relative_error(got, gemv_k.gemv_reference(tensor, x, "rmsnorm", aux, 1e-5))
        assert error <= MAX_ERROR, f"{encoding} {name} {config.label}: {error:.2e}"
        key = int(best.get()[0])
        top = int(np.argmax(got))
        assert key == gemv_k.argmax_key(got) and gemv_k.argmax_row(key) == top, f"{config.label}: row {top}"
        assert top % 7 == 0 and got[top + 1] == got[top], "the largest value in a run of rows, its first found"


# ---------------------------------------------------------------------------------------- attention

ATTENTION_SHAPES = {   # (n_heads, n_kv_heads, head_dim)
    "tinyllama": (32, 4, 64), "llama7b": (32, 32, 128), "stories260k": (8, 4, 8), "mqa": (8, 1, 64),
    "odd": (12, 3, 96), "llama70b": (64, 8, 128), "mqa-wide": (64, 1, 128), "qwen2.5": (14, 2, 64),
    "mistral-7b": (32, 8, 128),
}


@pytest.mark.parametrize("name", list(ATTENTION_SHAPES))
@pytest.mark.parametrize("cluster", [True, False], ids=["cluster-merge", "global-merge"])
@pytest.mark.parametrize("threads", [128, 256])
@pytest.mark.parametrize("kernel", ["attention", "attention_rows", "attention_mma"])
def test_attention_matches_reference(cupy_gpu, cc, name, cluster, threads, kernel):
    """Every kernel on every shape it serves (attention_rows on every shape, though the backend
    picks it for large groups only); for the chunked one both slice merges (in a thread-block
    cluster on Hopper and newer, in global memory); both block sizes, whichever the backend would
    pick for the shape. attention_mma with one block per KV head, and (cluster-merge) with 2, 3 and 8
    blocks sharing its context in a cluster."""
    cp = cupy_gpu
    if cluster and cc < attn_k.CLUSTER_MIN_COMPUTE_CAPABILITY:
        pytest.skip("thread-block clusters need compute capability 9.0")
    if cluster and kernel == "attention_rows":
        pytest.skip(f"{kernel} merges nothing")
    n_heads, n_kv, hd = ATTENTION_SHAPES[name]
    if kernel == "attention_mma":
        if threads != attn_k.MMA_THREADS or not attn_k.mma_fits(n_heads, n_kv, hd):
            pytest.skip(f"attention_mma runs {attn_k.MMA_THREADS} threads on groups of at most "
                        f"{attn_k.MMA_MAX_GROUP} heads of head_dim 64 or 128")
        kernel = f"attention_mma{hd}"
    try:
        attn_k.check_shape(n_heads, n_kv, hd, threads)
    except ValueError:
        pytest.skip(f"{name} needs more than {threads} threads")
    max_ctx = 1100
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256} if name == "odd" else None
    cos, sin = ref.rope_tables(hd, max_ctx, 10000.0, scaling)
    mod = attn_k.compile_attention(cc, cluster)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    if kernel.startswith("attention_mma"):
        for slices in (2, 3, 8) if cluster else (1,):
            check_attention(cp, mod, name, kernel, slices, threads, max_ctx, cos, sin, seed=len(name) + 10 * slices)
        return
    slices = {"attention_rows": n_heads // n_kv, "attention": attn_k.n_slices(n_kv, max_ctx, sms, cluster)}[kernel]
    check_attention(cp, mod, name, kernel, slices, threads, max_ctx, cos, sin, seed=len(name) + 2 * cluster + threads)


def check_attention(cp, mod, name, kernel, slices, threads, max_ctx, cos, sin, seed, window=None,
                    positions=(0, 1, 31, 32, 33, 200, 1099)):
    """One attention launch against the reference at positions with a context of one row, of one
    or more blocks of rows, and of several passes; with a sliding window, of the window's rows only."""
    n_heads, n_kv, hd = ATTENTION_SHAPES[name]
    rng = np.random.default_rng(seed + len(kernel))
    for pos in positions:
        cache_k = rng.standard_normal((max_ctx, n_kv, hd)).astype(np.float16)
        cache_v = rng.standard_normal((max_ctx, n_kv, hd)).astype(np.float16)
        cache_k[pos:] = np.nan                    # the kernel must write row pos and never read beyond
        cache_v[pos:] = np.nan
        first = ref.first_key(pos, window)
        cache_k[:first] = cache_v[:first] = np.nan   # nor before the window (the reference skips those rows)
        qkv = rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)
        k_dev, v_dev = cp.asarray(cache_k), cp.asarray(cache_v)
        out = cp.full(n_heads * hd, np.nan, dtype=cp.float32)
        counters = cp.zeros(n_kv, dtype=cp.uint32)
        launch = attn_k.make_attention(
            mod, n_heads, n_kv, hd, slices, threads, cp.asarray(qkv), k_dev, v_dev, cp.asarray(np.array([pos, 0, 0, 0], np.int32)),
            cp.asarray(cos), cp.asarray(sin), cp.zeros(n_heads * slices * hd, cp.float32),
            cp.zeros(n_heads * slices * 2, cp.float32), counters, out, kernel=kernel, window=window)
        expected, k_row, v_row = attn_k.attention_reference(qkv, cache_k.astype(np.float32),
                                                            cache_v.astype(np.float32), pos, n_heads, n_kv, hd, cos, sin,
                                                            window)
        for repeat in range(2):                   # the merge counters must be back at zero
            out.fill(np.nan)
            launch()
            got = out.get()
            assert np.isfinite(got).all(), f"pos {pos}: unwritten outputs"
            error = relative_error(got, expected)
            assert error <= MAX_ERROR, (f"{name} {threads} threads {slices} slices window {window} pos {pos} "
                                        f"(run {repeat}): {error:.2e}")
            assert not counters.get().any()
        # k is rotated in fp32 (the GPU may fuse a multiply-add) then stored as fp16: within one fp16 ulp.
        np.testing.assert_allclose(k_dev[pos].get().astype(np.float32), k_row, rtol=1e-3, atol=1e-7)
        np.testing.assert_array_equal(v_dev[pos].get(), v_row.astype(np.float16))


@pytest.mark.parametrize("name", ["tinyllama", "llama7b", "odd", "mqa", "qwen2.5", "mistral-7b"])
@pytest.mark.parametrize("cluster", [True, False], ids=["cluster-merge", "global-merge"])
@pytest.mark.parametrize("kernel", ["attention", "attention_rows", "attention_mma"])
@pytest.mark.parametrize("window", [1, 16, 100, 300])
def test_attention_with_a_sliding_window(cupy_gpu, cc, name, cluster, kernel, window):
    """Each kernel reads only the window's rows (those before it are NaN) and gives the reference at
    positions before, at and past the window's length: a window of one row, of less than one of
    attention_mma's 16-row blocks, of a few blocks, and of more than one block's pass (256 or 128
    rows), with attention_mma's context split over 2, 3 and 8 blocks too."""
    cp = cupy_gpu
    if cluster and cc < attn_k.CLUSTER_MIN_COMPUTE_CAPABILITY:
        pytest.skip("thread-block clusters need compute capability 9.0")
    if cluster and kernel == "attention_rows":
        pytest.skip(f"{kernel} merges nothing")
    n_heads, n_kv, hd = ATTENTION_SHAPES[name]
    threads = attn_k.MMA_THREADS if kernel == "attention_mma" else attn_k.threads_for(n_heads, n_kv, hd, 8, 132)
    if kernel == "attention_mma":
        if not attn_k.mma_fits(n_heads, n_kv, hd):
            pytest.skip("attention_mma serves groups of at most 8 heads of head_dim 64 or 128")
        kernel = f"attention_mma{hd}"
    max_ctx = 1100
    positions = sorted({0, 1, window - 1, window, window + 1, 2 * window + 5, 600, 1099})
    cos, sin = ref.rope_tables(hd, max_ctx, 10000.0, None)
    mod = attn_k.compile_attention(cc, cluster)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    if kernel.startswith("attention_mma"):
        for slices in (1, 2, 3, 8) if cluster else (1,):
            check_attention(cp, mod, name, kernel, slices, threads, max_ctx, cos, sin, 7 * slices, window, positions)
        return
    slices = {"attention_rows": n_heads // n_kv, "attention": attn_k.n_slices(n_kv, max_ctx, sms, cluster)}[kernel]
    check_attention(cp, mod, name, kernel, slices, threads, max_ctx, cos, sin, window, window, positions)


# ----------------------------------------------------------------------------------------- sampling

def run_sampler(cp, cc, logits, params, history, uniforms, step=0, host_tokens=False, head_best=None):
    """host_tokens: the tokens go to pinned host memory, as in the decode engine. head_best: the
    output head's argmax word (a uint64 CuPy array) or None."""
    from tinyinfer.runtime.weights_upload import pinned_empty

    vocab = logits.size
    mod = sample_k.compile_sampler(cc)
    seen = np.zeros(vocab, np.uint8)
    seen[list(history)] = 1
    state = cp.asarray(np.array([7, -1, step, 0], np.int32))
    if host_tokens:
        out_tokens = pinned_empty(len(uniforms) + 1, np.int32)
        out_tokens[:] = -1
    else:
        out_tokens = cp.full(len(uniforms) + 1, -1, dtype=cp.int32)
    seen_dev = cp.asarray(seen)
    table = np.random.default_rng(vocab).standard_normal((vocab, 72)).astype(np.float16)
    x = cp.full(72, np.nan, dtype=cp.float32)
    launch = sample_k.make_sampler(mod, vocab, cp.asarray(logits), cp.asarray(sample_k.params_array(params)),
                                   cp.asarray(np.asarray(uniforms, np.float64)), seen_dev,
                                   cp.zeros(vocab, cp.float64), state, out_tokens, cp.asarray(table), "f16", 72, x,
                                   head_best=head_best)
    launch()
    token = int(state.get()[1])
    np.testing.assert_array_equal(x.get(), table[token].astype(np.float32))   # the chosen token, embedded
    return state.get(), out_tokens.copy() if host_tokens else out_tokens.get(), seen_dev.get()


@pytest.mark.parametrize("params", SAMPLING, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_sampler_matches_reference(cupy_gpu, cc, params, ties):
    rng = np.random.default_rng(zlib.crc32(f"{params}{ties}".encode()))
    for trial in range(12):
        vocab = [32000, 512, 1000][trial % 3]
        logits = (3 * rng.standard_normal(vocab)).astype(np.float32)
        if ties:                                     # many equal logits, also at the top
            logits = np.round(logits * 2) / 2
        history = rng.choice(vocab, 20, replace=False)
        u = rng.random()
        step = trial % 3
        uniforms = np.concatenate([rng.random(step), [u]])
        state, out_tokens, seen = run_sampler(cupy_gpu, cc, logits, params, history, uniforms, step)
        expected = sample(logits, params, history, u)
        assert state[1] == expected, f"trial {trial}: device {state[1]}, reference {expected}"
        assert out_tokens[step] == expected and state[2] == step + 1 and state[0] == 8
        assert bool(seen[expected]) == (params.repetition_penalty != 1.0 or expected in set(history))


def test_sampler_writes_tokens_into_pinned_host_memory(cupy_gpu, cc):
    rng = np.random.default_rng(11)
    for step in range(3):
        logits = rng.standard_normal(32000).astype(np.float32)
        state, out_tokens, _ = run_sampler(cupy_gpu, cc, logits, SamplingParams(), [], rng.random(step + 1), step,
                                           host_tokens=True)
        expected = int(np.argmax(logits))
        assert state[1] == expected and out_tokens[step] == expected
        assert np.all(np.delete(out_tokens, step) == -1)


def test_greedy_lowest_index_wins_ties(cupy_gpu, cc):
    logits = np.zeros(32000, np.float32)
    logits[[7, 123, 31999]] = 5.0
    state, _, _ = run_sampler(cupy_gpu, cc, logits, SamplingParams(), [], [0.5])
    assert state[1] == 7


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLING[0], SAMPLING[2]], ids=str)
def test_sampler_takes_greedy_tokens_from_the_heads_argmax(cupy_gpu, cc, params):
    """Greedy without a penalty takes the token from the output head's argmax word (which names a row
    other than the logits' argmax here, to tell the two apart); other modes sample from the logits.
    Every mode clears the word for the next step."""
    cp = cupy_gpu
    rng = np.random.default_rng(zlib.crc32(str(params).encode()))
    logits = (3 * rng.standard_normal(32000)).astype(np.float32)
    folded = int(np.argmin(logits))
    word = np.zeros(32000, np.float32)
    word[folded] = 1.0
    head_best = cp.asarray(np.array([gemv_k.argmax_key(word)], np.uint64))
    u = rng.random()
    state, _, _ = run_sampler(cupy_gpu, cc, logits, params, [], [u], head_best=head_best)
    uses_word = params.temperature == 0 and params.repetition_penalty == 1.0
    assert state[1] == (folded if uses_word else sample(logits, params, [], u))
    assert int(head_best.get()[0]) == 0
    state, _, _ = run_sampler(cupy_gpu, cc, logits, params, [], [u], head_best=head_best)   # an empty word: scan
    assert state[1] == sample(logits, params, [], u)


# ----------------------------------------------------------------------------------- small kernels

@pytest.mark.parametrize("encoding", ["f16", "f32", "bf16"])
def test_embedding_gather(cupy_gpu, misc_module, encoding):
    cp = cupy_gpu
    rng = np.random.default_rng(3)
    vocab, dim = 1000, 2048 + 8
    table = random_encoded("f16", (vocab, dim), None, rng).to_float32()
    if encoding == "f16":
        stored, expected = table.astype(np.float16), table
    elif encoding == "f32":
        stored, expected = table, table
    else:
        stored = (table.view(np.uint32) >> 16).astype(np.uint16)
        expected = (stored.astype(np.uint32) << 16).view(np.float32)
    x = cp.full(dim, np.nan, dtype=cp.float32)
    launch = misc_k.make_embed(misc_module, cp.asarray(stored), encoding, dim, dim,
                               cp.asarray(np.array([0, 417, 0, 0], np.int32)), x)
    launch()
    np.testing.assert_array_equal(x.get(), expected[417])


def test_read_bandwidth_probe_runs(cupy_gpu, misc_module):
    cp = cupy_gpu
    data = cp.ones(64 << 20, dtype=cp.uint8)
    sink = cp.zeros(1, dtype=cp.uint32)
    misc_k.make_read_bandwidth(misc_module, data, sink, 132)()
    cp.cuda.Device().synchronize()
