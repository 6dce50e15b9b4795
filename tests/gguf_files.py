"""Tiny GGUF files written with the gguf package's own writer, laid out as llama.cpp's converter does.

`write_gguf(path, ...)` writes a random llama/qwen2 model whose matrices are stored in a chosen ggml
type, with a byte-level BPE (gpt2) or SentencePiece (llama) vocabulary, and returns the weights in
Hugging Face row order exactly as the file stores them: each matrix quantized and dequantized with
gguf.quants in that order. Quantization is row-local, so this is the oracle for the converter's
un-permutation of llama q/k rows without sharing its code. `raw_gguf` writes arbitrary, possibly
malformed, headers byte by byte for the untrusted-input tests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from tinyinfer.runtime.bench import byte_level_tokenizer_json

CORPUS = ["the quick brown fox jumps over the lazy dog", "Hello, world! 1234 tokens <think> are here",
          "pack my box with five dozen liquor jugs"] * 3
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row order for the llama architecture (interleaved RoPE pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bpe_vocabulary(vocab_size: int):
    """(tokens, token types, merges) of a byte-level BPE trained on CORPUS, ids 0-3 control tokens."""
    model = json.loads(byte_level_tokenizer_json(vocab_size - 3, CORPUS))["model"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [None] * len(model["vocab"])
    for token, i in model["vocab"].items():
        tokens[i + 3] = token
    tokens = [t for t in tokens if t not in ("<s>", "</s>")]
    tokens.append("<think>")
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def sentencepiece_vocabulary(model_path: Path):
    """(tokens, scores, token types) of a SentencePiece model, as llama.cpp's converter stores them."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_path))
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i in range(sp.get_piece_size())]
    return tokens, scores, types


def random_hf_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dim, ffn, hd = cfg["dim"], cfg["ffn"], cfg["dim"] // cfg["n_heads"]
    q, kv = cfg["n_heads"] * hd, cfg["n_kv_heads"] * hd

    def linear(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((cfg["vocab"], dim)).astype(np.float32),
         "output_norm.weight": norm()}
    if not cfg["tied"]:
        w["output.weight"] = linear(cfg["vocab"], dim)
    for i in range(cfg["n_layers"]):
        p = f"blk.{i}."
        w.update({p + "attn_norm.weight": norm(), p + "attn_q.weight": linear(q, dim),
                  p + "attn_k.weight": linear(kv, dim), p + "attn_v.weight": linear(kv, dim),
                  p + "attn_output.weight": linear(dim, q), p + "ffn_norm.weight": norm(),
                  p + "ffn_gate.weight": linear(ffn, dim), p + "ffn_up.weight": linear(ffn, dim),
                  p + "ffn_down.weight": linear(dim, ffn)})
        if cfg["biases"]:
            w.update({p + "attn_q.bias": rng.standard_normal(q).astype(np.float32) * 0.1,
                      p + "attn_k.bias": rng.standard_normal(kv).astype(np.float32) * 0.1,
                      p + "attn_v.bias": rng.standard_normal(kv).astype(np.float32) * 0.1})
    return w


def stored(values: np.ndarray, type_name: str) -> tuple[np.ndarray, object, np.ndarray]:
    """(array for the writer, raw ggml type or None, float32 values the file holds)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if type_name == "F32" or values.ndim == 1:
        return values, None, values
    if type_name == "F16":
        return values.astype(np.float16), None, values.astype(np.float16).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(values, qtype)
    return raw, qtype, dequantize(raw, qtype)


def write_gguf(path, *, arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=96, vocab=300,
               tied=False, matrix_type="F32", embedding_type=None, output_type=None, tokenizer="bpe",
               biases=False, seed=0, pre="gpt2", metadata=None, drop=(), extra_tensors=None, spm_model=None) -> dict[str, np.ndarray]:
    """Write a random model; returns GGUF tensor name -> float32 values in Hugging Face row order."""
    import gguf

    cfg = dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn=ffn, vocab=vocab,
               tied=tied, biases=biases)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny random test model")
    writer.add_string("general.license", "mit")
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_vocab_size(vocab)
    add_tokenizer(writer, tokenizer, vocab, spm_model, pre)
    for key, (kind, value) in (metadata or {}).items():
        getattr(writer, f"add_{kind}")(key, value)
    values = {}
    for name, w in random_hf_weights(cfg, seed).items():
        if name in drop:
            continue
        kind = "attn_q" in name and n_heads or "attn_k" in name and n_kv_heads
        in_file = llama_cpp_permute(w, kind) if arch == "llama" and kind else w
        type_name = (embedding_type if name == "token_embd.weight" else
                     output_type if name == "output.weight" else None) or matrix_type
        array, raw_type, _ = stored(in_file, type_name)
        _, _, values[name] = stored(w, type_name)
        writer.add_tensor(name, array, raw_dtype=raw_type)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def add_tokenizer(writer, tokenizer: str | None, vocab: int, spm_model, pre: str) -> None:
    if tokenizer == "bpe":
        tokens, types, merges = bpe_vocabulary(vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_uint32("tokenizer.ggml.eot_token_id", 0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    elif tokenizer == "spm":
        tokens, scores, types = sentencepiece_vocabulary(spm_model)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)


# ---------------------------------------------------------------------------- hand-made headers

def gguf_string(text: bytes | str, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def kv(key: str, value_type: int, payload: bytes, key_length: int | None = None) -> bytes:
    return gguf_string(key, key_length) + struct.pack("<I", value_type) + payload


def tensor_info(name: str, dims, type_id: int, offset: int, n_dims: int | None = None) -> bytes:
    return (gguf_string(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", type_id, offset))


def raw_gguf(path, kvs: list[bytes], tensors: list[bytes], data: bytes = b"", version: int = 3,
             n_kv: int | None = None, n_tensors: int | None = None, magic: bytes = b"GGUF") -> Path:
    """A GGUF file assembled from pre-encoded pieces; counts may lie on purpose."""
    header = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = header + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32)
    Path(path).write_bytes(body + data)
    return Path(path)
