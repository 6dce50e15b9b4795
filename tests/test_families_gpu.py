"""Qwen2.5, Mistral and Llama 3.2 on the GPU: decode graph and prefill against the NumPy reference,
and against transformers.

Random models have the real layer shapes of Qwen2.5-0.5B-Instruct (896 hidden, 14 query heads over 2
KV heads of 64, FFN 4864, 151,936 embeddings, theta 1e6, tied, Q/K/V biases), Mistral-7B-v0.1
(4096 hidden, 32 over 8 heads of 128, FFN 14336, vocabulary 32,000, theta 1e4) and Llama-3.2-1B
(2048 hidden, 32 over 8 heads of 64, FFN 8192, vocabulary 128,256, theta 500000 with llama3 scaling
factor 32, band 1..4 of 8192, tied) but only 2 layers (the real models have 24, 32 and 16): the
kernels see the real shapes and the NumPy reference stays fast. Mistral's window is 64 here, not
4096, so that a few hundred positions cross it many times in the decode attention (its one-block,
cluster and later-pass paths) and in prefill (chunks of 128 that start past the window).

Logits: ||gpu - ref|| / ||ref|| <= 1e-3 at every position, and the argmax equal to the reference's
or the other side of a near tie (prefill_k.NEAR_TIE).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.kernels import prefill as prefill_k
from tinyinfer.runtime import cuda_prefill, load
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import tinf_config, write_random_model
from tinyinfer.runtime.numpy_backend import NumpyBackend

pytestmark = pytest.mark.gpu
MAX_ERROR = 1e-3
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
REAL = {   # config.json values of the real models (2 layers here, see above)
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768},
    "mistral-7b-window64": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                            "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                            "rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": 64},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": LLAMA32_ROPE, "tie_word_embeddings": True},
}
POSITIONS = {"qwen2.5-0.5b": 96, "mistral-7b-window64": 400, "llama-3.2-1b": 96}
CONTEXT = 512


def relative_errors(ours, theirs) -> np.ndarray:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def assert_close(ours, theirs, what: str) -> None:
    errors = relative_errors(ours, theirs)
    shortfall = prefill_k.argmax_shortfall(theirs, ours.argmax(-1))
    print(f"{what}: max abs error {np.abs(ours - theirs).max():.2e}, max relative error {errors.max():.2e}, "
          f"argmax agrees at {np.mean(shortfall == 0):.1%} ({np.sum(prefill_k.near_ties(theirs))} near ties)")
    assert np.isfinite(ours).all(), f"{what}: non-finite values"
    assert errors.max() <= MAX_ERROR, f"{what}: relative error {errors.max():.2e} at position {errors.argmax()}"
    assert (shortfall <= prefill_k.NEAR_TIE).all(), f"{what}: argmax differs beyond a near tie"


def real_config(name: str) -> dict:
    config = tinf_config(REAL[name], n_layers=2)
    config["max_context"] = CONTEXT
    return config


def reference_run(path, ids):
    """NumpyBackend.forward (reference.attention by matrix products: prefill_k.causal_attention) and its cache."""
    backend = NumpyBackend(open_tinf(path), max_context=CONTEXT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ref, "attention", prefill_k.causal_attention)
        logits = backend.forward(ids, 0)
    return logits, backend.k_cache[:, : ids.size].copy(), backend.v_cache[:, : ids.size].copy()


@pytest.fixture(scope="module", params=[(n, q) for n in REAL for q in ("q4", "q8", "f16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory, cupy_gpu):
    name, quant = request.param
    config = real_config(name)
    assert config["qkv_bias"] == (name.startswith("qwen")) and config["sliding_window"] == (
        64 if name.startswith("mistral") else None)
    path = write_random_model(tmp_path_factory.mktemp("families") / f"{name}-{quant}.tinf", config, quant, 64,
                              seed=len(name) + len(quant))
    ids = np.random.default_rng(len(quant)).integers(0, config["vocab_size"], POSITIONS[name])
    logits, k_ref, v_ref = reference_run(path, ids)
    model = load(path, device="cuda")
    yield {"name": f"{name}-{quant}", "config": config, "model": model, "backend": model.backend, "ids": ids,
           "reference": logits, "k_ref": k_ref, "v_ref": v_ref}
    model.close()


def test_decode_graph_matches_the_reference(case):
    """One graph replay per token from position 0: the qkv GEMV's bias epilogue, the attention kernel
    over every position (Mistral: past its window, with the long-context step from its switch on)."""
    backend = case["backend"]
    gpu = backend.decode_forward(case["ids"], 0)
    plan = backend.attn_plan
    print(f"{case['name']}: attention {plan.kernel}, {plan.long_slices} blocks per KV head from {plan.long_from}")
    assert_close(gpu, case["reference"], f"{case['name']} decode graph")


def test_prefill_matches_the_reference(case):
    """Prefill in chunks of 128 (so the later chunks start past Mistral's window) and in one chunk:
    the bias added in rope_store, the window in the attention kernel; the KV cache it leaves."""
    backend, ids = case["backend"], case["ids"]
    for chunk in (128, 512):
        for cache in (backend.k_cache, backend.v_cache):
            cache.fill(np.nan)                           # every position must be written again
        prefill = cuda_prefill.Prefill(backend, chunk)
        logits = prefill.run(ids, 0, "all").get(stream=backend.stream)
        backend.stream.synchronize()
        assert_close(logits, case["reference"], f"{case['name']} prefill in chunks of {chunk}")
        hd = backend.head_dim
        for cache, expected, what in ((backend.k_cache, case["k_ref"], "K"), (backend.v_cache, case["v_ref"], "V")):
            got = cache[:, : ids.size].get().astype(np.float32)
            assert np.isfinite(got).all(), f"{what} cache has unwritten positions"
            assert relative_errors(got.reshape(-1, hd), expected.reshape(-1, hd)).max() <= MAX_ERROR, what


def test_decode_continues_after_a_prefill(case):
    """Prefill the first positions, then decode the rest through the graph: the decode attention reads
    the prefill's cache (Mistral: the window slides over rows the prefill wrote)."""
    backend, ids = case["backend"], case["ids"]
    split = ids.size // 3
    cuda_prefill.Prefill(backend, 128).run(ids[:split], 0, None)
    later = backend.decode_forward(ids[split:], split)
    assert_close(later, case["reference"][split:], f"{case['name']} decode after a prefill of {split}")


# ---------------------------------------------------------------------------------- prefill kernels

@pytest.mark.parametrize("head_dim, n_heads, n_kv", [(64, 14, 2), (128, 32, 8)])
@pytest.mark.parametrize("start, n_tokens, window", [(0, 200, 64), (0, 300, 1), (100, 77, 16), (37, 300, 100),
                                                     (200, 64, 64), (300, 5, 130), (0, 130, 4096)])
def test_prefill_attention_kernel_with_a_window(cupy_gpu, head_dim, n_heads, n_kv, start, n_tokens, window):
    """attention_prefill with a sliding window against its reference, with the cache rows before the
    first query's first key tile poisoned (NaN: never read)."""
    cp = cupy_gpu
    from tinyinfer.kernels.build import device_compute_capability

    rng = np.random.default_rng(head_dim + start + n_tokens + window)
    ctx = start + n_tokens
    q = (0.5 * rng.standard_normal((n_heads, n_tokens, head_dim))).astype(np.float16)
    k = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float16)
    v = rng.standard_normal((ctx, n_kv, head_dim)).astype(np.float16)
    first = max(0, start - window + 1) // prefill_k.TILE_K * prefill_k.TILE_K
    expected = prefill_k.attention_reference(q, k, v, start, window).astype(np.float32)
    k[:first] = v[:first] = np.nan
    mod = prefill_k.compile_prefill(device_compute_capability(), head_dim)
    out = cp.full((n_tokens, n_heads * head_dim), np.nan, dtype=cp.float16)
    prefill_k.attention(mod, cp.asarray(q), cp.asarray(k), cp.asarray(v), n_tokens, start, n_heads, n_kv, head_dim,
                        out, window)
    got = out.get().astype(np.float32)
    assert np.isfinite(got).all(), "unwritten or non-finite outputs (or a row before the window was read)"
    errors = relative_errors(got, expected)
    assert errors.max() <= 1e-3, f"relative error {errors.max():.2e} at query {errors.argmax()}"


def test_rope_store_adds_the_bias(cupy_gpu):
    cp = cupy_gpu
    from tinyinfer.kernels.build import device_compute_capability

    rng = np.random.default_rng(9)
    n_heads, n_kv, hd, start, n = 14, 2, 64, 5, 33
    qkv = rng.standard_normal((n, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    bias = (3 * rng.standard_normal(qkv.shape[1])).astype(np.float32)
    cos, sin = ref.rope_tables(hd, 64, 1000000.0, None)
    q_ref, k_ref, v_ref = prefill_k.rope_store_reference(qkv, start, n_heads, n_kv, hd, cos, sin, bias)
    mod = prefill_k.compile_prefill(device_compute_capability(), hd)
    q = cp.full((n_heads, n, hd), np.nan, dtype=cp.float16)
    k_cache = cp.zeros((64, n_kv, hd), dtype=cp.float16)
    v_cache = cp.zeros((64, n_kv, hd), dtype=cp.float16)
    prefill_k.rope_store(mod, cp.asarray(qkv), n, start, n_heads, n_kv, hd, cp.asarray(cos), cp.asarray(sin), q,
                         k_cache, v_cache, cp.asarray(bias))
    scale = prefill_k.LOG2E / math.sqrt(hd)
    np.testing.assert_allclose(q.get().astype(np.float32), q_ref.astype(np.float32), rtol=2e-3, atol=2e-3 * scale)
    np.testing.assert_allclose(k_cache[start: start + n].get().astype(np.float32), k_ref.astype(np.float32),
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(v_cache[start: start + n].get(), v_ref)


# ------------------------------------------------------------------------------------ transformers

TRANSFORMERS_CLASSES = {"qwen2.5-0.5b": ("Qwen2ForCausalLM", "Qwen2Config"),
                        "mistral-7b-window64": ("MistralForCausalLM", "MistralConfig"),
                        "llama-3.2-1b": ("LlamaForCausalLM", "LlamaConfig")}


@pytest.mark.parametrize("name", list(REAL))
def test_f16_matches_transformers_on_the_gpu(name, tmp_path, cupy_gpu):
    """transformers' own class with these shapes (2 layers), random fp16-exact weights, converted by
    tinyconvert to f16: the GPU's decode graph and prefill against transformers in float32 (on its GPU
    when torch has CUDA, else on the CPU). Mistral's 400 positions cross its window of 64."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import json

    from checkpoints import randomize_llama_weights
    from tinyinfer.convert import convert_checkpoint
    from tinyinfer.runtime.bench import synthetic_tokenizer

    model_class, config_class = TRANSFORMERS_CLASSES[name]
    shape = {k: v for k, v in REAL[name].items() if k not in ("model_type", "num_hidden_layers")}
    shape.update(num_hidden_layers=2, max_position_embeddings=CONTEXT)
    hf_config = getattr(transformers, config_class)(bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_class)(hf_config).float().eval()
    randomize_llama_weights(hf_model)
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(synthetic_tokenizer(1000)["tokenizer_json"])
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    path = convert_checkpoint(folder, out=tmp_path / "m-f16.tinf", quant="f16", progress=False)
    ids = np.random.default_rng(2).integers(0, hf_config.vocab_size, POSITIONS[name]).tolist()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        theirs = hf_model.to(device)(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()
    with load(path, device="cuda") as model:
        decode = model.backend.decode_forward(ids, 0)
        prefill = cuda_prefill.Prefill(model.backend, 128).run(np.array(ids), 0, "all").get()
    assert_close(decode, theirs, f"{name} f16 decode graph vs transformers ({device}, float32)")
    assert_close(prefill, theirs, f"{name} f16 prefill vs transformers ({device}, float32)")
