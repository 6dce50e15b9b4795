"""llama2.c checkpoints: v0/v1/v2 layouts, the interleaved -> rotate-half RoPE permutation, and the
real stories260K model against its known greedy output."""

import struct

import numpy as np
import pytest

from checkpoints import assert_tinf_matches, tinf_logits, write_sentencepiece  # noqa: E402

from tinyinfer.convert import ConvertError, convert_checkpoint  # noqa: E402
from tinyinfer.convert.llama2c import rotate_half_rows  # noqa: E402
from tinyinfer.formats import open_tinf  # noqa: E402
from tinyinfer.runtime import reference as ref  # noqa: E402

KNOWN_START = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def interleaved_to_rotate_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Spelled-out row mapping: in each head, rotate-half row j < hd/2 is interleaved row 2j and
    row hd/2 + j is interleaved row 2j + 1."""
    hd = w.shape[0] // n_heads
    order = [h * hd + (2 * j if j < hd // 2 else 2 * (j - hd // 2) + 1) for h in range(n_heads) for j in range(hd)]
    return w[order]


def interleaved_rope(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """llama2.c's RoPE: rotate pairs (x[2i], x[2i+1]) of each head. x: [T, heads, hd]."""
    hd = x.shape[-1]
    freqs = theta ** (-np.arange(0, hd, 2) / hd)
    angles = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return np.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape).astype(np.float32)


def test_permutation_preserves_attention_scores():
    """q.k after llama2.c RoPE on the original rows equals q.k after rotate-half RoPE on permuted rows."""
    rng = np.random.default_rng(0)
    n_heads, hd, dim, T = 3, 8, 12, 6
    x = rng.standard_normal((T, dim)).astype(np.float32)
    wq, wk = (rng.standard_normal((n_heads * hd, dim)).astype(np.float32) for _ in range(2))
    positions = np.arange(T)
    q1 = interleaved_rope((x @ wq.T).reshape(T, n_heads, hd), positions)
    k1 = interleaved_rope((x @ wk.T).reshape(T, n_heads, hd), positions)
    cos, sin = ref.rope_tables(hd, T, 10000.0, None)
    q2 = ref.apply_rope((x @ rotate_half_rows(wq, n_heads).T).reshape(T, n_heads, hd), positions, cos, sin)
    k2 = ref.apply_rope((x @ rotate_half_rows(wk, n_heads).T).reshape(T, n_heads, hd), positions, cos, sin)
    np.testing.assert_allclose(np.einsum("thd,shd->hts", q1, k1), np.einsum("thd,shd->hts", q2, k2),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(rotate_half_rows(wq, n_heads), interleaved_to_rotate_half(wq, n_heads))


# --------------------------------------------------------------------- synthetic v0 / v1 / v2 files


def random_llama2c(seed=0, dim=64, hidden=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab=512, seq_len=32, shared=True):
    rng = np.random.default_rng(seed)
    kv = n_kv_heads * dim // n_heads

    def m(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"tok_embeddings": rng.standard_normal((vocab, dim)).astype(np.float32),
         "norm": (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)}
    for kind, shape in {"attn_norm": None, "ffn_norm": None, "wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim),
                        "wo": (dim, dim), "w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}.items():
        w[kind] = [(1 + 0.1 * rng.standard_normal(dim)).astype(np.float32) if shape is None else m(*shape)
                   for _ in range(n_layers)]
    if not shared:
        w["output"] = m(vocab, dim)
    params = (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len)
    return params, w


def write_v0(path, params, w):
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = params
    shared = "output" not in w
    parts = [struct.pack("<7i", dim, hidden, n_layers, n_heads, n_kv, vocab if shared else -vocab, seq_len),
             w["tok_embeddings"]]
    for kind in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"):
        parts += w[kind]
    parts += [w["norm"], np.full((2, seq_len, dim // n_heads // 2), 7.0, np.float32)]   # freq_cis, skipped
    parts += [] if shared else [w["output"]]
    write_parts(path, parts)


def v1_header(version, params, shared, group=None):
    header = struct.pack("<Ii7iB", 0x616B3432, version, *params, int(shared))
    header += struct.pack("<i", group) if group else b""
    return header + bytes(256 - len(header))


def write_v1(path, params, w):
    shared = "output" not in w
    parts = [v1_header(1, params, shared), *w["attn_norm"], *w["ffn_norm"], w["norm"], w["tok_embeddings"]]
    for kind in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        parts += w[kind]
    write_parts(path, parts + ([] if shared else [w["output"]]))


def write_v2(path, params, w, group=32):
    """Q8_0 as llama2.c's version2_export: int8 values of every matrix, then all fp32 scales.
    Returns the dequantized weights the file holds."""
    shared = "output" not in w
    matrices = [w["tok_embeddings"]] + [m for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for m in w[k]]
    matrices += [] if shared else [w["output"]]
    qs, scales, held = [], [], []
    for m in matrices:
        groups = m.reshape(-1, group)
        scale = (np.abs(groups).max(axis=1) / 127.0).astype(np.float32)
        q = np.round(groups / scale[:, None]).astype(np.int8)
        qs.append(q)
        scales.append(scale)
        held.append((q.astype(np.float32) * scale[:, None]).reshape(m.shape))
    write_parts(path, [v1_header(2, params, shared, group), *w["attn_norm"], *w["ffn_norm"], w["norm"], *qs, *scales])
    names = ["tok_embeddings"] + [(k, i) for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for i in range(params[2])]
    dequantized = {k: ([None] * params[2] if k not in ("tok_embeddings", "output", "norm") else None) for k in w}
    dequantized.update({k: w[k] for k in ("attn_norm", "ffn_norm", "norm")})
    for name, value in zip(names + ([] if shared else ["output"]), held):
        if isinstance(name, tuple):
            dequantized[name[0]][name[1]] = value
        else:
            dequantized[name] = value
    return dequantized


def write_parts(path, parts):
    with open(path, "wb") as f:
        for part in parts:
            if isinstance(part, bytes):
                f.write(part)
            else:   # int8 Q8_0 values as they are, everything else as little-endian fp32
                f.write(np.ascontiguousarray(part, None if part.dtype == np.int8 else "<f4").tobytes())


def expected_tinf(w, params):
    n_layers, n_heads, n_kv = params[2], params[3], params[4]
    out = {"tok_embeddings": w["tok_embeddings"]}
    for i in range(n_layers):
        out[f"layers.{i}.attn_norm"] = w["attn_norm"][i]
        out[f"layers.{i}.wqkv"] = np.concatenate([interleaved_to_rotate_half(w["wq"][i], n_heads),
                                                  interleaved_to_rotate_half(w["wk"][i], n_kv), w["wv"][i]])
        out[f"layers.{i}.wo"] = w["wo"][i]
        out[f"layers.{i}.ffn_norm"] = w["ffn_norm"][i]
        out[f"layers.{i}.w_gate_up"] = np.concatenate([w["w1"][i], w["w3"][i]])
        out[f"layers.{i}.w_down"] = w["w2"][i]
    out["norm"] = w["norm"]
    out["output"] = w.get("output", w["tok_embeddings"])
    return out


@pytest.fixture
def sp_model(tmp_path):
    return write_sentencepiece(tmp_path / "tiny.model", vocab_size=64)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("version", [0, 1, 2])
def test_versions_convert_to_the_same_tensors(tmp_path, sp_model, version, shared):
    params, w = random_llama2c(seed=version, shared=shared)
    path = tmp_path / f"v{version}.bin"
    if version == 2:
        w = write_v2(path, params, w)
    else:
        (write_v0 if version == 0 else write_v1)(path, params, w)
    out = convert_checkpoint(path, tmp_path / "m.tinf", quant="q8", tokenizer=sp_model, progress=False)
    with open_tinf(out) as f:
        assert f.config["tied_embeddings"] is shared and f.config["max_context"] == 32
        assert (f.config["n_heads"], f.config["n_kv_heads"], f.config["ffn_dim"]) == (4, 2, 96)
    assert_tinf_matches(out, expected_tinf(w, params))


# --------------------------------------------------------------------------- the real stories260K


@pytest.fixture
def stories(shared_assets):
    return shared_assets / "llama2c-stories260K"


def read_legacy(path):
    """stories260K.bin read independently of the converter: header, then fp32 weights in v0 order."""
    data = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", data)
    flat = np.frombuffer(data, "<f4", offset=28)
    kv = n_kv * dim // n_heads
    w, pos = {}, 0

    def take(shape):
        nonlocal pos
        n = int(np.prod(shape))
        out = flat[pos : pos + n].reshape(shape)
        pos += n
        return out

    w["tok_embeddings"] = take((abs(vocab), dim))
    for kind, shape in (("attn_norm", (dim,)), ("wq", (dim, dim)), ("wk", (kv, dim)), ("wv", (kv, dim)),
                        ("wo", (dim, dim)), ("ffn_norm", (dim,)), ("w1", (hidden, dim)), ("w2", (dim, hidden)),
                        ("w3", (hidden, dim))):
        w[kind] = [take(shape) for _ in range(n_layers)]
    w["norm"] = take((dim,))
    return (dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len), w


def llama2c_logits(params, w, ids):
    """llama2.c's forward pass (interleaved RoPE) on its own weight layout."""
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = params
    hd = dim // n_heads
    positions = np.arange(len(ids))
    x = w["tok_embeddings"][ids]
    for i in range(n_layers):
        h = ref.rms_norm(x, w["attn_norm"][i], 1e-5)
        q = interleaved_rope(ref.linear(h, w["wq"][i]).reshape(-1, n_heads, hd), positions)
        k = interleaved_rope(ref.linear(h, w["wk"][i]).reshape(-1, n_kv, hd), positions)
        v = ref.linear(h, w["wv"][i]).reshape(-1, n_kv, hd)
        x = x + ref.linear(ref.attention(q, k, v, positions), w["wo"][i])
        h = ref.rms_norm(x, w["ffn_norm"][i], 1e-5)
        x = x + ref.linear(ref.silu(ref.linear(h, w["w1"][i])) * ref.linear(h, w["w3"][i]), w["w2"][i])
    return ref.linear(ref.rms_norm(x, w["norm"], 1e-5), w["tok_embeddings"])


def f16(a):
    return a.astype(np.float16).astype(np.float32)


def test_stories260k_matches_llama2c_forward(tmp_path, stories):
    """Same logits as llama2.c's own math on the same (f16-rounded) weights, and the known greedy text."""
    out = convert_checkpoint(stories / "stories260K.bin", tmp_path / "s.tinf", quant="f16", head="f16",
                             tokenizer=stories / "tok512.model", progress=False)
    params, w = read_legacy(stories / "stories260K.bin")
    rounded = {k: ([f16(m) for m in v] if isinstance(v, list) else f16(v)) for k, v in w.items()}
    rounded.update({k: w[k] for k in ("attn_norm", "ffn_norm", "norm")})           # norms stay f32
    ids = [1, 403, 407, 261, 378, 6, 261, 298, 309, 343]
    np.testing.assert_allclose(tinf_logits(out, ids), llama2c_logits(params, rounded, ids), rtol=0, atol=2e-4)

    sentencepiece = pytest.importorskip("sentencepiece")
    ids = [1]
    for _ in range(28):
        ids.append(int(np.argmax(tinf_logits(out, ids)[-1])))
    with open_tinf(out) as f:
        sp = sentencepiece.SentencePieceProcessor(model_proto=f.metadata["tokenizer"]["tokenizer_model"])
    assert sp.decode(ids[1:]).startswith(KNOWN_START[:60])


def test_stories260k_equals_hf_export(tmp_path, stories, shared_assets):
    """The .bin and the independently permuted HF export convert to bit-identical tensors."""
    a = convert_checkpoint(stories / "stories260K.bin", tmp_path / "a.tinf", tokenizer=stories / "tok512.model",
                           progress=False)
    b = convert_checkpoint(shared_assets / "derived" / "stories260K-hf", tmp_path / "b.tinf", progress=False)
    with open_tinf(a) as fa, open_tinf(b) as fb:
        assert fa.names == fb.names and fa.config == fb.config
        for name in fa.names:
            assert np.array_equal(fa.raw(name), fb.raw(name)), name
        tok = fa.metadata["tokenizer"]
        assert tok["kind"] == "sentencepiece" and (tok["bos_id"], tok["eos_ids"], tok["add_bos"]) == (1, [1, 2], True)
        assert tok["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        assert fa.metadata["chat_template"] is None


def test_stories260k_tensors_within_bound(tmp_path, stories):
    params, w = read_legacy(stories / "stories260K.bin")
    out = convert_checkpoint(stories / "stories260K.bin", tmp_path / "s.tinf", tokenizer=stories / "tok512.model",
                             quant="q4", progress=False)
    assert_tinf_matches(out, expected_tinf(w, params))


# ------------------------------------------------------------------------------------ refused inputs


def test_truncated_file(tmp_path, stories):
    path = tmp_path / "cut.bin"
    path.write_bytes((stories / "stories260K.bin").read_bytes()[:-4])
    with pytest.raises(ConvertError, match="has 1056536 bytes where its header implies 1056540"):
        convert_checkpoint(path, tmp_path / "m.tinf", tokenizer=stories / "tok512.model", progress=False)
    assert not list(tmp_path.glob("*.tinf*"))


def test_needs_tokenizer(tmp_path, stories):
    with pytest.raises(ConvertError, match="needs --tokenizer PATH"):
        convert_checkpoint(stories / "stories260K.bin", tmp_path / "m.tinf", progress=False)


def test_tokenizer_larger_than_vocab(tmp_path, sp_model):
    params, w = random_llama2c(vocab=32)
    write_v0(tmp_path / "small.bin", params, w)
    with pytest.raises(ConvertError, match="the tokenizer has 64 tokens but the model only 32"):
        convert_checkpoint(tmp_path / "small.bin", tmp_path / "m.tinf", tokenizer=sp_model, progress=False)
    assert not list(tmp_path.glob("*.tinf*"))


def test_unknown_version(tmp_path, sp_model):
    params, _ = random_llama2c()
    (tmp_path / "v7.bin").write_bytes(v1_header(7, params, True))
    with pytest.raises(ConvertError, match="export version 7"):
        convert_checkpoint(tmp_path / "v7.bin", tmp_path / "m.tinf", tokenizer=sp_model, progress=False)
