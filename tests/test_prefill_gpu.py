"""The CUDA prefill path against the NumPy reference and against the token-by-token decode graph.

Random 2-layer models with the real TinyLlama-1.1B and Llama-2-7B layer shapes, in q4, q8 and f16,
a 2048-position context. One 2048-token sequence per model is run once through the NumPy reference
(its attention computed with matrix products: prefill_k.causal_attention, checked against
reference.attention in test_prefill_cpu.py) and once through the decode graph; causality makes the
first L rows of those the answers for every prompt length L. Logits: ||ours - ref|| / ||ref|| <= 2e-3
at every position, and at every position our argmax is the reference's or the other side of a near
tie (top two within 0.5% of the logits' rms: prefill_k.near_ties). KV cache after prefill: the same
bound against the decode graph's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.kernels import prefill as prefill_k
from tinyinfer.runtime import cuda_prefill, load
from tinyinfer.runtime import reference as ref
from tinyinfer.convert.pipeline import DEFAULT_GROUP
from tinyinfer.runtime.bench import tinf_config, write_random_model
from tinyinfer.runtime.numpy_backend import NumpyBackend
from tinyinfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
MAX_ERROR = 2e-3
CONTEXT = 2048
LENGTHS = (1, 17, 64, 511, 2048)
CONFIG_FILES = {"tinyllama": "tinyllama-1.1b-chat-v1.0/config.json", "llama-2-7b": "llama-2-7b-hf/config.json"}


def relative_errors(ours, theirs) -> np.ndarray:
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def assert_close(ours, theirs, what: str) -> None:
    errors = relative_errors(ours, theirs)
    ties = prefill_k.near_ties(theirs)
    shortfall = prefill_k.argmax_shortfall(theirs, ours.argmax(-1))
    flips = np.nonzero(shortfall > 0)[0]
    print(f"{what}: max relative error {errors.max():.2e} (mean {errors.mean():.2e}), {ties.sum()} near ties of "
          f"{len(ties)}, argmax flips at {len(flips)} (shortfall {np.round(shortfall[flips] * 1e3, 3)} x 1e-3 rms)")
    assert np.isfinite(ours).all(), f"{what}: non-finite values"
    assert errors.max() <= MAX_ERROR, f"{what}: relative error {errors.max():.2e} at position {errors.argmax()}"
    if len(ties) >= 64:
        assert ties.mean() <= 0.1, f"{what}: too many near ties for the argmax check"
    wrong = np.nonzero(shortfall > prefill_k.NEAR_TIE)[0]
    assert wrong.size == 0, f"{what}: argmax differs beyond a near tie at positions {wrong[:10]}"


def fast_reference(path, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumpyBackend.forward over ids, with reference.attention evaluated by matrix products."""
    backend = NumpyBackend(open_tinf(path), max_context=CONTEXT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ref, "attention", prefill_k.causal_attention)
        logits = backend.forward(ids, 0)
    return logits, backend.k_cache[:, : ids.size].copy(), backend.v_cache[:, : ids.size].copy()


def cache_snapshot(backend, n: int) -> tuple[np.ndarray, np.ndarray]:
    backend.stream.synchronize()
    return backend.k_cache[:, :n].get().astype(np.float32), backend.v_cache[:, :n].get().astype(np.float32)


def token_path(backend, ids) -> np.ndarray:
    """Logits of every position through the decode graph, one replay per token."""
    cp = backend.cp
    with backend.stream:
        out = cp.empty((ids.size, backend.vocab), dtype=cp.float32)
        backend.run_steps(ids, 0, out)
        result = out.get(stream=backend.stream)
    backend.stream.synchronize()
    return result


def prefill_logits(prefill, ids, start: int = 0) -> np.ndarray:
    out = prefill.run(ids, start, "all").get(stream=prefill.backend.stream)
    prefill.backend.stream.synchronize()
    return out


@pytest.mark.parametrize("head_dim, n_heads, n_kv", [(64, 32, 4), (128, 32, 32), (96, 12, 3), (80, 8, 8)])
@pytest.mark.parametrize("start, n_tokens", [(0, 1), (0, 200), (100, 77), (37, 300)])
def test_attention_kernel_matches_its_reference(cupy_gpu, head_dim, n_heads, n_kv, start, n_tokens):
    """attention_prefill against prefill_k.attention_reference (the same tiles and roundings) on random
    fp16 inputs: chunks that start at 0 or after cached positions, partial tiles, GQA and MHA."""
    cp = cupy_gpu
    from tinyinfer.kernels.build import device_compute_capability

    rng = np.random.default_rng(head_dim * 1000 + start + n_tokens)
    ctx = start + n_tokens
    q = (0.5 * rng.standard_normal((n_heads, n_tokens, head_dim))).astype(np.float16)
    k = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float16)
    v = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float16)
    mod = prefill_k.compile_prefill(device_compute_capability(), head_dim)
    out = cp.full((n_tokens, n_heads * head_dim), np.nan, dtype=cp.float16)
    prefill_k.attention(mod, cp.asarray(q), cp.asarray(k), cp.asarray(v), n_tokens, start, n_heads, n_kv, head_dim,
                        out)
    got = out.get().astype(np.float32)
    expected = prefill_k.attention_reference(q, k, v, start).astype(np.float32)
    errors = relative_errors(got, expected)
    assert np.isfinite(got).all(), "unwritten or non-finite outputs"
    assert errors.max() <= 1e-3, f"relative error {errors.max():.2e} at query {errors.argmax()}"


@pytest.fixture(scope="module", params=[(s, q) for s in CONFIG_FILES for q in ("q4", "q8", "f16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory, shared_assets, cupy_gpu):
    shape, quant = request.param
    config = tinf_config(json.loads((shared_assets / CONFIG_FILES[shape]).read_text()), n_layers=2)
    config["max_context"] = CONTEXT
    path = write_random_model(tmp_path_factory.mktemp("prefill") / f"{shape}-{quant}.tinf", config, quant, DEFAULT_GROUP[quant],
                              seed=len(shape) * 3 + len(quant))
    ids = np.random.default_rng(len(quant)).integers(0, config["vocab_size"], CONTEXT)
    expected, k_ref, v_ref = fast_reference(path, ids)
    model = load(path, device="cuda")
    backend = model.backend
    tokens = token_path(backend, ids)
    k_tok, v_tok = cache_snapshot(backend, CONTEXT)
    yield {"name": f"{shape}-{quant}", "model": model, "backend": backend, "ids": ids, "reference": expected,
           "tokens": tokens, "k_tok": k_tok, "v_tok": v_tok, "k_ref": k_ref, "v_ref": v_ref}
    model.close()


def test_token_path_matches_the_reference(case):
    """The oracle pair agrees (so a prefill failure below is the prefill's)."""
    assert_close(case["tokens"], case["reference"], f"{case['name']} decode graph vs reference")


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logits_match_the_reference_and_the_token_path(case, length):
    prefill = cuda_prefill.Prefill(case["backend"])
    assert prefill.chunk >= 64
    logits = prefill_logits(prefill, case["ids"][:length])
    assert logits.shape == (length, case["backend"].vocab)
    assert_close(logits, case["reference"][:length], f"{case['name']} prefill {length} vs reference")
    assert_close(logits, case["tokens"][:length], f"{case['name']} prefill {length} vs decode graph")


@pytest.mark.parametrize("length, chunk", [(1000, 300), (511, 100), (64, 17), (17, 16)])
def test_uneven_chunks(case, length, chunk):
    logits = prefill_logits(cuda_prefill.Prefill(case["backend"], chunk), case["ids"][:length])
    assert_close(logits, case["reference"][:length], f"{case['name']} prefill {length} in chunks of {chunk}")


def test_kv_cache_after_prefill_matches_the_token_path(case):
    backend = case["backend"]
    for cache in (backend.k_cache, backend.v_cache):
        cache.fill(np.nan)                               # every position must be written again
    cuda_prefill.Prefill(backend, 700).run(case["ids"], 0, None)
    k, v = cache_snapshot(backend, CONTEXT)
    hd = backend.head_dim
    for ours, tokens, reference, what in ((k, case["k_tok"], case["k_ref"], "K"),
                                          (v, case["v_tok"], case["v_ref"], "V")):
        assert np.isfinite(ours).all(), f"{what} cache has unwritten positions"
        vs_tokens = relative_errors(ours.reshape(-1, hd), tokens.reshape(-1, hd)).max()
        vs_reference = relative_errors(ours.reshape(-1, hd), reference.reshape(-1, hd)).max()
        print(f"{case['name']} {what} cache: max relative error {vs_tokens:.2e} vs decode graph, "
              f"{vs_reference:.2e} vs reference")
        assert vs_tokens <= MAX_ERROR and vs_reference <= MAX_ERROR


def test_prefill_continues_a_cached_conversation(case):
    """A second prefill at start_pos 300 (the next chat turn) reads the first one's K/V."""
    prefill = cuda_prefill.Prefill(case["backend"])
    ids = case["ids"]
    prefill.run(ids[:300], 0, None)
    later = prefill_logits(prefill, ids[300:700], 300)
    assert_close(later, case["reference"][300:700], f"{case['name']} prefill 300..700 after 0..300")


def test_generation_after_a_long_prompt_matches_the_reference(case):
    """generate_ids prefills a long prompt, then decodes: each greedy token is the reference's argmax or
    the other side of a near tie (teacher-forced on the tokens produced, so one tie cannot derail the rest)."""
    if not case["name"].endswith("q4"):
        pytest.skip("one encoding is enough for the generate path")
    backend, ids = case["backend"], case["ids"][:100]
    backend._prefill = None
    gpu = list(backend.generate_ids(ids, 0, SamplingParams(), 8, np.random.default_rng(0)))
    assert getattr(backend, "_prefill", None) is not None, "the prompt did not go through the prefill path"
    reference = NumpyBackend(open_tinf(case["model"].tinf.path), max_context=CONTEXT)
    logits = reference.forward(np.concatenate([ids, gpu[:-1]]), 0)[ids.size - 1:]
    assert (prefill_k.argmax_shortfall(logits, np.asarray(gpu)) <= prefill_k.NEAR_TIE).all()
