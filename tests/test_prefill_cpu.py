"""The prefill path's logic without a GPU: chunking, chunk sizing, and the whole chunked step list run
with the kernels' NumPy references (same tiles, masks and fp16 rounding points as the CUDA kernels)
against the NumPy reference backend.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.kernels import prefill as prefill_k
from tinyinfer.runtime import cuda_prefill
from tinyinfer.runtime.cuda_backend import block_linears
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import random_encoded, write_random_model
from tinyinfer.runtime.numpy_backend import NumpyBackend

MAX_ERROR = 2e-3
CONFIG = {"architecture": "llama", "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
          "ffn_dim": 384, "vocab_size": 96, "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
          "max_context": 256, "tied_embeddings": False}
# Qwen2's Q/K/V biases with a sliding window shorter than a query tile: 150 tokens cross it many times.
BIASED_WINDOWED = {**CONFIG, "qkv_bias": True, "sliding_window": 40}


def relative_errors(ours, theirs) -> np.ndarray:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def check_argmax(ours, theirs) -> None:
    """At every position our argmax is the reference's, or the other side of a near tie (prefill_k.near_ties)."""
    assert prefill_k.near_ties(theirs).mean() <= 0.1, "too many near ties for the argmax check to mean anything"
    assert (prefill_k.argmax_shortfall(theirs, ours.argmax(-1)) <= prefill_k.NEAR_TIE).all()


# ------------------------------------------------------------------------------------- chunking

@pytest.mark.parametrize("n, chunk", [(1, 64), (64, 64), (65, 64), (511, 128), (2048, 700), (17, 5)])
def test_chunk_spans_cover_the_prompt_in_order(n, chunk):
    spans = cuda_prefill.chunk_spans(n, chunk)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(0 < end - begin <= chunk for begin, end in spans)
    assert len(spans) == math.ceil(n / chunk)


def test_chunk_spans_reject_an_empty_chunk():
    with pytest.raises(ValueError):
        cuda_prefill.chunk_spans(10, 0)


def test_chunk_size_fits_the_memory_share():
    per_token = cuda_prefill.bytes_per_token(CONFIG)
    scratch = 10 << 20
    assert cuda_prefill.choose_chunk(CONFIG, 80 << 30, scratch) == cuda_prefill.MAX_CHUNK
    small = cuda_prefill.choose_chunk(CONFIG, 4 * (scratch + 300 * per_token), scratch)
    assert small == 256                                  # 300 tokens fit, rounded down to the 64-row tile
    assert cuda_prefill.choose_chunk(CONFIG, 4 * scratch, scratch) == 0
    assert cuda_prefill.choose_chunk(CONFIG, 80 << 30, scratch, max_chunk=512) == 512


def test_supported_head_sizes():
    assert cuda_prefill.supported(dict(CONFIG, head_dim=128))
    assert not cuda_prefill.supported(dict(CONFIG, head_dim=48))
    assert not cuda_prefill.supported(dict(CONFIG, head_dim=256))


# ---------------------------------------------------------------------------- kernel references

@pytest.mark.parametrize("encoding", ["q4", "q8"])
def test_dequant_reference_rounds_the_file_dequantization_once(encoding):
    tensor = random_encoded(encoding, (40, 100), 32, np.random.default_rng(0), std=0.1)
    out = prefill_k.dequant_reference(tensor)
    assert out.dtype == np.float16 and out.shape == (40, 128)
    assert np.array_equal(out[:, :100], tensor.to_float32().astype(np.float16))
    assert not out[:, 100:].any()


@pytest.mark.parametrize("window", [None, 7, 64])
def test_causal_attention_is_the_reference_attention(window):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((70, 8, 32)).astype(np.float32)
    k = rng.standard_normal((100, 2, 32)).astype(np.float32)
    v = rng.standard_normal((100, 2, 32)).astype(np.float32)
    positions = np.arange(25, 95)
    fast = prefill_k.causal_attention(q, k, v, positions, window, block=16)
    assert np.allclose(fast, ref.attention(q, k, v, positions, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("start, n_tokens, window", [(0, 1, None), (0, 64, None), (0, 150, None), (37, 100, None),
                                                     (130, 5, None), (0, 150, 5), (0, 150, 64), (37, 100, 100),
                                                     (130, 70, 16), (200, 3, 65), (0, 20, 300)])
def test_tiled_attention_matches_the_reference(start, n_tokens, window):
    """The kernel's tile walk (query tiles of 64, key tiles of 64, causal mask, online softmax in
    base 2, P in fp16) gives the reference attention, for tiles that straddle start and the diagonal,
    and with sliding windows shorter than, equal to and longer than a tile."""
    rng = np.random.default_rng(start + n_tokens)
    n_heads, n_kv, hd = 8, 2, 64
    last = start + n_tokens
    k = rng.standard_normal((last + 3, n_kv, hd)).astype(np.float16)
    v = rng.standard_normal((last + 3, n_kv, hd)).astype(np.float16)
    k[last:] = v[last:] = np.float16(np.inf)          # positions after the chunk must never be read
    if window:                                         # nor those before the first query's window
        first = max(0, start - window + 1) // prefill_k.TILE_K * prefill_k.TILE_K
        k[:first] = v[:first] = np.float16(np.inf)
    q = rng.standard_normal((n_tokens, n_heads, hd)).astype(np.float32)
    scale = prefill_k.LOG2E / math.sqrt(hd)
    q16 = (q * np.float32(scale)).astype(np.float16)
    got = prefill_k.attention_reference(np.ascontiguousarray(q16.transpose(1, 0, 2)), k, v, start, window)
    positions = np.arange(start, last)
    finite = lambda x: np.where(np.isinf(x), 0, x).astype(np.float32)     # masked rows: any finite value
    expected = ref.attention(q16.astype(np.float32) / np.float32(scale), finite(k[:last]), finite(v[:last]),
                             positions, window)
    assert np.isfinite(got).all()
    assert relative_errors(got, expected).max() <= MAX_ERROR


@pytest.mark.parametrize("biased", [False, True])
def test_rope_store_reference_matches_the_reference_rope(biased):
    rng = np.random.default_rng(2)
    n_heads, n_kv, hd, start = 4, 2, 64, 9
    raw = rng.standard_normal((5, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    bias = rng.standard_normal(raw.shape[1]).astype(np.float32) if biased else None
    qkv = raw + bias if biased else raw        # what the reference rotates: the biased projection
    cos, sin = ref.rope_tables(hd, 32, 10000.0, None)
    q, k, v = prefill_k.rope_store_reference(raw, start, n_heads, n_kv, hd, cos, sin, bias)
    positions = np.arange(start, start + 5)
    q_ref = ref.apply_rope(qkv[:, : n_heads * hd].reshape(5, n_heads, hd), positions, cos, sin)
    assert q.shape == (n_heads, 5, hd)
    assert np.allclose(q.transpose(1, 0, 2).astype(np.float32), q_ref * (prefill_k.LOG2E / 8), rtol=2e-3, atol=1e-3)
    k_ref = ref.apply_rope(qkv[:, n_heads * hd: (n_heads + n_kv) * hd].reshape(5, n_kv, hd), positions, cos, sin)
    assert np.array_equal(k, k_ref.astype(np.float16))
    assert np.array_equal(v, qkv[:, (n_heads + n_kv) * hd:].reshape(5, n_kv, hd).astype(np.float16))


# --------------------------------------------------------------------------- the whole step list

@pytest.fixture(scope="module", params=["q4", "q8", "f16", "q8-biased-windowed"])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / f"random-{request.param}.tinf"
    quant = request.param.split("-")[0]
    return write_random_model(path, BIASED_WINDOWED if "biased" in request.param else CONFIG, quant, 32, seed=5)


def reference_run(path, ids):
    backend = NumpyBackend(open_tinf(path), max_context=CONFIG["max_context"])
    logits = backend.forward(ids, 0)
    return logits, backend.k_cache[:, : ids.size], backend.v_cache[:, : ids.size]


@pytest.mark.parametrize("chunk", [64, 45, 256])
def test_chunked_prefill_matches_the_reference_backend(model_path, chunk):
    ids = np.random.default_rng(3).integers(0, CONFIG["vocab_size"], 150)
    expected, k_ref, v_ref = reference_run(model_path, ids)
    ops = cuda_prefill.NumpyOps(open_tinf(model_path))
    logits = cuda_prefill.run_prefill(ops, ops.config, ids, 0, chunk, "all")
    errors = relative_errors(logits, expected)
    assert errors.max() <= MAX_ERROR, f"max relative error {errors.max():.2e}"
    check_argmax(logits, expected)
    for ours, theirs in ((ops.k_cache[:, :150], k_ref), (ops.v_cache[:, :150], v_ref)):
        hd = CONFIG["head_dim"]
        assert relative_errors(ours.reshape(-1, hd), theirs.reshape(-1, hd)).max() <= MAX_ERROR


def test_prefill_continues_from_a_filled_cache(model_path):
    """A second prefill at start_pos > 0 (the next chat turn) sees the first one's K/V."""
    ids = np.random.default_rng(4).integers(0, CONFIG["vocab_size"], 120)
    expected, _, _ = reference_run(model_path, ids)
    ops = cuda_prefill.NumpyOps(open_tinf(model_path))
    first = cuda_prefill.run_prefill(ops, ops.config, ids[:70], 0, 64, "last")
    rest = cuda_prefill.run_prefill(ops, ops.config, ids[70:], 70, 64, "all")
    assert first.shape == (1, CONFIG["vocab_size"])
    assert relative_errors(first, expected[69:70]).max() <= MAX_ERROR
    assert relative_errors(rest, expected[70:]).max() <= MAX_ERROR
    assert cuda_prefill.run_prefill(ops, ops.config, ids[:20], 0, 64, None) is None


# -------------------------------------------------------- CudaOps' plumbing on a NumPy "device"

def host_array(ptr: int, dtype, count: int) -> np.ndarray:
    """A writable NumPy view of `count` items at a raw address (the fake device's memory is host memory)."""
    import ctypes

    return np.frombuffer((ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr), dtype=dtype)


class DeviceArray(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` (its host address)."""

    @property
    def data(self):
        import types

        return types.SimpleNamespace(ptr=self.ctypes.data)


def device_empty(shape, dtype=np.float32) -> DeviceArray:
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype=dtype).view(DeviceArray)


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class FakeBackend:
    """What CudaOps reads from a CudaBackend, with NumPy arrays standing in for CuPy ones."""

    def __init__(self, tinf, max_context: int):
        import types

        c = self.config = tinf.config
        self.tinf, self.compute_capability, self.stream = tinf, 75, FakeStream()
        self.cp = types.SimpleNamespace(empty=device_empty, float32=np.float32, float16=np.float16, int32=np.int32,
                                        copyto=np.copyto)
        extent = max(info.offset + info.nbytes for info in tinf.infos.values())
        self.weights = np.array(tinf.memmap[tinf.data_offset: tinf.data_offset + extent]).view(DeviceArray)
        block_linears(tinf, self.view, np)          # as the CUDA backend holds them
        shape = (c["n_layers"], max_context, c["n_kv_heads"], c["head_dim"])
        self.k_cache, self.v_cache = device_empty(shape, np.float16), device_empty(shape, np.float16)
        self.rope_cos, self.rope_sin = ref.rope_tables(c["head_dim"], max_context, c["rope_theta"], None)

    def view(self, name):
        info = self.tinf.info(name)
        return self.weights[info.offset: info.offset + info.nbytes]

    def f32_view(self, name):
        return self.view(name).view(np.float32)

    def upload(self, device_array, host, offset_bytes=0):
        raw = np.ascontiguousarray(host).view(np.uint8)
        device_array.view(np.uint8)[offset_bytes: offset_bytes + raw.size] = raw

    def check_room(self, last):
        assert last < self.k_cache.shape[1]


def fake_launches(monkeypatch):
    """Replace each launch wrapper by its reference, reading operands through the raw pointers and
    strides CudaOps passes (so a wrong offset, stride or buffer shows up as a wrong result)."""
    def embed_rows(mod, table, encoding_id, cols_pad, dim_, ids, x):
        assert encoding_id == 1
        x[...] = table.view(np.float16).reshape(-1, cols_pad)[ids, :dim_]

    def rmsnorm_rows(mod, x, weight, rows, dim_, eps, out):
        out[...] = prefill_k.rmsnorm_reference(x[:rows], weight[:dim_], eps)

    def swiglu_rows(mod, gate_up, rows, ffn, out):
        out[...] = prefill_k.swiglu_reference(gate_up.reshape(rows, 2 * ffn))

    def dequant(mod, encoding, weight_ptr, scale_ptr, rows, cols_pad, group, blocked, out):
        width = layout.row_bytes(encoding, cols_pad)
        values = host_array(weight_ptr, np.uint8, rows * width)
        scales = host_array(scale_ptr, np.float16, rows * cols_pad // group)
        if blocked:                     # back to row-major (kernels/layout.py)
            shape = gemv_k.GemvShape(encoding, group, rows, cols_pad, cols_pad)
            values, row_major = np.empty_like(values), values
            layout.unblock_values(row_major, shape, values)
            scales = scales.reshape(rows // 8, -1, 8).transpose(0, 2, 1)
        if encoding == "q4":
            packed = values.reshape(rows, -1)
            q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, cols_pad).astype(np.float32) - 8
        else:
            q = values.view(np.int8).reshape(rows, cols_pad).astype(np.float32)
        scales = scales.reshape(rows, -1).astype(np.float32)
        out[: rows * cols_pad] = (q * np.repeat(scales, group, axis=1)).astype(np.float16).ravel()

    def rope_store(mod, qkv, n, start, n_heads, n_kv, hd, cos, sin, q_out, k_cache, v_cache, bias=None):
        q, k, v = prefill_k.rope_store_reference(qkv.reshape(n, -1), start, n_heads, n_kv, hd, cos, sin,
                                                 None if bias is None else bias[: qkv.shape[1]])
        q_out[...] = q
        k_cache[start: start + n], v_cache[start: start + n] = k, v

    def attention(mod, q, k_cache, v_cache, n, start, n_heads, n_kv, hd, out, window=None):
        out[...] = prefill_k.attention_reference(q, k_cache, v_cache, start, window)

    def gemm(weight_ptr, n_out, k, ld_weight, x_ptr, n_tokens, ld_x, y_ptr, ld_y, accumulate, stream):
        w = host_array(weight_ptr, np.float16, n_out * ld_weight).reshape(n_out, ld_weight)[:, :k]
        x = host_array(x_ptr, np.float16, n_tokens * ld_x).reshape(n_tokens, ld_x)[:, :k]
        y = host_array(y_ptr, np.float32, n_tokens * ld_y).reshape(n_tokens, ld_y)[:, :n_out]
        product = x.astype(np.float32) @ w.astype(np.float32).T
        y[...] = y + product if accumulate else product

    for name, fn in [("embed_rows", embed_rows), ("rmsnorm_rows", rmsnorm_rows), ("swiglu_rows", swiglu_rows),
                     ("dequant", dequant), ("rope_store", rope_store), ("attention", attention), ("gemm", gemm)]:
        monkeypatch.setattr(prefill_k, name, fn)
    monkeypatch.setattr(prefill_k, "compile_prefill", lambda cc, hd: None)


def test_cuda_ops_pass_the_right_buffers_pointers_and_strides(model_path, monkeypatch):
    """CudaOps on a fake device whose kernels are the references: the same logits and cache as NumpyOps."""
    fake_launches(monkeypatch)
    tinf = open_tinf(model_path)
    backend = FakeBackend(tinf, CONFIG["max_context"])
    prefill = cuda_prefill.Prefill(backend, chunk=64)
    ids = np.random.default_rng(6).integers(0, CONFIG["vocab_size"], 150)
    got_all = prefill.run(ids[:100], 0, "all")
    got_last = prefill.run(ids[100:], 100, "last")
    ops = cuda_prefill.NumpyOps(tinf)
    expected_all = cuda_prefill.run_prefill(ops, ops.config, ids[:100], 0, 64, "all")
    expected_last = cuda_prefill.run_prefill(ops, ops.config, ids[100:], 100, 64, "last")
    assert np.isfinite(got_all).all() and np.isfinite(got_last).all()
    assert np.allclose(got_all, expected_all, rtol=1e-5, atol=1e-5)
    assert np.allclose(got_last, expected_last, rtol=1e-5, atol=1e-5)
    assert np.array_equal(backend.k_cache[:, :150], ops.k_cache[:, :150])
    assert np.array_equal(backend.v_cache[:, :150], ops.v_cache[:, :150])


def test_prefill_report_lines():
    report = {"available": True, "chunk": 2048, "pp512": 74423.6, "pp512_ms": 6.88, "ttft512_ms": 7.46,
              "pp2048": 135792.3, "pp2048_ms": 15.08, "ttft2048_ms": 16.11,
              "short_prompts_ms": {16: {"prefill": 7.229, "decode_graph": 12.106}}}
    text = cuda_prefill.format_prefill(report)
    assert "pp512 74424 tok/s (6.9 ms), pp2048 135792 tok/s (15.1 ms)" in text
    assert "2048-token prompt 16.1 ms" in text and "16: 7.23 vs 12.11 ms" in text
    assert "not available" in cuda_prefill.format_prefill({"available": False})


def test_argmax_shortfall_tells_near_ties_from_wrong_tokens():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 1000)).astype(np.float32)
    rms = prefill_k.logit_rms(logits)
    best, second = logits.argmax(-1), np.argsort(logits, -1)[:, -2]
    logits[0, second[0]] = logits[0, best[0]] - 1e-3 * rms[0]       # a near tie at position 0 only
    ties = prefill_k.near_ties(logits)
    assert ties.tolist() == [True, False, False, False]
    assert (prefill_k.argmax_shortfall(logits, best) == 0).all()
    shortfall = prefill_k.argmax_shortfall(logits, second)
    assert shortfall[0] <= prefill_k.NEAR_TIE and (shortfall[1:] > prefill_k.NEAR_TIE).all()
