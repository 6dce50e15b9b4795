"""model.logits against Hugging Face transformers on random tiny Llama, Qwen2 and Mistral configs.

Each checkpoint is written by transformers itself (save_pretrained, safetensors, from its own
LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM) and converted with tinyconvert. The
family configs are the real models' shapes scaled down (heads per KV head, head_dim, rope theta and
scaling, tied embeddings, Q/K/V biases, a sliding window that 64 positions cross several times).
Error is measured per position as ||ours - theirs|| / ||theirs||, over 64 positions.
- f16 file vs the original float32 transformers model: <= 1e-3 (this includes rounding the weights to
  fp16) and the same argmax at every position.
- f16/q8/q4 file vs a transformers model holding the file's dequantized weights: the weights are then
  identical, so only float32 arithmetic differs; measured ~7e-7, asserted <= 1e-5, same argmax.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from checkpoints import randomize_llama_weights  # noqa: E402
from tinyinfer.convert import convert_checkpoint  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402

N_POSITIONS = 64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# Llama-3.2-1B's own scaling (factor 32, band 1..4 of an 8192-position original context).
LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
            "mistral": ("MistralForCausalLM", "MistralConfig")}
CONFIGS = {
    # GQA, untied, head_dim 64 set explicitly (n_heads * head_dim != hidden), llama3 rope scaling
    "gqa-untied-hd64-llama3": dict(hidden_size=128, intermediate_size=200, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=333, rope_theta=50000.0,
                                   rope_scaling=LLAMA3, tie_word_embeddings=False),
    # MHA, tied, head_dim 128
    "mha-tied-hd128": dict(hidden_size=256, intermediate_size=300, num_attention_heads=2, num_key_value_heads=2,
                           vocab_size=301, rope_theta=10000.0, tie_word_embeddings=True),
    # GQA 3:1, tied, head_dim 64, large theta
    "gqa-tied-hd64": dict(hidden_size=192, intermediate_size=500, num_attention_heads=3, num_key_value_heads=1,
                          vocab_size=300, rope_theta=500000.0, tie_word_embeddings=True),
    # MHA, untied, head_dim 64, linear rope scaling
    "mha-untied-hd64-linear": dict(hidden_size=128, intermediate_size=129, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=290, rope_theta=20000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False),
    # Llama-3.2-1B scaled down: 4 query heads per KV head of 64, theta 500000 with its llama3 scaling, tied
    "llama3.2-1b-scaled": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                               vocab_size=384, rope_theta=500000.0, rope_scaling=LLAMA32, tie_word_embeddings=True),
    # Qwen2.5-0.5B scaled down: 7 query heads per KV head of 64, theta 1e6, tied, Q/K/V biases
    "qwen2.5-0.5b-scaled": dict(family="qwen2", hidden_size=448, intermediate_size=608, num_attention_heads=7,
                                num_key_value_heads=1, vocab_size=400, rope_theta=1000000.0, tie_word_embeddings=True),
    # Qwen2 with its sliding window on in every layer (use_sliding_window, max_window_layers 0)
    "qwen2-window16": dict(family="qwen2", hidden_size=128, intermediate_size=200, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=300, rope_theta=1000000.0, tie_word_embeddings=False,
                           use_sliding_window=True, sliding_window=16, max_window_layers=0),
    # Mistral-7B scaled down: 4 query heads per KV head of 128, theta 1e4, untied, a window of 16
    "mistral-7b-scaled-window16": dict(family="mistral", hidden_size=256, intermediate_size=512, head_dim=128,
                                       num_attention_heads=4, num_key_value_heads=1, vocab_size=320,
                                       rope_theta=10000.0, tie_word_embeddings=False, sliding_window=16),
}


def family_classes(name: str):
    model_class, config_class = FAMILIES[CONFIGS[name].get("family", "llama")]
    return getattr(transformers, model_class), getattr(transformers, config_class)


@pytest.fixture(scope="module")
def tokenizer_json():
    from tinyinfer.runtime.bench import byte_level_tokenizer_json

    return byte_level_tokenizer_json(280, ["the quick brown fox jumps over the lazy dog"] * 3)


def random_model(name: str, seed: int):
    """A float32 model of the config's family with weights large enough to give well-separated logits."""
    model_class, config_class = family_classes(name)
    shape = {k: v for k, v in CONFIGS[name].items() if k != "family"}
    config = config_class(num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                          bos_token_id=0, eos_token_id=1, **shape)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    randomize_llama_weights(model)
    return model


def transformers_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def dequantized_reference(hf_model, tinf):
    """The transformers model again, holding the weights exactly as the .tinf file stores them."""
    c = tinf.config
    config = hf_model.config.to_dict()
    config["tie_word_embeddings"] = False        # the file's output matrix is quantized on its own
    model = type(hf_model)(type(hf_model.config)(**config)).float().eval()
    w = lambda name: torch.from_numpy(tinf.tensor(name).to_float32().copy())
    q, kv = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"]
    state = {"model.embed_tokens.weight": w("tok_embeddings"), "model.norm.weight": w("norm"),
             "lm_head.weight": w("output")}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        wqkv, gate_up = w(f"layers.{i}.wqkv"), w(f"layers.{i}.w_gate_up")
        state.update({
            p + "self_attn.q_proj.weight": wqkv[:q], p + "self_attn.k_proj.weight": wqkv[q:q + kv],
            p + "self_attn.v_proj.weight": wqkv[q + kv:], p + "self_attn.o_proj.weight": w(f"layers.{i}.wo"),
            p + "mlp.gate_proj.weight": gate_up[:c["ffn_dim"]], p + "mlp.up_proj.weight": gate_up[c["ffn_dim"]:],
            p + "mlp.down_proj.weight": w(f"layers.{i}.w_down"),
            p + "input_layernorm.weight": w(f"layers.{i}.attn_norm"),
            p + "post_attention_layernorm.weight": w(f"layers.{i}.ffn_norm"),
        })
        if c.get("qkv_bias"):
            bqkv = w(f"layers.{i}.bqkv")
            state.update({p + "self_attn.q_proj.bias": bqkv[:q], p + "self_attn.k_proj.bias": bqkv[q:q + kv],
                          p + "self_attn.v_proj.bias": bqkv[q + kv:]})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def relative_errors(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def write_checkpoint(name: str, folder, tokenizer_json: str):
    """(name, folder, transformers model, ids): the random model saved by transformers into folder."""
    model = random_model(name, seed=len(name))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, N_POSITIONS).tolist()
    return name, folder, model, ids


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory, tokenizer_json):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer_json)


def test_f16_matches_the_original_float32_model(checkpoint, tmp_path):
    name, folder, hf_model, ids = checkpoint
    path = convert_checkpoint(folder, out=tmp_path / f"{name}-f16.tinf", quant="f16", progress=False)
    ours, theirs = load(path, device="cpu").logits(ids), transformers_logits(hf_model, ids)
    errors = relative_errors(ours, theirs)
    print(f"{name} f16 vs float32 transformers: max relative error {errors.max():.2e}, max abs error "
          f"{np.abs(ours - theirs).max():.2e}, argmax agrees at {np.mean(ours.argmax(-1) == theirs.argmax(-1)):.0%}")
    assert ours.shape == theirs.shape == (N_POSITIONS, hf_model.config.vocab_size)
    assert errors.max() <= 1e-3
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name,feature", [("qwen2.5-0.5b-scaled", "qkv_bias"), ("qwen2-window16", "sliding_window"),
                                          ("mistral-7b-scaled-window16", "sliding_window")])
def test_the_biases_and_the_window_are_what_makes_the_match(name, feature, tmp_path, tokenizer_json):
    """The same file run without its Q/K/V biases or its window is far from transformers: the
    comparisons above do check those features (the window is crossed by 48 of the 64 positions)."""
    from tinyinfer.runtime.numpy_backend import NumpyBackend

    (tmp_path / "hf").mkdir()
    _, folder, hf_model, ids = write_checkpoint(name, tmp_path / "hf", tokenizer_json)
    path = convert_checkpoint(folder, out=tmp_path / f"{name}-f16.tinf", quant="f16", progress=False)
    backend = NumpyBackend(load(path, device="cpu").tinf)
    assert backend.config[feature]
    backend.config = {**backend.config, feature: False if feature == "qkv_bias" else None}
    errors = relative_errors(backend.forward(np.array(ids), 0), transformers_logits(hf_model, ids))
    assert errors.max() > 1e-2


@pytest.mark.parametrize("quant", ["f16", "q8", "q4"])
def test_logits_match_transformers_with_the_dequantized_weights(checkpoint, quant, tmp_path):
    name, folder, hf_model, ids = checkpoint
    path = convert_checkpoint(folder, out=tmp_path / f"{name}-{quant}.tinf", quant=quant, progress=False)
    model = load(path, device="cpu")
    ours, theirs = model.logits(ids), transformers_logits(dequantized_reference(hf_model, model.tinf), ids)
    errors = relative_errors(ours, theirs)
    print(f"{name} {quant} vs dequantized transformers: max relative error {errors.max():.2e}, max abs error "
          f"{np.abs(ours - theirs).max():.2e}")
    assert errors.max() <= 1e-5
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    if quant == "q4":   # the q4 weights really differ: against the original model the error is large
        assert relative_errors(ours, transformers_logits(hf_model, ids)).max() > 1e-2
