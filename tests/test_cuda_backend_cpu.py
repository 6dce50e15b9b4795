"""The CUDA backend's selection, error paths and pure-Python parts, on a machine without a GPU."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.kernels import attention as attn_k
from tinyinfer.kernels import build
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.runtime import autotune, load
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import random_encoded, tinf_config, write_random_model
from tinyinfer.runtime.errors import DeviceError

from conftest import cuda_available  # noqa: E402

no_gpu = pytest.mark.skipif(cuda_available(), reason="checks the behaviour without a GPU")
SMALL = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 300, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("m") / "small-q4.tinf", tinf_config(SMALL), "q4", 32)


def test_modules_import_without_cupy():
    import tinyinfer.runtime.bench  # noqa: F401
    import tinyinfer.runtime.cuda_backend  # noqa: F401
    import tinyinfer.runtime.verify  # noqa: F401
    import tinyinfer.runtime.weights_upload  # noqa: F401


@no_gpu
def test_cuda_device_without_gpu_is_one_clear_error(small_model):
    with pytest.raises(DeviceError, match="--device cpu"):
        load(small_model, device="cuda")


@no_gpu
def test_auto_falls_back_to_numpy(small_model):
    from tinyinfer.runtime.numpy_backend import NumpyBackend

    with load(small_model, device="auto") as model:
        assert isinstance(model.backend, NumpyBackend)


@no_gpu
def test_verify_needs_the_gpu_and_bench_measures_the_cpu(small_model):
    from tinyinfer.runtime.bench import BenchError, run_bench
    from tinyinfer.runtime.verify import VerifyError, run_verify

    with load(small_model, device="cpu") as model:
        assert run_bench(model, 8)["backend"] == "numpy"
        with pytest.raises(BenchError, match="exceeds the context of 64"):
            run_bench(model, 60)
    with pytest.raises(VerifyError, match="--device cpu"):
        run_verify(small_model, 4)


def test_memory_plan_refusal_names_the_fix():
    from tinyinfer.runtime.cuda_backend import check_plan, memory_plan

    plan = memory_plan(weight_bytes=30 << 30, kv_bytes=2 << 30, scratch_bytes=1 << 20, free_bytes=16 << 30)
    assert not plan["fits"]
    with pytest.raises(DeviceError, match="smaller max_context"):
        check_plan(plan, 4096)
    check_plan(memory_plan(1 << 30, 1 << 20, 1 << 20, 16 << 30), 4096)


def test_unsupported_encodings_are_refused(tmp_path):
    from tinyinfer.formats import Tensor, TensorSpec, TinfWriter
    from tinyinfer.runtime.cuda_backend import check_encodings

    good = open_tinf(write_random_model(tmp_path / "ok.tinf", tinf_config(SMALL), "q8", 64))
    check_encodings(good)
    specs = [TensorSpec(i.name, "bf16" if i.name == "layers.1.wo" else i.encoding, i.shape, i.group)
             for i in good.infos.values()]
    path = tmp_path / "bf16-wo.tinf"
    meta = {k: v for k, v in good.metadata.items() if k != "tensors"}
    with TinfWriter(path, meta, specs) as w:
        for spec in specs:
            w.write(spec.name, good.tensor(spec.name) if spec.name != "layers.1.wo"
                    else Tensor("bf16", spec.shape, np.zeros(spec.shape, np.uint16)))
    with pytest.raises(DeviceError, match="--quant"):
        check_encodings(open_tinf(path))


def test_sources_are_self_contained_for_nvrtc():
    for name in build.SOURCES:
        if name.endswith(".cu"):
            text = build.expanded_source(name)
            assert '#include "' not in text and "STATE_POS" in text and "#pragma once" not in text
    assert len(build.source_hash()) == 16
    assert "-arch=sm_90a" in build.compile_options(90) and not any("arch" in o for o in build.compile_options(86))


def test_generation_launches_whole_graphs_of_steps_then_single_steps():
    from tinyinfer.runtime.cuda_backend import STEPS_PER_GRAPH, launch_sizes

    n = 3 * STEPS_PER_GRAPH + STEPS_PER_GRAPH - 1
    assert launch_sizes(n) == [STEPS_PER_GRAPH] * 3 + [1] * (STEPS_PER_GRAPH - 1)
    assert launch_sizes(STEPS_PER_GRAPH - 1) == [1] * (STEPS_PER_GRAPH - 1) and launch_sizes(0) == []


def test_bench_rate_counts_from_the_first_launchs_last_token():
    """Tokens of one graph launch reach the host together: 8 tokens in launches of 4, 1 ms per
    token, arrive at 4, 4, 4, 4, 8, 8, 8, 8 ms; the steady rate is 4 tokens in 4 ms, not 7 in 4."""
    from tinyinfer.runtime.bench import steady_rate

    stamps = [0.004] * 4 + [0.008] * 4
    assert steady_rate(stamps, 4) == pytest.approx(1000.0)
    assert steady_rate([0.001, 0.002, 0.003], 1) == pytest.approx(1000.0)
    assert steady_rate([0.004] * 4, 4) == 0.0


def test_gemv_shapes_and_launch_geometry():
    t = random_encoded("q4", (2560, 2048), 64, np.random.default_rng(0))
    shape = gemv_k.shape_of(t, "rmsnorm", "store")
    assert shape.cols_pad == 2048 and shape.weight_bytes == 2560 * (1024 + 64) and shape.blocked
    assert gemv_k.name_expression(shape, gemv_k.GemvConfig(2)) == "gemv<2,64,2,1,0,1,2,0,1,0,0>"
    config = gemv_k.GemvConfig(2, 8)
    # reduction scratch + RMSNorm's 16 per-warp sums + x as fp16 hi and lo (with bank padding, lo 32
    # bytes further on) + 64 zero bytes per warp (16) for idle B lanes + one float of bias correction per 32-column
    # section
    assert gemv_k.shared_bytes(shape, config) == 2 * 8 * 32 * 4 + 64 + 4 * (2048 + 256) + 32 + 64 * 16 + 4 * 2048 // 32
    odd = gemv_k.shape_of(random_encoded("f16", (37, 72), None, np.random.default_rng(0)), "plain", "add")
    assert odd.cols_pad == 72 and gemv_k.staged_halves(odd) == 128 + 16 and not odd.blocked
    # a split-K cluster keeps the peer block's sums (two tiles' worth) behind the reduction scratch
    split = gemv_k.GemvConfig(1, 4, 2)
    assert gemv_k.shared_bytes(odd, split) - gemv_k.shared_bytes(odd, gemv_k.GemvConfig(1, 4)) == 2 * 16 * 4
    assert gemv_k.name_expression(odd, split) == "gemv<0,0,1,0,1,2,4,0,0,0,0>"
    assert gemv_k.name_expression(odd, gemv_k.GemvConfig(1, 4, 2, refill=True)) == "gemv<0,0,1,0,1,2,4,1,0,0,0>"
    assert gemv_k.name_expression(odd, gemv_k.GemvConfig(1, 4, 2, staggered=True)) == "gemv<0,0,1,0,1,2,4,0,0,0,1>"
    # a wide block (16 warps) is its own instantiation (launch bounds of 512 threads), with twice the
    # warps' partial sums in its reduction scratch
    wide = gemv_k.GemvConfig(1, 16)
    assert wide.wide and not config.wide and wide.label == "R1/w16/d4"
    assert gemv_k.name_expression(shape, wide) == "gemv<2,64,1,1,0,1,4,0,1,1,0>"
    assert gemv_k.shared_bytes(shape, wide) - gemv_k.shared_bytes(shape, gemv_k.GemvConfig(1, 8)) == 2 * 8 * 16 * 4


def test_split_k_is_tuned_only_where_it_can_run():
    """Clusters exist from Hopper on, and an RMSNorm input needs the whole vector in each block."""
    t = random_encoded("q4", (2048, 5632), 64, np.random.default_rng(0))
    down, qkv = gemv_k.shape_of(t, "plain", "add"), gemv_k.shape_of(t, "rmsnorm", "store")
    assert {c.split for c in gemv_k.configs_for(down, 90)} == {1, 2}
    assert {c.split for c in gemv_k.configs_for(down, 86)} == {1}
    assert {c.split for c in gemv_k.configs_for(qkv, 90)} == {1}
    assert len(gemv_k.configs_for(down, 90)) == 2 * len(gemv_k.CANDIDATES)
    assert gemv_k.GemvConfig(2, 8, 2).label == "R2/w8/split2/d2" and gemv_k.GemvConfig().label == "R1/w8/d4"
    gate_up = gemv_k.shape_of(t, "plain", "swiglu")
    assert not gemv_k.can_split(gate_up, 90)
    for shape in (qkv, gate_up):                  # refused before any kernel is looked up
        with pytest.raises(ValueError, match="no split-K GEMV"):
            gemv_k.make_gemv(None, shape, gemv_k.GemvConfig(1, 8, 2), None, None, None)


def test_gemv_reference_is_the_reference_math():
    rng = np.random.default_rng(1)
    t = random_encoded("q8", (50, 96), 32, rng)
    x = rng.standard_normal(192).astype(np.float32)
    w = t.to_float32()
    np.testing.assert_allclose(gemv_k.gemv_reference(t, x, output="swiglu"), ref.swiglu(w @ x[:96]), rtol=1e-5,
                               atol=1e-6)
    norm = rng.random(96).astype(np.float32)
    np.testing.assert_allclose(gemv_k.gemv_reference(t, x, "rmsnorm", norm, 1e-5, residual=x[:50]),
                               w @ ref.rms_norm(x[:96], norm, 1e-5) + x[:50], rtol=1e-5, atol=1e-6)


def test_qwen2_qkv_gemv_adds_its_bias_as_it_stores():
    """The bias output: its own instantiation, the reference adds the bias after the normalised
    product, and a launch without the bias (or with one where none is added) is refused."""
    rng = np.random.default_rng(3)
    t = random_encoded("q4", (1152, 896), 64, rng)
    shape = gemv_k.shape_of(t, "rmsnorm", "store_bias")
    assert gemv_k.name_expression(shape, gemv_k.GemvConfig(1, 8)) == "gemv<2,64,1,1,5,1,4,0,1,0,0>"
    assert not gemv_k.splittable(shape) and gemv_k.can_stagger(shape, gemv_k.GemvConfig(1, 8, depth=1))
    x, norm, bias = (rng.standard_normal(n).astype(np.float32) for n in (896, 896, 1152))
    np.testing.assert_allclose(gemv_k.gemv_reference(t, x, "rmsnorm", norm, 1e-5, output="store_bias", bias=bias),
                               t.to_float32() @ ref.rms_norm(x, norm, 1e-5) + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="a bias is passed exactly when"):
        gemv_k.make_gemv(None, shape, gemv_k.GemvConfig(), None, None, None)
    with pytest.raises(ValueError, match="a bias is passed exactly when"):
        gemv_k.make_gemv(None, gemv_k.shape_of(t, "rmsnorm", "store"), gemv_k.GemvConfig(), None, None, None,
                         bias=np.zeros(1152, np.float32))


def test_attention_reference_matches_the_numpy_backend_math():
    rng = np.random.default_rng(2)
    n_heads, n_kv, hd, pos = 8, 2, 16, 5
    cos, sin = ref.rope_tables(hd, 16, 10000.0, None)
    cache_k = rng.standard_normal((16, n_kv, hd)).astype(np.float32)
    cache_v = rng.standard_normal((16, n_kv, hd)).astype(np.float32)
    qkv = rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)
    out, k_row, v_row = attn_k.attention_reference(qkv, cache_k, cache_v, pos, n_heads, n_kv, hd, cos, sin)
    q = ref.apply_rope(qkv[: n_heads * hd].reshape(1, n_heads, hd), np.array([pos]), cos, sin)
    keys, values = cache_k.copy(), cache_v.copy()
    keys[pos], values[pos] = k_row, v_row
    np.testing.assert_allclose(out, ref.attention(q, keys, values, np.array([pos]))[0], rtol=1e-6)
    windowed, _, _ = attn_k.attention_reference(qkv, cache_k, cache_v, pos, n_heads, n_kv, hd, cos, sin, window=3)
    np.testing.assert_allclose(windowed, ref.attention(q, keys, values, np.array([pos]), 3)[0], rtol=1e-6)
    assert not np.allclose(windowed, out, atol=1e-3)
    assert attn_k.n_slices(4, 2048, 132, False) == 64 and attn_k.n_slices(32, 272, 132, False) == 9
    assert attn_k.n_slices(32, 16, 132, False) == 1 and attn_k.n_slices(4, 2048, 132, True) == attn_k.CLUSTER_SIZE
    assert attn_k.uses_cluster(90) and not attn_k.uses_cluster(86)
    assert attn_k.threads_for(32, 4, 64, 8, 132) == 256 and attn_k.threads_for(32, 32, 128, 8, 132) == 128
    assert attn_k.threads_for(64, 1, 128, 200, 132) == 256      # 64 heads x 128 dims need 256 threads


def test_attention_plan_picks_the_kernel_by_shape(monkeypatch):
    monkeypatch.delenv("TINYINFER_ATTENTION", raising=False)
    plan = attn_k.plan
    # Groups of up to 8 query heads of 64 or 128 dims (TinyLlama, Llama-2-7B, Llama-3-70B): a block
    # per KV head on the tensor cores, on any GPU; with clusters (Hopper), as many blocks per KV
    # head as leave half the SMs free, at most 8, from the position where one block would take a
    # second pass (2 blocks: 128 rows for head_dim 128) or a third (more: 2 x 256 for 64, 2 x 128).
    assert plan(32, 4, 64, 2048, 132, 90) == attn_k.AttentionPlan("attention_mma64", False, 1, 256, 8, 512)
    assert plan(32, 4, 64, 2048, 132, 80) == attn_k.AttentionPlan("attention_mma64", False, 1, 256)
    assert plan(32, 32, 128, 4096, 132, 90) == attn_k.AttentionPlan("attention_mma128", False, 1, 256, 2, 128)
    assert plan(32, 32, 128, 4096, 80, 90) == attn_k.AttentionPlan("attention_mma128", False, 1, 256)   # 64 > 80 / 2
    assert plan(64, 8, 128, 8192, 132, 90) == attn_k.AttentionPlan("attention_mma128", False, 1, 256, 8, 256)
    assert plan(32, 4, 64, 512, 132, 90) == attn_k.AttentionPlan("attention_mma64", False, 1, 256)      # too short
    assert plan(64, 8, 128, 4096, 132, 75).kernel == "attention_mma128"
    # Larger groups: a block per query head; other head sizes: the chunked kernel (clusters on Hopper).
    assert plan(64, 1, 128, 2048, 132, 90) == attn_k.AttentionPlan("attention_rows", False, 64, 256)
    assert plan(32, 32, 96, 4096, 132, 90) == attn_k.AttentionPlan("attention", True, 8, 128)
    assert plan(32, 32, 96, 4096, 132, 86).kernel == "attention"
    assert plan(12, 3, 96, 2048, 132, 90).kernel == "attention"
    assert plan(32, 4, 64, 2048, 132, 90, "chunked") == attn_k.AttentionPlan("attention", True, 8, 256)
    assert plan(32, 32, 128, 4096, 132, 90, "rows") == attn_k.AttentionPlan("attention_rows", False, 1, 256)
    monkeypatch.setenv("TINYINFER_ATTENTION", "chunked")
    assert plan(32, 4, 64, 2048, 132, 90).kernel == "attention"
    with pytest.raises(ValueError):
        plan(32, 4, 64, 2048, 132, 90, "fast")
    with pytest.raises(ValueError):                                    # 64 heads per KV head
        plan(64, 1, 128, 2048, 132, 90, "mma")
    # Rows a lane group holds per pass: about PASS_ROWS per block.
    assert attn_k.rows_per_lane_group(64, 256) == 8        # 32 lane groups of 8 lanes
    assert attn_k.rows_per_lane_group(128, 256) == 8       # 16 lane groups of 16 lanes: 128 rows a pass
    assert attn_k.rows_per_lane_group(8, 128) == 2         # 128 lane groups of one lane


def test_attention_shape_limits():
    attn_k.check_shape(32, 4, 64)
    attn_k.check_shape(64, 8, 128)
    attn_k.check_shape(64, 1, 128, 256)
    for n_heads, n_kv, hd, threads in [(32, 4, 12, 256), (8, 1, 264, 256), (64, 1, 256, 256), (12, 5, 64, 256),
                                       (64, 1, 128, 128)]:
        with pytest.raises(ValueError):
            attn_k.check_shape(n_heads, n_kv, hd, threads)
    # q, scores, running max/sum/rescale, block result, merge weights, new k/v row, staged K and V rows
    stage = attn_k.STAGE_HALVES // 64
    assert attn_k.shared_bytes(32, 4, 64, 8, 256) == 4 * (2 * 8 * 64 + 8 * stage + 24 + 16 + 64) + 4 * 64 + 4 * stage * 72
    # 64 heads of 128 on one KV head: the p . V part sums (64 * 128 floats) outgrow the staged rows
    assert attn_k.shared_bytes(64, 1, 128, 8, 256) == 4 * (2 * 64 * 128 + 64 * 32 + 192 + 128 + 64) + 4 * 128 + 4 * 64 * 128


def test_autotune_cache_roundtrip(small_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYINFER_CACHE_DIR", str(tmp_path))
    tinf = open_tinf(small_model)
    key = autotune.cache_key(tinf, "NVIDIA H200", 90, "abc")
    assert key == autotune.cache_key(open_tinf(small_model), "NVIDIA H200", 90, "abc")
    assert key != autotune.cache_key(tinf, "NVIDIA A100", 80, "abc")
    assert key != autotune.cache_key(tinf, "NVIDIA H200", 90, "abd")
    assert autotune.load_cached(key) is None
    choices = {"wqkv": {"row_tiles": 2, "warps": 4}}
    assert autotune.save_cached(key, choices, {"gpu": "NVIDIA H200"}) == tmp_path / "autotune" / f"{key}.json"
    assert autotune.load_cached(key) == choices


def test_verify_comparison_separates_near_ties():
    from tinyinfer.runtime.verify import compare_logits

    rng = np.random.default_rng(4)
    reference = rng.standard_normal((3, 1000)).astype(np.float32)
    top = reference.argmax(1)
    reference[1, 7] = reference[1, top[1]] - 1e-5               # position 1: a near tie at token 7
    gpu = reference + 1e-4 * rng.standard_normal(reference.shape).astype(np.float32)
    gpu[1, top[1]] = reference[1, top[1]]
    gpu[1, 7] = reference[1, top[1]] + 1e-4
    result = compare_logits(gpu, reference)
    assert not result["mismatches"] and [n["position"] for n in result["near_ties"]] == [1]
    gpu[2, 3] = reference[2, top[2]] + 1.0                      # position 2: a real mismatch
    assert [m["position"] for m in compare_logits(gpu, reference)["mismatches"]] == [2]


def test_random_models_are_valid_files(small_model):
    from tinyinfer.runtime.weights_upload import data_extent

    with open_tinf(small_model) as f:
        assert all(f.check(name) for name in f.names)
        assert data_extent(f) <= f.file_size - f.data_offset
        w = f.tensor("layers.0.w_down").to_float32()
        assert w.shape == (64, 172) and 0.5 < w.std() * np.sqrt(172) < 1.5


def test_driver_launch_marshals_arguments_like_cuda_h():
    """kernels/pdl.py hands cuLaunchKernelEx a CUlaunchConfig (with the PDL and cluster attributes)
    and a void** of argument values; check both without a GPU (the struct layout is cuda.h's on
    64-bit Linux)."""
    import ctypes
    from types import SimpleNamespace

    from tinyinfer.kernels import pdl

    assert ctypes.sizeof(pdl._LaunchConfig) == 56 and pdl._LaunchConfig.stream.offset == 32
    assert ctypes.sizeof(pdl._Attribute) == 72 and pdl._Attribute.value.offset == 8
    array = SimpleNamespace(data=SimpleNamespace(ptr=0xDEAD0000))
    launch = SimpleNamespace(args=(array, np.int32(-7), np.float32(1.5), np.uint64(2**40)),
                             kernel=SimpleNamespace(kernel=SimpleNamespace(ptr=1234)),
                             grid=(80,), block=(256,), shared_mem=4096, cluster=1)
    early = pdl.DriverLaunch(launch, early=True)
    assert list(early.config.grid) == [80, 1, 1] and list(early.config.block) == [256, 1, 1]
    assert early.config.shared_mem == 4096 and early.config.num_attrs == 1
    assert early.attributes[0].id == pdl.PROGRAMMATIC_STREAM_SERIALIZATION and early.attributes[0].value.value == 1
    read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64]
    values = [ctypes.cast(early.pointers[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(read)]
    assert values == [0xDEAD0000, -7, 1.5, 2**40]
    with pytest.raises(TypeError):
        pdl.DriverLaunch(SimpleNamespace(**{**vars(launch), "args": (7,)}), early=True)   # a Python int: size unknown

    clustered = pdl.DriverLaunch(SimpleNamespace(**{**vars(launch), "cluster": 2}), early=True)
    attributes = ctypes.cast(clustered.config.attrs, ctypes.POINTER(pdl._Attribute))
    assert clustered.config.num_attrs == 2 and attributes[1].id == pdl.CLUSTER_DIMENSION
    assert list(attributes[1].value.dims) == [2, 1, 1]
    plain = pdl.DriverLaunch(SimpleNamespace(**{**vars(launch), "cluster": 2}), early=False)
    assert plain.config.num_attrs == 1 and ctypes.cast(plain.config.attrs, ctypes.POINTER(pdl._Attribute))[0].id == 4


def test_upload_reads_the_file_bytes_at_an_offset(tmp_path):
    from tinyinfer.runtime.weights_upload import read_exactly

    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    buffer = np.zeros(70_001, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exactly(fd, buffer, 12_345)
        assert np.array_equal(buffer, data[12_345: 12_345 + 70_001])
        with pytest.raises(OSError, match="truncated"):
            read_exactly(fd, buffer, 40_000)          # only 60,003 bytes are left there
    finally:
        os.close(fd)


def test_autotune_ties_go_to_fewer_row_tiles():
    C = gemv_k.GemvConfig
    # R2/w8 is fastest, but R1/w8 is within 3%: the smaller tiles win the tie
    assert autotune.pick({C(2, 8): 3.50, C(1, 8): 3.58, C(1, 4): 3.9}) == C(1, 8)
    # outside the tie margin the fastest wins
    assert autotune.pick({C(2, 8): 12.2, C(1, 8): 13.1}) == C(2, 8)
    # among tied configurations of the same R, the faster
    assert autotune.pick({C(2, 4): 16.8, C(2, 8): 17.1, C(1, 4): 19.3}) == C(2, 4)
    assert autotune.pick({C(1, 8): 4.0, C(1, 4): 3.95, C(2, 8): 3.9}) == C(1, 4)
    # a split-K cluster must win by more than the margin (it fills twice the SMs' block slots)
    assert autotune.pick({C(1, 8, 2): 5.0, C(1, 8): 5.1}) == C(1, 8)
    assert autotune.pick({C(1, 8, 2): 4.0, C(1, 8): 5.1}) == C(1, 8, 2)
    # so must a wide block (it takes a whole SM), even against more row tiles
    assert autotune.pick({C(1, 16): 5.0, C(2, 8): 5.1, C(1, 8): 6.0}) == C(2, 8)
    assert autotune.pick({C(1, 16): 4.0, C(2, 8): 5.1}) == C(1, 16)


def test_picks_timing_alone_cannot_settle_are_settled_in_the_whole_step():
    C = gemv_k.GemvConfig
    best = {"wqkv": C(1, 8), "wo": C(1, 8, 2), "w_gate_up": C(1, 8), "w_down": C(1, 8, 2)}
    timings = {"wqkv": {C(1, 8): 3.0, C(2, 8): 3.2},                       # no contest: the fastest, unsplit
               "wo": {C(1, 8, 2): 4.0, C(2, 8): 5.0, C(1, 8): 5.05, C(1, 4): 6.0},
               "w_gate_up": {C(2, 8): 17.9, C(1, 8): 18.3},                 # a tie given to fewer row tiles
               "w_down": {C(1, 8, 2): 5.5, C(1, 8): 6.2}}
    assert autotune.step_contest(best["wo"], timings["wo"]) == (C(1, 8), [C(1, 8, 2)])   # unsplit: tied, fewer tiles
    assert autotune.step_contest(best["w_gate_up"], timings["w_gate_up"]) == (C(1, 8), [C(2, 8)])
    assert autotune.step_contest(best["wqkv"], timings["wqkv"]) is None
    # a wide block picked alone faces the best ordinary configuration in the step, as split-K does
    wide_times = {C(1, 16): 3.0, C(1, 16, 2): 3.5, C(2, 8): 3.6, C(1, 8): 3.65}
    assert autotune.step_contest(C(1, 16), wide_times) == (C(1, 8), [C(1, 16)])
    assert autotune.step_contest(C(1, 16, 2), wide_times) == (C(1, 8), [C(1, 16, 2), C(1, 16)])
    # every configuration tied alone challenges, not only the tie's winner (TinyLlama f16's o
    # projection on an H200: the tie went to R = 1 wide blocks, R = 2 wide blocks were 2% faster in the step)
    f16_wo = {C(2, 16): 4.6, C(1, 16): 4.7, C(1, 8): 4.8, C(2, 8): 5.5}
    assert autotune.step_contest(C(1, 16), f16_wo) == (C(1, 8), [C(1, 16), C(2, 16)])
    chosen, held = autotune.confirm_in_step({"wo": C(1, 16)}, {"wo": f16_wo},
                                            lambda t: {C(1, 8): 712.2, C(1, 16): 743.9, C(2, 16): 698.6}[t["wo"]])
    assert chosen == {"wo": C(2, 16)} and len(held["wo"]) == 3
    step = {("wo", C(1, 8, 2)): 490.0, ("wo", C(1, 8)): 500.0,             # split wins in the step
            ("w_gate_up", C(2, 8)): 480.0, ("w_gate_up", C(1, 8)): 500.0,  # so does the faster-alone R = 2
            ("w_down", C(1, 8, 2)): 505.0, ("w_down", C(1, 8)): 500.0}     # split loses
    contests = []

    def step_us(tuning):
        contests.append(tuning)
        current = ["wo", "w_gate_up", "w_down"][(len(contests) - 1) // 2]   # 2 configs x 1 round each
        return step[(current, tuning[current])]

    chosen, held = autotune.confirm_in_step(best, timings, step_us)
    assert chosen == {"wqkv": C(1, 8), "wo": C(1, 8, 2), "w_gate_up": C(2, 8), "w_down": C(1, 8)}
    assert set(held) == {"wo", "w_gate_up", "w_down"} and held["w_down"] == {C(1, 8): 500.0, C(1, 8, 2): 505.0}
    assert len(contests) == 6 and contests[-1]["w_gate_up"] == C(2, 8)     # later contests see earlier results
    # a challenger within the margin does not unseat the incumbent
    near = autotune.confirm_in_step({"wo": C(1, 8, 2)}, {"wo": timings["wo"]},
                                    lambda t: 499.0 if t["wo"].split == 2 else 500.0)[0]
    assert near == {"wo": C(1, 8)}


def test_ring_depths_default_round_trip_and_variants():
    C = gemv_k.GemvConfig
    assert C(1, 8).depth == 4 and C(2, 4).depth == 2 and C(1, 8, 2, 3).depth == 3
    # caches and files keep entries written before depths were tuned: no depth key means the default
    assert C(1, 8).as_dict() == {"row_tiles": 1, "warps": 8} and C(**C(1, 8).as_dict()) == C(1, 8)
    assert C(2, 8, 2, 1).as_dict() == {"row_tiles": 2, "warps": 8, "split": 2, "depth": 1}
    assert C(**C(2, 8, 2, 1).as_dict()) == C(2, 8, 2, 1)
    q4 = gemv_k.shape_of(random_encoded("q4", (256, 512), 64, np.random.default_rng(0)), "plain", "add")
    f16 = gemv_k.shape_of(random_encoded("f16", (256, 512), None, np.random.default_rng(0)), "plain", "add")
    assert [c.depth for c in gemv_k.depth_variants(q4, C(1, 8, 2))] == [1, 2, 3, 4]
    assert [c.depth for c in gemv_k.depth_variants(q4, C(2, 4))] == [1, 2]
    assert [c.depth for c in gemv_k.depth_variants(f16, C(1, 8))] == [1, 2, 3, 4]
    assert all(c.split == 2 and c.warps == 8 for c in gemv_k.depth_variants(q4, C(1, 8, 2)))
    assert set(gemv_k.configs_for(q4, 90)) < set(gemv_k.all_configs(q4, 90))
    # splits x warps (4, 8, 16) x (R1 + R2 depths) x grids x refill (a plain input: none staggered)
    assert len(gemv_k.all_configs(q4, 90)) == 2 * 3 * (4 + 2) * 2 * 2
    # an RMSNorm input: no split-K, and staggered at depth 1 (R1 and R2)
    q4_norm = replace(q4, input="rmsnorm")
    assert len(gemv_k.all_configs(q4_norm, 90)) == 3 * 2 * 2 * ((4 + 2) + 2)
    q8 = gemv_k.shape_of(random_encoded("q8", (256, 512), 64, np.random.default_rng(0)), "plain", "add")
    assert not any(c.refill and c.row_tiles == 2 and c.depth == 2 for c in gemv_k.all_configs(q8, 90))   # spills
    # a refilled choice's depth variants are all kernels that exist (a joint move of the tuner built
    # q8 R = 2 at depth 2 refilled, which is never compiled)
    variants = gemv_k.depth_variants(q8, C(2, 16, depth=1, refill=True))
    assert [(c.depth, c.refill) for c in variants] == [(1, True), (2, False)]
    assert set(variants) <= set(gemv_k.all_configs(q8, 90))
    assert len(gemv_k.all_configs(q8, 90)) == 2 * 3 * (4 + 2) * 2 * 2 - 2 * 3 * 2


def test_refill_round_trips_and_is_tried_last_where_the_kernel_exists():
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    # caches and files: no key means the ring loaded after each item, as before the option existed
    assert "refill" not in C(2, 8, 1, 1).as_dict()
    assert C(2, 8, 1, 1, refill=True).as_dict() == {"row_tiles": 2, "warps": 8, "depth": 1, "refill": True}
    assert C(**C(2, 8, 1, 1, True, True).as_dict()) == C(2, 8, 1, 1, True, True)
    assert C(2, 8, 1, 1, True, True).label.endswith("/bal/refill")
    q4 = gemv_k.shape_of(random_encoded("q4", (256, 512), 64, np.random.default_rng(0)), "plain", "add")
    q8 = gemv_k.shape_of(random_encoded("q8", (256, 512), 64, np.random.default_rng(0)), "plain", "add")
    fake = SimpleNamespace(shapes={"w_gate_up": q4, "wo": q8})
    assert CudaBackend.refill_options(fake, "w_gate_up", C(2, 8, 1, 2)) == [C(2, 8, 1, 2, refill=True)]
    assert CudaBackend.refill_options(fake, "w_gate_up", C(2, 8, 1, 2, refill=True)) == [C(2, 8, 1, 2)]
    assert CudaBackend.refill_options(fake, "wo", C(2, 8, 1, 2)) == []      # q8 R = 2 at depth 2: no such kernel
    assert CudaBackend.refill_options(fake, "wo", C(2, 8, 1, 1)) == [C(2, 8, 1, 1, refill=True)]


def test_staggered_first_items_round_trip_and_exist_for_rmsnorm_inputs_at_depth_1():
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    # caches and files: no key means the whole first item loaded before the PDL wait, as before the option
    assert "staggered" not in C(2, 16, 1, 1).as_dict()
    assert C(2, 16, 1, 1, staggered=True).as_dict() == {"row_tiles": 2, "warps": 16, "depth": 1, "staggered": True}
    assert C(**C(2, 8, 1, 1, True, True, True).as_dict()) == C(2, 8, 1, 1, True, True, True)
    assert C(2, 8, 1, 1, True, True, True).label.endswith("/bal/refill/stag")
    rng = np.random.default_rng(0)
    q4_norm = gemv_k.shape_of(random_encoded("q4", (256, 512), 64, rng), "rmsnorm", "swiglu")
    q4_plain = gemv_k.shape_of(random_encoded("q4", (256, 512), 64, rng), "plain", "add")
    # staggered at ring depth 1 only (deeper rings spilled some kinds)
    assert not gemv_k.can_stagger(q4_norm, C(1, 8, 1, 2, refill=True)) and not gemv_k.can_stagger(q4_norm, C(1, 8, 1, 4))
    assert gemv_k.can_stagger(q4_norm, C(1, 8, 1, 1, refill=True)) and gemv_k.can_stagger(q4_norm, C(2, 16, 1, 1))
    assert not gemv_k.can_stagger(q4_plain, C(2, 16, 1, 1))     # plain inputs lost on Llama-2-7B (gemv.cu STAGGER)
    assert not any(c.staggered and not gemv_k.can_stagger(q4_norm, c) for c in gemv_k.all_configs(q4_norm, 90))
    assert [(c.depth, c.staggered) for c in gemv_k.depth_variants(q4_norm, C(1, 8, 1, 1, refill=True, staggered=True))] \
        == [(1, True), (2, False), (3, False), (4, False)]
    fake = SimpleNamespace(shapes={"w_gate_up": q4_norm, "w_down": q4_plain})
    assert CudaBackend.stagger_options(fake, "w_gate_up", C(2, 16, 1, 1)) == [C(2, 16, 1, 1, staggered=True)]
    assert CudaBackend.stagger_options(fake, "w_down", C(2, 16, 1, 1)) == []
    assert CudaBackend.stagger_options(fake, "w_gate_up", C(2, 16, 1, 1, staggered=True)) == [C(2, 16, 1, 1)]
    assert CudaBackend.stagger_options(fake, "w_gate_up", C(1, 8, 1, 3)) == []
    with pytest.raises(ValueError, match="no staggered GEMV"):
        gemv_k.make_gemv(None, q4_norm, C(1, 8, 1, 3, staggered=True), None, None, None)


def test_balanced_grids_keep_the_rounds_with_fewer_blocks():
    C = gemv_k.GemvConfig
    # Llama-2-7B's gate/up at R = 2 (688 tiles) on 132 SMs x 2 blocks: 3 rounds either way
    assert gemv_k.grid_units(688, 264, False) == 264 and gemv_k.grid_units(688, 264, True) == 230
    assert gemv_k.grid_units(352, 264, True) == 176 and gemv_k.grid_units(768, 264, True) == 256
    for tiles in range(1, 2000, 7):
        for resident in (1, 64, 132, 264, 528):
            plain, balanced = gemv_k.grid_units(tiles, resident, False), gemv_k.grid_units(tiles, resident, True)
            assert balanced <= plain == min(tiles, resident)
            assert -(-tiles // balanced) == -(-tiles // plain)       # as many rounds
            assert balanced == 1 or -(-tiles // (balanced - 1)) > -(-tiles // plain)   # the fewest blocks
    # caches and files: no key means the persistent grid, as before the option existed
    assert "balanced" not in C(2, 8, 1, 1).as_dict()
    assert C(2, 8, 1, 1, True).as_dict() == {"row_tiles": 2, "warps": 8, "depth": 1, "balanced": True}
    assert C(**C(2, 8, 1, 1, True).as_dict()) == C(2, 8, 1, 1, True) and C(2, 8, 1, 1, True).label.endswith("/bal")


def test_ring_depths_are_chosen_in_the_whole_step():
    C = gemv_k.GemvConfig
    best = {"wqkv": C(1, 8), "w_gate_up": C(2, 8), "w_down": C(1, 8)}
    # step time = 500 + each role's offset; a depth must win by STEP_MARGIN (0.5%, 2.5 us here)
    offset = {("wqkv", 1): -10.0, ("wqkv", 2): -3.0, ("w_gate_up", 1): -2.0, ("w_down", 3): -4.0, ("w_down", 1): 6.0}
    calls = []

    def step_us(tuning):
        calls.append(tuning)
        return 500.0 + sum(offset.get((role, config.depth), 0.0) for role, config in tuning.items())

    variants = {role: [replace(config, depth=d) for d in gemv_k.STEP_DEPTHS[config.row_tiles]]
                for role, config in best.items()}
    chosen, held = autotune.variants_in_step(best, variants, step_us)
    assert chosen == {"wqkv": C(1, 8, depth=1), "w_gate_up": C(2, 8), "w_down": C(1, 8, depth=3)}
    assert held["w_gate_up"] == {C(2, 8): 490.0, C(2, 8, depth=1): 488.0}     # within the margin: kept
    assert held["w_down"][C(1, 8, depth=3)] == 486.0                          # timed after wqkv changed
    assert len(calls) == 1 + 3 + 1 + 3     # the incumbent once, then each role's other depths


def test_the_step_contests_loser_stays_in_the_depth_stage():
    """The split-K contest is held at the default depths; at other depths the loser can win (H200,
    TinyLlama q4's down projection), so the depth stage tries it at every depth too."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    q4 = gemv_k.shape_of(random_encoded("q4", (256, 512), 64, np.random.default_rng(0)), "plain", "add")
    fake = SimpleNamespace(shapes={"w_down": q4, "wo": q4}, step_contests={"w_down": {C(1, 8): 505.0, C(1, 8, 2): 507.0}})
    options = CudaBackend.depth_options(fake, "w_down", C(1, 8))
    assert options == gemv_k.depth_variants(q4, C(1, 8)) + gemv_k.depth_variants(q4, C(1, 8, 2))
    assert CudaBackend.depth_options(fake, "wo", C(1, 8)) == gemv_k.depth_variants(q4, C(1, 8))   # no contest held
    best = {"w_down": C(1, 8)}
    us = {C(1, 8): 505.0, C(1, 8, 2): 507.0, C(1, 8, 2, 2): 490.0}
    chosen, held = autotune.variants_in_step(best, {"w_down": options}, lambda t: us.get(t["w_down"], 510.0))
    assert chosen == {"w_down": C(1, 8, 2, 2)} and len(held["w_down"]) == 8
    # a loser more than RIVAL_NEAR (5%) behind is not tried again: TinyLlama q4's o projection in R = 1
    # wide blocks was 9-14% behind at every depth (H200)
    fake.step_contests["wo"] = {C(1, 8, depth=1): 432.0, C(1, 16): 474.6}
    assert CudaBackend.depth_options(fake, "wo", C(1, 8, depth=1)) == gemv_k.depth_variants(q4, C(1, 8, depth=1))
    fake.step_contests["wo"][C(1, 16)] = 452.0                 # 4.6% behind: still tried
    assert C(1, 16, depth=1) in CudaBackend.depth_options(fake, "wo", C(1, 8, depth=1))


def test_the_tuner_runs_depth_grid_refill_and_stagger_stages_in_the_step(monkeypatch):
    """CudaBackend.tune after the timings alone: the depth, then the grid, then the refill, each over
    the roles largest matrix first, then (after the joint moves) the staggered first item for the
    RMSNorm-input GEMVs (the output head too, its kernels built first), each change kept only at
    STEP_MARGIN faster, every timing kept in step_contests and the choices saved."""
    from tinyinfer.kernels import build
    from types import SimpleNamespace

    from tinyinfer.runtime import tune_in_file
    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    rng = np.random.default_rng(0)
    shapes = {"wqkv": gemv_k.shape_of(random_encoded("q4", (2560, 512), 64, rng), "rmsnorm", "store"),
              "w_down": gemv_k.shape_of(random_encoded("q4", (11008, 512), 64, rng), "plain", "add"),
              "output": gemv_k.shape_of(random_encoded("q4", (300, 512), 64, rng), "rmsnorm", "store")}
    saved = {}
    monkeypatch.setattr(tune_in_file, "shipped_gemv_configs", lambda tinf, key, allowed, mlp: (None, "no entries"))
    monkeypatch.setattr(tune_in_file, "backend_key", lambda backend: "key")
    monkeypatch.setattr(autotune, "cache_key", lambda *args: "key")
    monkeypatch.setattr(autotune, "load_cached", lambda key: None)
    monkeypatch.setattr(autotune, "save_cached", lambda key, choices, about: saved.update(choices))
    monkeypatch.setattr(autotune, "tune", lambda candidates, *args: (
        {role: C(2, 16, depth=1) if role == "output" else C(1, 8) for role in candidates}, {}))
    monkeypatch.setattr(autotune, "confirm_in_step", lambda best, times, step_us: (best, {}))
    built = []
    monkeypatch.setattr(build, "compile_all", lambda modules: built.append(list(modules)))

    def step_us(tuning):      # w_down: depth 3 and the balanced grid win, its refill loses; wqkv's refill wins;
        down, qkv, head = tuning["w_down"], tuning["wqkv"], tuning["output"]     # the head staggered wins
        return 500.0 - 10 * (down.depth == 3) - 5 * down.balanced + 6 * down.refill - 4 * qkv.refill - 3 * head.staggered

    buffer = SimpleNamespace(fill=lambda value: None)
    fake = SimpleNamespace(shapes=shapes, compute_capability=90, n_layers=1, tinf=SimpleNamespace(path="m.tinf"),
                           gpu_name="gpu", log=lambda message: None, x=buffer, ffn_hidden=buffer, attn=buffer,
                           stream=None, wait_launch=None, flush_l2=lambda: None, pdl=True, step_us=step_us,
                           gemv_launch=lambda role, layer, c: SimpleNamespace(grid=(gemv_k.grid_units(
                               -(-shapes[role].rows // (16 * c.row_tiles)), 264, c.balanced),)))
    fake.mlp_candidates = lambda: []          # no fused MLP: these shapes have none (see the fusion test)
    fake.gemv_module = SimpleNamespace(module_for=lambda expression: expression)
    for stage in ("try_in_step", "depth_options", "grid_options", "refill_options", "stagger_options", "neighbour_moves",
                  "wide_moves", "fusion_contest"):
        setattr(fake, stage, getattr(CudaBackend, stage).__get__(fake))
    best = CudaBackend.tune(fake)
    assert best == {"wqkv": C(1, 8, refill=True), "w_down": C(1, 8, depth=3, balanced=True),
                    "output": C(2, 16, depth=1, staggered=True)}
    assert fake.joint_moves == {}                  # no step contest, so no rival to try with neighbours
    assert saved == {role: config.as_dict() for role, config in best.items()}
    down = fake.step_contests["w_down"]       # 4 depths, then the balanced grid, then the refill (a plain input: not staggered)
    assert len(down) == 6 and down[C(1, 8, depth=3, balanced=True, refill=True)] == 491.0
    assert fake.step_contests["wqkv"][C(1, 8, refill=True)] == 481.0
    # a ring of depth 4: no staggered kernel (gemv.can_stagger)
    assert C(1, 8, refill=True, staggered=True) not in fake.step_contests["wqkv"]
    assert C(1, 8, balanced=True) not in fake.step_contests["wqkv"]      # 160 tiles: the same grid either way
    assert fake.step_contests["output"] == {C(2, 16, depth=1): 481.0, C(2, 16, depth=1, staggered=True): 478.0}
    # the staggered kernels are built in one batch, right before their stage
    assert built == [[gemv_k.name_expression(shapes["output"], C(2, 16, depth=1, staggered=True))]]


def test_a_contest_loser_is_tried_again_with_its_neighbours_depths():
    """CudaBackend.neighbour_moves + autotune.moves_in_step: a split-K down projection that loses its
    contest, and a wqkv depth that loses alone, are kept when together they win (as on one H200:
    TinyLlama q4 462 -> 440 us per token); the moves pair the rival with the depths of the GEMV
    after it (the next layer's wqkv)."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    rng = np.random.default_rng(0)
    shapes = {role: gemv_k.shape_of(random_encoded("q4", (rows, 512), 64, rng), *fusion)
              for role, rows, fusion in [("wqkv", 768, ("rmsnorm", "store")), ("wo", 512, ("plain", "add")),
                                         ("w_gate_up", 2048, ("rmsnorm", "swiglu")), ("w_down", 512, ("plain", "add"))]}
    best = {"wqkv": C(1, 8, depth=4), "wo": C(1, 8, depth=1), "w_gate_up": C(2, 8, depth=1), "w_down": C(1, 8, depth=4)}
    split = C(1, 8, 2, depth=4)
    contests = {"w_down": {best["w_down"]: 462.0, split: 471.8, C(1, 8, 2, depth=2): 472.0}}
    fake = SimpleNamespace(shapes=shapes, step_contests=contests)
    moves = CudaBackend.neighbour_moves(fake, best)
    assert moves == [{"w_down": split, "wqkv": C(1, 8, depth=d)} for d in (1, 2, 3)]

    def step_us(tuning):
        together = tuning["w_down"].split == 2 and tuning["wqkv"].depth == 2
        return 439.0 if together else 462.0 + 10 * (tuning["w_down"].split == 2) + 6 * (tuning["wqkv"].depth == 2)

    chosen, held = autotune.moves_in_step(best, moves, step_us)
    assert chosen == {**best, "w_down": split, "wqkv": C(1, 8, depth=2)} and len(held) == 3
    assert autotune.moves_in_step(best, moves, lambda tuning: 462.0)[0] == best     # no gain, no change
    # a rival more than RIVAL_NEAR behind the role's fastest step time makes no moves
    fake.step_contests = {"w_down": {best["w_down"]: 462.0, split: 486.0}}
    assert CudaBackend.neighbour_moves(fake, best) == []
    assert autotune.moves_in_step(best, [], step_us) == (best, {})


def test_every_role_in_wide_blocks_is_one_joint_move_per_depth():
    """CudaBackend.wide_moves: each role at its fastest wide configuration timed alone, as one move
    (as on one H200: TinyLlama f16 748 -> 704 us per token with every GEMV in wide blocks, while no
    role alone gained more than 1.3%), and the same move at each step depth that its row tiles have
    (Llama-2-7B q4: all wide at depth 1 was 5% faster than at the default depths); none that
    repeats another or the choices, none when no wide configuration was timed."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    times = {"wqkv": {C(1, 8): 5.0, C(2, 16): 5.2, C(1, 16): 5.3},
             "w_down": {C(1, 8, 2): 6.0, C(1, 16, 2): 6.1, C(2, 16): 6.4, C(1, 8): 7.0}}
    best = {"wqkv": C(1, 8, depth=1), "w_down": C(1, 8, 2, depth=2)}
    fake = SimpleNamespace(tuning_times=times)
    move = {"wqkv": C(2, 16), "w_down": C(1, 16, 2)}             # default depths: 2 (R = 2) and 4 (R = 1)
    at = lambda d2, d1: {"wqkv": C(2, 16, depth=d2), "w_down": C(1, 16, 2, depth=d1)}
    # R = 2 has depths 1 and 2 only: at depths 3 and 4 the wqkv keeps its default 2 (depth 4 is `move`)
    assert CudaBackend.wide_moves(fake, best) == [move, at(1, 1), at(2, 2), at(2, 3)]
    assert CudaBackend.wide_moves(fake, move) == [at(1, 1), at(2, 2), at(2, 3)]
    assert CudaBackend.wide_moves(SimpleNamespace(tuning_times={}), best) == []

    def step_us(tuning):                  # each wide role alone is slower; both together are faster,
        wide = sum(config.wide for config in tuning.values())      # the more so both at depth 1
        shallow = all(config.depth == 1 for config in tuning.values())
        return {0: 748.0, 1: 750.0, 2: 704.0}[wide] - (10.0 if shallow and wide == 2 else 0.0)

    chosen, held = autotune.moves_in_step(best, CudaBackend.wide_moves(fake, best), step_us)
    assert chosen == at(1, 1) and held[tuple(move.items())] == 704.0 and held[tuple(at(1, 1).items())] == 694.0


def test_the_grid_stage_tries_the_other_grid_where_it_differs():
    """CudaBackend.grid_options: the balanced grid only where it has fewer blocks (the same launch
    otherwise costs a step timing for nothing)."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    tiles = {"w_gate_up": 688, "wo": 256}           # Llama-2-7B q4 at R = 2 and R = 1, 264 block slots
    fake = SimpleNamespace(gemv_launch=lambda role, layer, c: SimpleNamespace(
        grid=(gemv_k.grid_units(tiles[role], 264, c.balanced),)))
    assert CudaBackend.grid_options(fake, "w_gate_up", C(2, 8, 1, 1)) == [C(2, 8, 1, 1, True)]
    assert CudaBackend.grid_options(fake, "w_gate_up", C(2, 8, 1, 1, True)) == [C(2, 8, 1, 1)]
    assert CudaBackend.grid_options(fake, "wo", C(1, 8, 1, 4)) == []       # one round of 256 tiles either way


def test_the_fused_step_retries_the_gemvs_that_read_the_residual(monkeypatch):
    """CudaBackend.fused_reader_options (the tuner's last stage where the MLP is fused): the other grid
    of the chosen configuration where it differs, for the output head also every configuration tied
    with it alone (autotune.TIE) at each depth, for an unsplit o projection the fastest split-K one
    alone at each depth; options that run the same kernel and grid in the fused step
    (gemv.pending_variant) are tried once, the chosen one not at all."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    C = gemv_k.GemvConfig
    shapes = {"wqkv": gemv_k.GemvShape("q4", 64, 2560, 2048, 2048, "rmsnorm", "store"),
              "output": gemv_k.GemvShape("q4", 64, 32000, 2048, 2048, "rmsnorm", "store_argmax"),
              "wo": gemv_k.GemvShape("f16", 0, 2048, 2048, 2048, "plain", "add")}
    slots = {4: 528, 8: 264, 16: 132}          # resident blocks by warps (two per SM at 8)
    fake = SimpleNamespace(
        shapes=shapes,
        tuning_times={"output": {C(2, 4): 17.0, C(2, 8): 17.3, C(2, 16): 17.5, C(1, 8): 18.0}},
        pending_config=lambda role, c: gemv_k.pending_variant(replace(shapes[role], input="rmsnorm_pending"), c))
    fake.pending_shape = lambda role: role
    fake.compute_capability = 90
    built = []
    monkeypatch.setattr(build, "compile_all", lambda modules: built.append(modules))
    monkeypatch.setattr(gemv_k, "GemvModules", lambda items, cc: SimpleNamespace(modules=items))

    def launch(role, layer, c, pending=False):        # the fused step's launch: the grid of its own kernel
        assert pending and built, "the pending variants are built first"
        return SimpleNamespace(grid=(gemv_k.grid_units(
            -(-gemv_k.output_rows(fake.shapes[role]) // (16 * c.row_tiles)), slots[c.warps], c.balanced),))
    fake.gemv_launch = launch
    head = CudaBackend.fused_reader_options(fake, "output", C(2, 4, depth=2))
    assert C(2, 4, depth=2) not in head and len(head) == len(set(head))
    assert {(c.warps, c.depth, c.balanced) for c in head} == {
        (4, 1, False), (4, 1, True), (4, 2, True), (8, 1, False), (8, 1, True), (8, 2, False), (8, 2, True),
        (16, 1, False), (16, 1, True), (16, 2, False), (16, 2, True)}      # R = 1 is 5.9% behind alone: not tied
    # wqkv: 160 tiles at R = 1 fill fewer than 264 slots, so the other grid is the same launch
    assert CudaBackend.fused_reader_options(fake, "wqkv", C(1, 8, depth=4)) == []
    assert CudaBackend.fused_reader_options(fake, "wqkv", C(2, 4, depth=2)) == []
    fake.shapes = {**shapes, "wqkv": replace(shapes["wqkv"], rows=2560 * 4)}   # 640 tiles: two rounds of 528
    assert CudaBackend.fused_reader_options(fake, "wqkv", C(1, 4, depth=4)) == [C(1, 4, depth=4, balanced=True)]
    # wo, unsplit: also the fastest split-K configuration alone, at each depth (64 tiles: one grid)
    fake.tuning_times["wo"] = {C(2, 16): 4.7, C(1, 16): 4.8, C(2, 8, 2): 5.0, C(1, 8, 2): 5.1}
    assert CudaBackend.fused_reader_options(fake, "wo", C(2, 16, depth=2)) == [C(2, 8, 2, depth=1), C(2, 8, 2, depth=2)]
    assert CudaBackend.fused_reader_options(fake, "wo", C(2, 8, 2, depth=2)) == []           # already split


def test_steps_take_the_long_context_graph_from_the_plan_s_position():
    """CudaBackend.graph_at: the tuned one-step graph, else a graph captured once per (long context,
    steps), long once the last step of the launch reaches attn_plan.long_from."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    built = []
    fake = SimpleNamespace(attn_plan=attn_k.AttentionPlan("attention_mma64", False, 1, 256, 8, 512), graph="tuned",
                           graphs={}, step=["short"], tuning={},
                           build_step=lambda tuning, long: built.append(long) or ["long" if long else "short"],
                           capture=lambda launches: tuple(launches))
    fake.is_long_context = lambda pos: CudaBackend.is_long_context(fake, pos)
    graph_at = lambda pos, steps=1: CudaBackend.graph_at(fake, pos, steps)
    assert graph_at(0) == graph_at(511) == "tuned"
    assert graph_at(512) == ("long",)
    assert graph_at(4000) == ("long",) and built == [True]          # captured once
    assert graph_at(100, 4) == graph_at(508, 4) == ("short",) * 4
    assert graph_at(509, 4) == ("long",) * 4                         # its last step is at 512
    fake.attn_plan = attn_k.AttentionPlan("attention_mma64", False, 1, 256)   # no long variant
    assert graph_at(100000) == "tuned"


def test_replay_timing_launches_the_graph_n_times_between_two_events():
    """CudaBackend.replay_us (the step contests and bench's graph time) with a stand-in stream."""
    from types import SimpleNamespace

    from tinyinfer.runtime.cuda_backend import CudaBackend

    log = []
    stream = SimpleNamespace(record=lambda: log.append("event") or SimpleNamespace(synchronize=lambda: log.append("sync")))
    graph = SimpleNamespace(launch=lambda s: log.append("replay"))
    cp = SimpleNamespace(cuda=SimpleNamespace(get_elapsed_time=lambda start, end: 3.0))   # milliseconds
    fake = SimpleNamespace(stream=stream, graph=graph, cp=cp)
    assert CudaBackend.replay_us(fake, 6) == 500.0
    assert log == ["event"] + ["replay"] * 6 + ["event", "sync"]


def test_step_timings_take_fewer_replays_once_a_step_is_long():
    """CudaBackend.step_us: STEP_REPLAYS replays at first, then as many as fit STEP_TIMING_US (at
    least 6): the tuner's load time on a large model is mostly these timings."""
    import contextlib
    from types import SimpleNamespace

    from tinyinfer.runtime import cuda_backend
    from tinyinfer.runtime.cuda_backend import CudaBackend

    asked = []

    class Fake(SimpleNamespace):
        def replay_us(self, n):
            asked.append(n)
            return self.us

    fake = Fake(us=1550.0, last_step_us=None, max_context=4096, stream=contextlib.nullcontext(),
                graph=SimpleNamespace(launch=lambda s: None), use_tuning=lambda t: None,
                set_sampling=lambda p: None, set_state=lambda *a: None)
    assert [CudaBackend.step_us(fake, {}) for _ in range(2)] == [1550.0, 1550.0]
    assert asked == [cuda_backend.STEP_REPLAYS, int(cuda_backend.STEP_TIMING_US / 1550.0)] == [12, 7]
    fake.us = 450.0                                              # TinyLlama: a step of ~450 us
    CudaBackend.step_us(fake, {})
    CudaBackend.step_us(fake, {})
    fake.us = 20_000.0
    CudaBackend.step_us(fake, {})
    CudaBackend.step_us(fake, {})
    CudaBackend.step_us(fake, {}, replays=3)
    assert asked[2:] == [7, 12, 12, 6, 3]


def test_compile_all_loads_cached_modules_in_turn_and_compiles_the_rest_on_threads(monkeypatch):
    """build.compile_all with stand-in modules: fast ones (found in CuPy's cache) load on the calling
    thread; from the first slow one (a compilation) on, the rest go to a pool, on the caller's device."""
    import sys
    import threading
    import time
    from types import SimpleNamespace

    class Device:
        current = threading.local()

        def __init__(self, index=None):
            self.id = 3 if index is None else index

        def __enter__(self):
            Device.current.id = self.id

        def __exit__(self, *exc):
            Device.current.id = None

    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(Device=Device)))
    monkeypatch.setattr(build, "COMPILED_S", 0.05)
    log = []

    class Module:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def compile(self):
            time.sleep(self.seconds)
            log.append((self.name, threading.current_thread() is threading.main_thread(),
                        getattr(Device.current, "id", None)))

    build.compile_all([Module("a", 0), Module("b", 0), Module("c", 0.1), Module("d", 0), Module("e", 0)])
    assert sorted(log) == [("a", True, None), ("b", True, None), ("c", True, None), ("d", False, 3), ("e", False, 3)]
    log.clear()
    build.compile_all([Module("a", 0), Module("b", 0)])            # all cached: no pool
    assert log == [("a", True, None), ("b", True, None)]


def test_the_fused_mlp_is_kept_only_where_it_makes_the_step_faster(monkeypatch):
    """CudaBackend.fusion_contest: every fused configuration against the two GEMVs in the whole step,
    the fastest kept only at autotune.STEP_MARGIN faster, and every timing in step_contests["mlp"];
    mlp_candidates: none where the kernel's clusters do not all fit at two blocks per SM."""
    from types import SimpleNamespace

    from tinyinfer.kernels import build
    from tinyinfer.kernels import mlp as mlp_k
    from tinyinfer.runtime.cuda_backend import CudaBackend

    monkeypatch.setattr(build, "compile_all", lambda modules: None)
    monkeypatch.setattr(mlp_k, "compile_mlp", lambda shape, config, cc: None)
    monkeypatch.setattr(gemv_k, "GemvModules", lambda items, cc: SimpleNamespace(modules=[]))
    best = {role: gemv_k.GemvConfig(1, 8) for role in ("wqkv", "wo", "w_gate_up", "w_down", "output")}
    fast, slow = mlp_k.MlpConfig(8, 1, 2), mlp_k.MlpConfig(8, 4, 1)

    def backend(fused_us):
        fake = SimpleNamespace(compute_capability=90, step_contests={}, mlp_shape=lambda: "shape",
                               mlp_candidates=lambda: [slow, fast], pending_shape=lambda role: role,
                               pending_config=lambda role, config: config)
        fake.step_us = lambda tuning: {None: 430.0, slow: 445.0, fast: fused_us}[tuning.get("mlp")]
        return fake

    won = backend(410.0)
    assert CudaBackend.fusion_contest(won, best) == {**best, "mlp": fast}
    assert won.step_contests["mlp"] == {None: 430.0, slow: 445.0, fast: 410.0}
    assert CudaBackend.fusion_contest(backend(429.0), best) == best       # within STEP_MARGIN: not worth it

    def candidates(ffn):
        gate_up = gemv_k.GemvShape("q4", 64, 2 * ffn, 2048, 2048, "rmsnorm", "swiglu")
        down = gemv_k.GemvShape("q4", 64, 2048, ffn, ffn, "plain", "add")
        fake = SimpleNamespace(n_sms=132, mlp_shape=lambda: mlp_k.MlpShape(gate_up, down))
        return CudaBackend.mlp_candidates(fake)

    assert candidates(5632) == list(mlp_k.CANDIDATES)        # TinyLlama: 22 clusters of 8, 176 blocks
    assert candidates(11008) == []                           # Llama-2-7B's FFN: 43 clusters, 344 blocks


def test_gemvs_reading_the_pending_sums_run_shallower_rings_where_they_would_spill():
    """gemv.pending_variant: the q4/q8 GEMVs that read the fused MLP's fixed-point residual keep
    rings nvcc does not spill (tests/test_cuda_compile.py checks the machine code); f16 and other
    configurations run as tuned."""
    C = gemv_k.GemvConfig
    norm = gemv_k.GemvShape("q4", 64, 2560, 2048, 2048, "rmsnorm_pending", "store")
    fold = gemv_k.GemvShape("q4", 64, 2048, 2048, 2048, "plain", "add_pending")
    assert gemv_k.pending_variant(norm, C(1, 8, depth=4)) == C(1, 8, depth=3)
    assert gemv_k.pending_variant(norm, C(1, 8, depth=4, refill=True)) == C(1, 8, depth=4, refill=True)
    assert gemv_k.pending_variant(norm, C(2, 16, depth=2)) == C(2, 16, depth=2)
    assert gemv_k.pending_variant(norm, C(1, 8, depth=2)) == C(1, 8, depth=2)
    assert gemv_k.pending_variant(fold, C(2, 8, 2, depth=2, refill=True)) == C(2, 8, 2, depth=2)
    assert gemv_k.pending_variant(fold, C(1, 8, 2, depth=4, refill=True)) == C(1, 8, 2, depth=4, refill=True)
    f16 = gemv_k.GemvShape("f16", 0, 2560, 2048, 2048, "rmsnorm_pending", "store")
    assert gemv_k.pending_variant(f16, C(2, 16, depth=2, refill=True)) == C(2, 16, depth=2, refill=True)
    q8 = gemv_k.GemvShape("q8", 64, 2048, 2048, 2048, "plain", "add_pending")
    for config in gemv_k.all_configs(gemv_k.GemvShape("q8", 64, 2048, 2048, 2048, "plain", "add"), 90):
        assert gemv_k.can_refill(q8, gemv_k.pending_variant(q8, config)) or not gemv_k.pending_variant(q8, config).refill