"""Tiny random Hugging Face Llama checkpoints written without torch, for converter and runtime tests.

`write_hf_llama(folder, ...)` writes config.json, safetensors weights (bf16, f16 or f32; one file or
shards plus an index), generation_config.json, a model card and tokenizer files, and returns the
float32 values exactly as stored (after rounding to the file's dtype) keyed by HF tensor name.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from tinyinfer.formats.quant import f32_to_bf16
from tinyinfer.runtime.bench import synthetic_tokenizer

# Same location rule as conftest.py: ../shared beside the checkout, or $TINYINFER_SHARED.
SHARED_ASSETS = Path(os.environ.get("TINYINFER_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "assets"
TINYLLAMA = SHARED_ASSETS / "tinyllama-1.1b-chat-v1.0"
TINYLLAMA_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
SAFETENSORS_DTYPE = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


def stored(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes-ready array in the file dtype, the float32 values it holds)."""
    if dtype == "bf16":
        raw = f32_to_bf16(x)
        return raw, (raw.astype(np.uint32) << 16).view(np.float32)
    raw = x.astype(np.float16 if dtype == "f16" else np.float32)
    return raw, raw.astype(np.float32)


def write_safetensors(path: Path, arrays: dict[str, np.ndarray], dtype: str,
                      metadata: dict[str, str] | None = None) -> None:
    """Write arrays (already in the storage dtype) in the safetensors layout, header padded to 8 bytes."""
    header, offset = {}, 0
    for name, array in arrays.items():
        header[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays.values():
            f.write(np.ascontiguousarray(array).tobytes())


def hf_config(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256, tied=False,
              max_context=128, **overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": ffn_dim, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "vocab_size": vocab_size,
        "max_position_embeddings": max_context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": tied, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights scaled so activations stay O(1) through the layers."""
    rng = np.random.default_rng(seed)
    dim, ffn = config["hidden_size"], config["intermediate_size"]
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    kv_rows = config.get("num_key_value_heads", n_heads) * head_dim

    def linear(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], dim)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": linear(n_heads * head_dim, dim),
            p + "self_attn.k_proj.weight": linear(kv_rows, dim),
            p + "self_attn.v_proj.weight": linear(kv_rows, dim),
            p + "self_attn.o_proj.weight": linear(dim, n_heads * head_dim),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": linear(ffn, dim),
            p + "mlp.up_proj.weight": linear(ffn, dim),
            p + "mlp.down_proj.weight": linear(dim, ffn),
        })
        if config.get("model_type") == "qwen2":          # Qwen2's Q/K/V projections have biases
            for x, rows in (("q", n_heads * head_dim), ("k", kv_rows), ("v", kv_rows)):
                weights[p + f"self_attn.{x}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    weights["model.norm.weight"] = norm()
    if not config.get("tie_word_embeddings"):
        weights["lm_head.weight"] = linear(config["vocab_size"], dim)
    return weights


def write_weights(folder: Path, weights: dict[str, np.ndarray], dtype: str, shards: int) -> dict:
    """One model.safetensors, or `shards` files plus model.safetensors.index.json."""
    converted = {name: stored(w, dtype) for name, w in weights.items()}
    raw = {name: pair[0] for name, pair in converted.items()}
    if shards == 1:
        write_safetensors(folder / "model.safetensors", raw, dtype, {"format": "pt"})
    else:
        names = list(raw)
        weight_map = {}
        for k, part in enumerate(np.array_split(np.arange(len(names)), shards)):
            filename = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            write_safetensors(folder / filename, {names[j]: raw[names[j]] for j in part}, dtype, {"format": "pt"})
            weight_map.update({names[j]: filename for j in part})
        index = {"metadata": {"total_size": sum(a.nbytes for a in raw.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {name: pair[1] for name, pair in converted.items()}


def write_synthetic_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json with exactly `vocab_size` ids, plus a tokenizer_config with a chat template."""
    (folder / "tokenizer.json").write_text(synthetic_tokenizer(vocab_size)["tokenizer_json"])
    tokenizer_config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def write_hf_llama(folder, *, dtype="bf16", shards=1, tokenizer="synthetic", seed=0, generation=None,
                   license="apache-2.0", **config_args) -> dict[str, np.ndarray]:
    """Write a random HF Llama checkpoint into `folder`; returns the stored values as float32 by HF name.

    tokenizer: "synthetic" (built here, vocab_size ids), "tinyllama" (copied from the shared assets,
    which forces vocab_size 32000) or None (no tokenizer files).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer == "tinyllama":
        config_args["vocab_size"] = 32000
    config = hf_config(**config_args)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = generation if generation is not None else {"bos_token_id": 1, "eos_token_id": [2, 3],
                                                            "temperature": 0.7, "top_p": 0.9,
                                                            "do_sample": True, "max_length": 2048}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    if license:
        (folder / "README.md").write_text(f"---\nlicense: {license}\ntags:\n- test\n---\n# tiny random llama\n")
    if tokenizer == "synthetic":
        write_synthetic_tokenizer(folder, config["vocab_size"])
    elif tokenizer == "tinyllama":
        for name in TINYLLAMA_FILES:
            shutil.copyfile(TINYLLAMA / name, folder / name)
    return write_weights(folder, random_weights(config, seed), dtype, shards)


def fused_source(weights: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """What each .tinf tensor must hold, built from HF-named source weights (rows: Q,K,V; gate,up)."""
    out = {"tok_embeddings": weights["model.embed_tokens.weight"]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm"] = weights[p + "input_layernorm.weight"]
        out[f"layers.{i}.wqkv"] = np.concatenate([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if p + "self_attn.q_proj.bias" in weights:
            out[f"layers.{i}.bqkv"] = np.concatenate([weights[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.wo"] = weights[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.ffn_norm"] = weights[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.w_gate_up"] = np.concatenate([weights[p + "mlp.gate_proj.weight"],
                                                       weights[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.w_down"] = weights[p + "mlp.down_proj.weight"]
    out["norm"] = weights["model.norm.weight"]
    out["output"] = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return out


def tinf_logits(path, token_ids) -> np.ndarray:
    """Logits [T, vocab] of a .tinf model for one sequence, from the NumPy reference math."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime import reference as ref

    with open_tinf(path) as f:
        c = f.config
        w = {name: f.tensor(name).to_float32() for name in f.names}
    hd, n_heads, n_kv = c["head_dim"], c["n_heads"], c["n_kv_heads"]
    positions = np.arange(len(token_ids))
    cos, sin = ref.rope_tables(hd, len(token_ids), c["rope_theta"], c["rope_scaling"])
    x = w["tok_embeddings"][np.asarray(token_ids)]
    for i in range(c["n_layers"]):
        qkv = ref.linear(ref.rms_norm(x, w[f"layers.{i}.attn_norm"], c["norm_eps"]), w[f"layers.{i}.wqkv"])
        q = qkv[:, : n_heads * hd].reshape(-1, n_heads, hd)
        k = qkv[:, n_heads * hd : (n_heads + n_kv) * hd].reshape(-1, n_kv, hd)
        v = qkv[:, (n_heads + n_kv) * hd :].reshape(-1, n_kv, hd)
        q, k = ref.apply_rope(q, positions, cos, sin), ref.apply_rope(k, positions, cos, sin)
        x = x + ref.linear(ref.attention(q, k, v, positions), w[f"layers.{i}.wo"])
        h = ref.rms_norm(x, w[f"layers.{i}.ffn_norm"], c["norm_eps"])
        x = x + ref.linear(ref.swiglu(ref.linear(h, w[f"layers.{i}.w_gate_up"])), w[f"layers.{i}.w_down"])
    return ref.linear(ref.rms_norm(x, w["norm"], c["norm_eps"]), w["output"])


def assert_tinf_matches(path, expected: dict[str, np.ndarray]) -> None:
    """Every tensor of the .tinf decodes to its source within its encoding's error bound:
    exact for f32, fp16 rounding for f16, and per group the quantizer's bound for q8/q4."""
    from tinyinfer.formats import max_abs_error_bound, open_tinf

    with open_tinf(path) as f:
        assert f.names == list(expected), "tensor names or order differ"
        for name in f.names:
            tensor, source = f.tensor(name), expected[name].astype(np.float32)
            assert f.check(name), f"{name}: checksum mismatch"
            assert tensor.shape == source.shape, name
            decoded = tensor.to_float32()
            if tensor.encoding == "f32":
                np.testing.assert_array_equal(decoded, source, err_msg=name)
            elif tensor.encoding == "f16":
                np.testing.assert_array_equal(decoded, source.astype(np.float16).astype(np.float32), err_msg=name)
            else:
                error = np.abs(decoded - source).reshape(tensor.rows, tensor.cols)
                padded = np.zeros((tensor.rows, tensor.cols_pad), np.float32)
                padded[:, : tensor.cols] = error
                per_group = padded.reshape(tensor.rows, -1, tensor.group).max(axis=-1)
                bound = max_abs_error_bound(tensor)
                worst = np.unravel_index(np.argmax(per_group - bound), bound.shape)
                assert np.all(per_group <= bound), (f"{name}: group {worst} error {per_group[worst]} "
                                                    f"exceeds bound {bound[worst]}")


def write_sentencepiece(path, vocab_size: int = 64) -> Path:
    """Train a tiny BPE sentencepiece model (unk 0, bos 1, eos 2) in a few milliseconds."""
    import io

    import sentencepiece

    text = ["Once upon a time there was a little girl named Lily", "She loved to play outside in the park",
            "One day she saw a big red ball", "The cat sat on the mat and the dog ran home"] * 20
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model,
                                             vocab_size=vocab_size, model_type="bpe", unk_id=0, bos_id=1,
                                             eos_id=2, minloglevel=2)
    Path(path).write_bytes(model.getvalue())
    return Path(path)


def randomize_llama_weights(model) -> None:
    """Give a transformers Llama, Mistral or Qwen2 weights large enough for well-separated logits
    (draws from torch's RNG). Biases (Qwen2's Q/K/V) are O(1), like the large ones trained models have."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (1.0 if "embed" in name else p.shape[1] ** 0.5))
