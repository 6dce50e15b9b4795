"""Tokenizers rebuilt from embedded bytes: encoding equals the reference, streaming equals full decoding.

The reference for tokenizer.json is transformers' PreTrainedTokenizerFast(tokenizer_file=...), which
runs the file exactly as written (as AutoTokenizer did up to transformers 4.x, and as SentencePiece
does for the Llama 2 tokenizer). transformers 5's LlamaTokenizer class instead rebuilds Llama
tokenizers with different whitespace rules (" leading" loses its space token), which matches neither
the file nor SentencePiece, so it is not used as the reference here.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer.formats import FormatError
from tinyinfer.runtime.tokenizer import Tokenizer

HARD_STRINGS = [
    "Hello world", " leading space", "  two leading spaces", "trailing space ", "trailing  ",
    "\n", "a\nb\n\nc", " \n ", "\t tab", "😀", "emoji 😀🎉 in text", "日本語のテキスト", "中文 和 English",
    "<s> typed as text", "text </s> inside", "<unk>", "naïve café — “quotes”", "Zürich ÄÖÜ ß", "x" * 300,
    " ", "", "1234567890", "ends with newline\n", "🧑‍🤝‍🧑 zwj sequence", "\u00a0nbsp\u00a0",
]


def llama_tokenizers(assets, folder):
    tokenizer_json = (assets / folder / "tokenizer.json").read_text(encoding="utf-8")
    model = (assets / "llama2-tokenizer" / "tokenizer.model").read_bytes()
    common = dict(bos_id=1, eos_ids=[2], add_bos=True,
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    hf = Tokenizer.from_metadata(dict(kind="hf-json", tokenizer_json=tokenizer_json, **common))
    sp = Tokenizer.from_metadata(dict(kind="sentencepiece", tokenizer_model=model, **common))
    return hf, sp


def wikitext_lines(assets, n=400):
    text = (assets / "text" / "wikitext-2-raw-wiki.test.raw").read_text(encoding="utf-8")
    return [line for line in text.replace("\r\n", "\n").split("\n") if line.strip()][:n]


@pytest.fixture(scope="module", params=["tinyllama-1.1b-chat-v1.0", "llama-2-7b-hf"])
def llama(request, shared_assets):
    return request.param, llama_tokenizers(shared_assets, request.param)


def test_encoding_equals_transformers(llama, shared_assets):
    transformers = pytest.importorskip("transformers")
    folder, (hf, sp) = llama
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(shared_assets / folder / "tokenizer.json"))
    texts = wikitext_lines(shared_assets) + HARD_STRINGS
    for text in texts:
        expected = [1] + reference.encode(text, add_special_tokens=False)
        assert hf.encode(text) == expected, text
        assert sp.encode(text) == expected, text     # SentencePiece, control tokens split out the same way


def test_decode_round_trips(llama, shared_assets):
    _, (hf, sp) = llama
    for text in wikitext_lines(shared_assets, 100) + HARD_STRINGS:
        if "<" in text:
            continue   # special tokens are skipped when decoding, so text holding them cannot round-trip
        for tok in (hf, sp):
            assert tok.decode(tok.encode(text)) == text, (tok.kind, text)


def stream_text(tokenizer, ids, prefix=()):
    stream = tokenizer.stream(prefix)
    chunks = [stream.step(i) for i in ids]
    return chunks, "".join(chunks) + stream.flush()


def test_streaming_equals_decoding_all_at_once(llama, shared_assets):
    _, (hf, sp) = llama
    rng = np.random.default_rng(0)
    for text in wikitext_lines(shared_assets, 150) + HARD_STRINGS:
        for tok in (hf, sp):
            ids = tok.encode(text)
            assert stream_text(tok, ids)[1] == tok.decode(ids), (tok.kind, text)
            cut = int(rng.integers(0, len(ids) + 1))        # a prompt, then generated ids
            prompt, generated = ids[:cut], ids[cut:]
            expected = tok.decode(ids)[len(tok.decode(prompt)):]
            assert stream_text(tok, generated, prompt)[1] == expected, (tok.kind, text, cut)


def test_streaming_holds_back_split_utf8_and_keeps_leading_spaces(llama):
    _, (hf, sp) = llama
    for tok in (hf, sp):
        ids = tok.encode("Hello world!\n😀 world", add_bos=False)
        emoji_bytes = [i for i in ids if i in (243, 162, 155, 131)]   # <0xF0><0x9F><0x98><0x80>
        assert len(emoji_bytes) == 4
        chunks, text = stream_text(tok, ids)
        assert text == "Hello world!\n😀 world"
        start = ids.index(243)
        assert chunks[start:start + 4] == ["", "", "", "😀"]
        assert chunks[ids.index(3186)] == " world"                      # "▁world" keeps its space
        prompt = tok.encode("Hello")
        assert stream_text(tok, tok.encode(" world", add_bos=False)[1:], prompt)[1] == " world"


def test_sentencepiece_encodes_control_tokens_in_text_like_tokenizer_json(llama):
    _, (hf, sp) = llama
    for text in ["<s>[INST] hi [/INST]", "a</s><s>b", "<s><s>"]:
        assert sp.encode(text, add_bos=False) == hf.encode(text, add_bos=False)
    assert sp.encode("<s>hi", add_bos=False)[0] == 1


def byte_level_tokenizer():
    """A byte-level BPE tokenizer built in memory (no assets): byte-level means any text round-trips."""
    from tinyinfer.runtime.bench import byte_level_tokenizer_json

    corpus = ["hello world, the cat sat on the mat", "streaming text works"]
    return Tokenizer.from_metadata(dict(kind="hf-json", tokenizer_json=byte_level_tokenizer_json(300, corpus),
                                        bos_id=0, eos_ids=[1], add_bos=True, special_tokens={"bos_token": "<s>"}))


def test_byte_level_tokenizer_streams_multibyte_text_offline():
    tok = byte_level_tokenizer()
    for text in ["héllo wörld 😀 日本", " the cat", "tab\tand\nnewline", "🎉🎉"]:
        ids = tok.encode(text)
        assert ids[0] == 0 and tok.decode(ids) == text
        chunks, streamed = stream_text(tok, ids)
        assert streamed == text
        assert all("\ufffd" not in c for c in chunks)      # never a half character


def test_ids_beyond_the_tokenizer_vocab_are_ignored_when_decoding():
    tok = byte_level_tokenizer()
    ids = tok.encode("hello", add_bos=False)
    assert tok.decode(ids + [tok.vocab_size + 5]) == "hello"


def test_missing_tokenizer_is_a_format_error():
    with pytest.raises(FormatError, match="tokenizer"):
        Tokenizer.from_metadata({"kind": "hf-json", "tokenizer_json": None})
    with pytest.raises(FormatError, match="cannot be parsed"):
        Tokenizer.from_metadata({"kind": "hf-json", "tokenizer_json": "{not json"})
