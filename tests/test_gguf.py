"""GGUF input: tiny files written by the gguf package's writer (exact round trips, re-quantized types,
q/k un-permutation, tokenizers), crafted malformed files, and the CLI."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gguf_files import (CHAT_TEMPLATE, CORPUS, gguf_string, kv, raw_gguf, sentencepiece_vocabulary,  # noqa: E402
                        tensor_info, write_gguf)

from tinyinfer.convert import ConvertError, convert_checkpoint  # noqa: E402
from tinyinfer.convert.cli import main  # noqa: E402
from tinyinfer.convert.gguf_checkpoint import open_gguf  # noqa: E402
from tinyinfer.formats import encode, max_abs_error_bound, open_tinf  # noqa: E402
from tinyinfer.runtime.tokenizer import Tokenizer  # noqa: E402

TRICKY = ["Hello world", " leading space", "trailing space ", "  two  spaces", "tabs\tand\nnewlines\n\n",
          "digits 1234567 and 3.14159", "ÄÖÜ äöü ß café naïve", "日本語のテキスト", "emoji 🤖🚀 done",
          "<|im_start|>user\nhi<|im_end|>\n", "<think> user-defined </think>", "don't we'll they're I'M",
          "code: def f(x):\n    return x**2  # comment", "", " ", "\n", "a" * 50, "<|endoftext|><|endoftext|>",
          "mixed<|im_end|>text", "$100 & 50% off!!! ... ??? ---"]


def convert(src, out, **kwargs):
    return convert_checkpoint(src, out, progress=False, **kwargs)


def assert_one_sentence(message: str):
    assert message.endswith(".") and "\n" not in message and ". " not in message, message


def layer_tensors(values: dict, i: int) -> dict[str, np.ndarray]:
    """The fused tinf tensors of layer i, from GGUF-named values in Hugging Face row order."""
    p = f"blk.{i}."
    cat = lambda *names: np.concatenate([values[p + n + ".weight"] for n in names])  # noqa: E731
    return {f"layers.{i}.wqkv": cat("attn_q", "attn_k", "attn_v"), f"layers.{i}.wo": cat("attn_output"),
            f"layers.{i}.w_gate_up": cat("ffn_gate", "ffn_up"), f"layers.{i}.w_down": cat("ffn_down"),
            f"layers.{i}.attn_norm": values[p + "attn_norm.weight"], f"layers.{i}.ffn_norm": values[p + "ffn_norm.weight"]}


def expected_tensors(values: dict, n_layers: int, tied: bool) -> dict[str, np.ndarray]:
    expected = {"tok_embeddings": values["token_embd.weight"], "norm": values["output_norm.weight"],
                "output": values["token_embd.weight" if tied else "output.weight"]}
    for i in range(n_layers):
        expected.update(layer_tensors(values, i))
    return expected


# ------------------------------------------------------------------------------ exact round trips


@pytest.mark.parametrize("ggml_type,quant,encoding", [("Q8_0", None, "q8"), ("Q4_0", None, "q4"),
                                                      ("Q4_0", "q8", "q8"), ("F16", None, "f16")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_exact_round_trip(tmp_path, ggml_type, quant, encoding, arch):
    """Every matrix dequantizes to exactly what gguf.quants.dequantize gives for the file's blocks,
    in Hugging Face row order (llama files store q/k permuted; the oracle never was)."""
    values = write_gguf(tmp_path / "m.gguf", arch=arch, matrix_type=ggml_type, embedding_type="F16",
                        n_heads=4, n_kv_heads=2)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinf", quant=quant)
    with open_tinf(out) as f:
        assert f.metadata["provenance"]["quant"] == encoding
        for name, want in expected_tensors(values, 2, tied=False).items():
            got = f.tensor(name)
            if want.ndim == 2 and name != "tok_embeddings":
                assert (got.encoding, got.group) == (encoding, 32 if encoding != "f16" else None), name
            np.testing.assert_array_equal(got.to_float32(), want, err_msg=name)


def test_float_file_with_quant_converts_as_from_safetensors(tmp_path):
    values = write_gguf(tmp_path / "m.gguf", matrix_type="F32", tied=True)
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinf", quant="q4", group_size=64, calibrate=False)
    with open_tinf(out) as f:
        assert f.config["tied_embeddings"] is True
        for name, want in expected_tensors(values, 2, tied=True).items():
            got = f.tensor(name)
            reference = encode(want, got.encoding, 64)
            np.testing.assert_array_equal(got.data, reference.data, err_msg=name)


def test_other_types_are_requantized_with_one_line(tmp_path, capfd):
    values = write_gguf(tmp_path / "m.gguf", matrix_type="Q5_0", output_type="Q8_0")
    out = convert(tmp_path / "m.gguf", tmp_path / "m.tinf")
    note = [line for line in capfd.readouterr().err.splitlines() if line]
    assert len(note) == 1 and "Q5_0" in note[0] and "--quant q8 keeps most of it" in note[0], note
    with open_tinf(out) as f:
        assert (f.info("layers.0.w_down").encoding, f.info("output").encoding) == ("q4", "q8")
        np.testing.assert_array_equal(f.tensor("output").to_float32(), values["output.weight"])   # kept exact
        got, want = f.tensor("layers.1.w_down"), values["blk.1.ffn_down.weight"]
        error = np.abs(got.to_float32() - want).reshape(*got.scales.shape, -1)
        assert (error <= max_abs_error_bound(got)[..., None]).all()
    out = convert(tmp_path / "m.gguf", tmp_path / "m8.tinf", quant="q8")
    assert "re-quantized to q8" in capfd.readouterr().err


def test_qwen2_biases_map_to_bqkv(tmp_path):
    values = write_gguf(tmp_path / "q.gguf", arch="qwen2", biases=True, matrix_type="Q8_0")
    checkpoint = open_gguf(tmp_path / "q.gguf")
    assert checkpoint.config["qkv_bias"] is True and checkpoint.config["sliding_window"] is None
    want = np.concatenate([values[f"blk.1.attn_{x}.bias"] for x in "qkv"])
    np.testing.assert_array_equal(checkpoint.load("layers.1.bqkv"), want)
    names = list(checkpoint.sources)
    assert names[names.index("layers.1.wqkv") + 1] == "layers.1.bqkv"
    from tinyinfer.convert.pipeline import tinf_shapes
    if "layers.0.bqkv" not in tinf_shapes(checkpoint.config):   # biases not stored by this version yet
        with pytest.raises(ConvertError, match="q/k/v biases") as info:
            convert(tmp_path / "q.gguf", tmp_path / "q.tinf")
        assert_one_sentence(str(info.value))
        assert not (tmp_path / "q.tinf").exists()
    else:
        with open_tinf(convert(tmp_path / "q.gguf", tmp_path / "q.tinf")) as f:
            np.testing.assert_array_equal(f.tensor("layers.1.bqkv").to_float32(), want)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """Llama 3.1+ GGUFs carry llama3 RoPE scaling as a rope_freqs tensor of per-frequency divisors."""
    from tinyinfer.convert.gguf_checkpoint import llama3_factors

    factors = llama3_factors(64, 10000.0, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", dim=128, n_heads=2, n_kv_heads=2, extra_tensors={"rope_freqs.weight": factors})
    assert open_gguf(tmp_path / "m.gguf").config["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    factors[3] *= 1.5
    write_gguf(tmp_path / "bad.gguf", dim=128, n_heads=2, n_kv_heads=2, extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(ConvertError, match="does not match Llama 3 RoPE scaling"):
        open_gguf(tmp_path / "bad.gguf")


# ------------------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_transformers_on_the_same_file(tmp_path, arch):
    """transformers un-permutes llama q/k itself when it loads a GGUF: same weights, same logits
    (qwen2: not permuted, with q/k/v biases)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tinyinfer.convert.pipeline import tinf_shapes
    from tinyinfer.runtime import load

    write_gguf(tmp_path / "m.gguf", arch=arch, biases=arch == "qwen2", matrix_type="Q8_0", embedding_type="F16",
               output_type="Q4_0", n_heads=4, n_kv_heads=2, dim=128, seed=3)
    config = open_gguf(tmp_path / "m.gguf").config
    if config["qkv_bias"] and "layers.0.bqkv" not in tinf_shapes(config):
        pytest.skip("this version does not store q/k/v biases yet")
    model = load(convert(tmp_path / "m.gguf", tmp_path / "m.tinf"), device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, 290, 40).tolist()
    ours = model.logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    errors = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert errors.max() <= 1e-5, errors.max()
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_bpe_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    write_gguf(tmp_path / "m.gguf")
    tokenizer = Tokenizer.from_metadata(open_gguf(tmp_path / "m.gguf").tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in TRICKY + CORPUS:
        assert tokenizer.encode(text) == theirs.encode(text, add_special_tokens=True), text
        assert tokenizer.decode(tokenizer.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    assert tokenizer.eos_ids == {0, 2} and tokenizer.bos_id == 1 and not tokenizer.add_bos


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    """`smollm` (like starcoder) isolates every digit before the byte-level split, as llama.cpp does for
    it and as SmolLM's own tokenizer.json (Digits(individual_digits)) does, even where merges would join them."""
    write_gguf(tmp_path / "gpt2.gguf")
    write_gguf(tmp_path / "smollm.gguf", pre="smollm")
    gpt2 = Tokenizer.from_metadata(open_gguf(tmp_path / "gpt2.gguf").tokenizer)
    smollm = Tokenizer.from_metadata(open_gguf(tmp_path / "smollm.gguf").tokenizer)
    assert len(gpt2.encode("1234")) < 4
    assert [smollm.decode([i]) for i in smollm.encode("1234 tokens")][:4] == ["1", "2", "3", "4"]
    assert smollm.encode("the quick brown fox") == gpt2.encode("the quick brown fox")


def test_sentencepiece_vocabulary_becomes_the_same_model(tmp_path, shared_assets):
    """A llama (SentencePiece) vocabulary rebuilt from GGUF metadata encodes like the original model."""
    from sentencepiece import SentencePieceProcessor

    original = shared_assets / "llama2-tokenizer" / "tokenizer.model"
    write_gguf(tmp_path / "m.gguf", tokenizer="spm", spm_model=original, vocab=32000, dim=32, n_heads=2,
               n_kv_heads=1, ffn=32, n_layers=1)
    meta = open_gguf(tmp_path / "m.gguf").tokenizer
    assert meta["kind"] == "sentencepiece" and meta["add_bos"] and meta["bos_id"] == 1 and meta["eos_ids"] == [2]
    ours, sp = Tokenizer.from_metadata(meta), SentencePieceProcessor(model_file=str(original))
    for text in TRICKY + CORPUS:
        assert ours.encode(text, add_bos=False) == sp.encode(text), text
        assert ours.decode(ours.encode(text)) == sp.decode(sp.encode(text))
    assert [ours.backend.id_to_piece(i) for i in range(500)] == [sp.id_to_piece(i) for i in range(500)]
    assert sentencepiece_vocabulary(original)[0][:10] == [ours.backend.id_to_piece(i) for i in range(10)]


def test_sentencepiece_tokenizer_against_transformers(tmp_path, shared_assets):
    """transformers builds its GGUF llama tokenizer as a tokenizers BPE; on text without leading spaces or
    special tokens typed inside it, it encodes exactly as SentencePiece does."""
    transformers = pytest.importorskip("transformers")
    write_gguf(tmp_path / "m.gguf", tokenizer="spm", spm_model=shared_assets / "llama2-tokenizer" / "tokenizer.model",
               vocab=32000, dim=32, n_heads=2, n_kv_heads=1, ffn=32, n_layers=1)
    ours = Tokenizer.from_metadata(open_gguf(tmp_path / "m.gguf").tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    plain = [t for t in TRICKY + CORPUS if t.strip() and t == t.lstrip() and "<" not in t]
    for text in plain:
        assert ours.encode(text) == theirs.encode(text), text


# ------------------------------------------------------------------------------ untrusted files


def header_case(tmp_path, name, kvs=(), tensors=(), **kwargs):
    return raw_gguf(tmp_path / f"{name}.gguf", list(kvs), list(tensors), **kwargs)


U32, STR, ARR = 4, 8, 9
CRAFTED = {
    "bad magic": (dict(magic=b"GGML"), "GGUF magic"),
    "version 1": (dict(version=1), "version 1"),
    "big-endian": (dict(version=3 << 24), "big-endian"),
    "kv count": (dict(n_kv=2**40), "metadata entries"),
    "tensor count": (dict(n_tensors=2**40), "tensors"),
    "key length": (dict(kvs=[kv("general.name", STR, gguf_string("x"), key_length=2**60)]), "more than 65535"),
    "string length": (dict(kvs=[kv("general.name", STR, struct.pack("<Q", 10**12) + b"abc")]), "beyond the end"),
    "array length": (dict(kvs=[kv("a", ARR, struct.pack("<IQ", 0, 2**62))]), "items in a"),
    "string array length": (dict(kvs=[kv("a", ARR, struct.pack("<IQ", STR, 2**40))]), "items in a"),
    "array items": (dict(kvs=[kv("a", ARR, struct.pack("<IQ", 0, 3 << 20))], data=b"\0" * (3 << 20)),
                    "more than the 2097152 any real model has"),
    "value type": (dict(kvs=[kv("a", 13, b"\0" * 8)]), "unknown value type 13"),
    "array item type": (dict(kvs=[kv("a", ARR, struct.pack("<IQ", 42, 1))]), "unknown value type 42"),
    "nested arrays": (dict(kvs=[kv("a", ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", ARR, 1)
                                   + struct.pack("<IQ", 0, 1) + b"\0")]), "nests arrays"),
    "duplicate key": (dict(kvs=[kv("a", U32, b"\1\0\0\0"), kv("a", U32, b"\1\0\0\0")]), "appears twice"),
    "alignment 3": (dict(kvs=[kv("general.alignment", U32, struct.pack("<I", 3))]), "power of two"),
    "alignment type": (dict(kvs=[kv("general.alignment", STR, gguf_string("32"))]), "power of two"),
    "dims": (dict(tensors=[tensor_info("t", [64], 0, 0, n_dims=7)]), "7 dimensions"),
    "dims overflow": (dict(tensors=[tensor_info("t", [2**40, 2**40], 0, 0)]), "overflows"),
    "zero dim": (dict(tensors=[tensor_info("t", [0, 4], 0, 0)]), "overflows"),
    "ggml type": (dict(tensors=[tensor_info("t", [32], 99, 0)]), "unknown ggml type 99"),
    "block": (dict(tensors=[tensor_info("t", [33, 2], 2, 0)]), "not a multiple of its type's block"),
    "offset alignment": (dict(tensors=[tensor_info("t", [8], 0, 4)], data=b"\0" * 64), "not a multiple of the alignment"),
    "offset past end": (dict(tensors=[tensor_info("t", [8], 0, 2**40)]), "runs past the end"),
    "data short": (dict(tensors=[tensor_info("t", [64, 64], 0, 0)], data=b"\0" * 100), "runs past the end"),
    "name length": (dict(tensors=[tensor_info("t" * 100, [8], 0, 0)]), "more than 63"),
    "duplicate tensor": (dict(tensors=[tensor_info("t", [8], 0, 0), tensor_info("t", [8], 0, 32)],
                              data=b"\0" * 64), "appears twice"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_headers_are_refused(tmp_path, case):
    kwargs, fragment = CRAFTED[case]
    path = header_case(tmp_path, case.replace(" ", "_"), **kwargs)
    with pytest.raises(ConvertError) as info:
        convert(path, tmp_path / "m.tinf")
    assert fragment in str(info.value)
    assert_one_sentence(str(info.value))
    assert not list(tmp_path.glob("*.tinf*"))


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.01, 300, 30])
def test_truncated_files_are_refused(tmp_path, keep):
    path = tmp_path / "m.gguf"
    write_gguf(path, matrix_type="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: int(keep * len(data)) if keep < 1 else keep])
    with pytest.raises(ConvertError) as info:
        convert(path, tmp_path / "m.tinf")
    assert_one_sentence(str(info.value))
    assert not list(tmp_path.glob("*.tinf*"))


SEMANTIC = {   # valid GGUF structure, values a model cannot have
    "architecture": (dict(metadata={"general.architecture": ("string", "falcon")}), "architecture is 'falcon'"),
    "layers as text": (dict(metadata={"llama.block_count": ("string", "2")}), "block_count is not an integer"),
    "layers huge": (dict(metadata={"llama.block_count": ("uint32", 10**6)}), "outside [1, 1024]"),
    "layers beyond tensors": (dict(metadata={"llama.block_count": ("uint32", 500)}), "needs 4500 tensors"),
    "heads as array": (dict(metadata={"llama.attention.head_count": ("array", [4, 4])}), "head_count is not an integer"),
    "eps type": (dict(metadata={"llama.attention.layer_norm_rms_epsilon": ("string", "1e-5")}), "not a floating"),
    "bos out of range": (dict(metadata={"tokenizer.ggml.bos_token_id": ("uint32", 10**6)}), "outside its vocabulary"),
    "eos out of range": (dict(metadata={"tokenizer.ggml.eos_token_id": ("uint32", 299)}), "outside its vocabulary"),
    "tokenizer model": (dict(metadata={"tokenizer.ggml.model": ("string", "bert")}), "'bert' tokenizer"),
    "pre-tokenizer": (dict(metadata={"tokenizer.ggml.pre": ("string", "weird")}), "pre-tokenizer 'weird'"),
    "missing tensor": (dict(drop=("blk.1.ffn_up.weight",)), "blk.1.ffn_up.weight is missing"),
    "shape": (dict(metadata={"llama.feed_forward_length": ("uint32", 100)}), "has shape"),
    "mixture of experts": (dict(metadata={"llama.expert_count": ("uint32", 8)}), "mixture-of-experts"),
    "sliding window": (dict(metadata={"llama.attention.sliding_window": ("uint32", 64)}), "sliding-window"),
    "vocab": (dict(metadata={"llama.vocab_size": ("uint32", 301)}), "differs from the 300 rows"),
    "tokens": (dict(vocab=250, metadata={"llama.vocab_size": ("uint32", 250)}), "lists"),
}


@pytest.mark.parametrize("case", list(SEMANTIC))
def test_semantic_errors_are_refused(tmp_path, monkeypatch, case):
    import gguf_files

    kwargs, fragment = SEMANTIC[case]
    if case == "tokens":   # a vocabulary longer than the embedding: 300 tokens over 250 rows
        real = gguf_files.bpe_vocabulary
        monkeypatch.setattr(gguf_files, "bpe_vocabulary", lambda n: real(300))
    write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ConvertError) as info:
        convert(tmp_path / "m.gguf", tmp_path / "m.tinf")
    assert fragment in str(info.value)
    assert_one_sentence(str(info.value))
    assert not list(tmp_path.glob("*.tinf*"))


def test_memory_plan_refuses_before_reading_tensors(tmp_path, monkeypatch):
    from tinyinfer.convert import gguf_checkpoint

    write_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_checkpoint, "available_memory", lambda: 100_000)
    with pytest.raises(ConvertError, match="needs about .* GiB of memory") as info:
        convert(tmp_path / "m.gguf", tmp_path / "m.tinf")
    assert_one_sentence(str(info.value))


def test_non_finite_scales_are_refused(tmp_path):
    """An exact copy is still checked: a Q8_0 block whose fp16 scale is infinite is refused."""
    path = tmp_path / "m.gguf"
    write_gguf(path, matrix_type="Q8_0")
    reader_offset = open_gguf(path).tensors["blk.0.ffn_down.weight"].data_offset
    data = bytearray(path.read_bytes())
    data[reader_offset : reader_offset + 2] = np.array([np.inf], np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match="NaN or infinite") as info:
        convert(path, tmp_path / "m.tinf")
    assert_one_sentence(str(info.value))
    assert not list(tmp_path.glob("*.tinf*"))


# ------------------------------------------------------------------------------ CLI and Hub


def test_cli_converts_a_gguf_file(tmp_path, monkeypatch):
    write_gguf(tmp_path / "tiny.Q8_0.gguf", matrix_type="Q8_0")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["tiny.Q8_0.gguf"])
    assert result.exit_code == 0, result.output
    with open_tinf(tmp_path / "tiny.Q8_0-q8.tinf") as f:
        assert f.metadata["chat_template"] == CHAT_TEMPLATE
        assert f.metadata["provenance"]["license"] == "mit"
        assert f.metadata["tokenizer"]["special_tokens"]["eos_token"] == "<|im_end|>"
    result = CliRunner().invoke(main, ["tiny.Q8_0.gguf", "--file", "x.gguf"])
    assert result.exit_code == 1 and "pass the local file itself" in result.output
    result = CliRunner().invoke(main, ["tiny.Q8_0.gguf", "--tokenizer", "tiny.Q8_0.gguf"])
    assert result.exit_code == 1 and "bring their own tokenizer" in result.output


def test_hub_file_is_downloaded_alone(tmp_path, monkeypatch):
    import huggingface_hub

    commit = "c" * 40
    snapshot = tmp_path / "cache" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    write_gguf(snapshot / "model-Q4_0.gguf", matrix_type="Q4_0")
    calls = []

    def fake_download(repo_id, filename, revision=None, token=None):
        calls.append((repo_id, filename, revision, token))
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.chdir(tmp_path)
    out = convert_checkpoint("org/tiny-GGUF", file="model-Q4_0.gguf", revision="main", token="hf_x", progress=False)
    assert out == Path("model-Q4_0-q4.tinf") and calls == [("org/tiny-GGUF", "model-Q4_0.gguf", "main", "hf_x")]
    with open_tinf(out) as f:
        assert f.metadata["provenance"]["source"] == "org/tiny-GGUF/model-Q4_0.gguf"
        assert f.metadata["provenance"]["revision"] == commit
    for bad in ("model.safetensors", "../x.gguf"):
        with pytest.raises(ConvertError, match="is not the name of a .gguf file") as info:
            convert_checkpoint("org/tiny-GGUF", file=bad, progress=False)
        assert_one_sentence(str(info.value))
