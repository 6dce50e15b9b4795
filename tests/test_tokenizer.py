"""Tokenizers as the converter embeds them: encoding and decoding equal transformers' AutoTokenizer
for the same files, and streaming equals decoding all at once.

Each case is a folder with config.json and tokenizer files, read by the converter
(tokenizer_files.hf_tokenizer, which rebuilds tokenizer.json the way transformers does) and by
AutoTokenizer.from_pretrained: the shared TinyLlama and Llama 2 tokenizers (transformers' LlamaTokenizer,
also with legacy and add_prefix_space changed, and the same files under a Mistral config, which runs
them as written), and the test-built Llama 3 and Qwen2 tokenizers (tokenizer_samples.py), Llama 3's
files also declaring GPT2Tokenizer as SmolLM2's repos do. Then SentencePiece models without a
tokenizer.json (stories260K's), run by sentencepiece itself.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tinyinfer.formats import FormatError
from tinyinfer.runtime.tokenizer import Tokenizer
from tokenizer_samples import write_llama3_tokenizer, write_qwen2_tokenizer

HARD_STRINGS = [
    "Hello world", " leading space", "  two leading spaces", "trailing space ", "trailing  ", "   ",
    "\n", "a\nb\n\nc", " \n ", "\n\n\n", "\t tab", "😀", "emoji 😀🎉 in text", "日本語のテキスト", "中文 和 English",
    "<s> typed as text", "<s> typed as text </s>", "text </s> inside", "<unk>", "<s><s>", "a</s><s>b", " <s> x",
    "naïve café — “quotes”", "Zürich ÄÖÜ ß", "e\u0301 combining accent", "x" * 300, " ", "", "1234567890",
    "12 345 6789", "3.14159, 2.71828", "ends with newline\n", "🧑‍🤝‍🧑 zwj sequence", "\u00a0nbsp\u00a0",
    "don't you'll I'M they've", "<|im_start|>user\nhi<|im_end|>\n", "<|begin_of_text|>hi<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>", "<tool_call>\n{}\n</tool_call>",
]
TINYLLAMA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")
LLAMA3_CONFIG = {"model_type": "llama", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                 "vocab_size": 128256}
MISTRAL_CONFIG = {"model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 32000}
QWEN2_CONFIG = {"model_type": "qwen2", "bos_token_id": 151643, "eos_token_id": 151645, "vocab_size": 151936}


def wikitext_lines(assets, n=400):
    text = (assets / "text" / "wikitext-2-raw-wiki.test.raw").read_text(encoding="utf-8")
    return [line for line in text.replace("\r\n", "\n").split("\n") if line.strip()][:n]


def edit_json(path, **changes):
    value = json.loads(path.read_text(encoding="utf-8"))
    value.update(changes)
    path.write_text(json.dumps(value), encoding="utf-8")


def copy_files(source, folder, names=TINYLLAMA_FILES):
    folder.mkdir(parents=True)
    for name in names:
        shutil.copyfile(source / name, folder / name)
    return folder


def tinyllama(assets, folder, **tokenizer_config):
    copy_files(assets / "tinyllama-1.1b-chat-v1.0", folder)
    edit_json(folder / "tokenizer_config.json", **tokenizer_config)
    return folder


def with_config(folder, config: dict, **tokenizer_config):
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_config:
        edit_json(folder / "tokenizer_config.json", **tokenizer_config)
    return folder


CASES = {
    "tinyllama": lambda assets, folder: tinyllama(assets, folder),
    "tinyllama-legacy": lambda assets, folder: tinyllama(assets, folder, legacy=True),
    "tinyllama-no-prefix-space": lambda assets, folder: tinyllama(assets, folder, add_prefix_space=False),
    "llama-2-7b": lambda assets, folder: copy_files(assets / "llama-2-7b-hf", folder),
    "mistral-config": lambda assets, folder: with_config(tinyllama(assets, folder), MISTRAL_CONFIG),
    "llama3": lambda assets, folder: with_config(write_llama3_tokenizer(folder), LLAMA3_CONFIG),
    "llama3-declared-llama": lambda assets, folder: with_config(write_llama3_tokenizer(folder, "LlamaTokenizerFast"),
                                                                LLAMA3_CONFIG),
    "llama3-declared-gpt2": lambda assets, folder: with_config(write_llama3_tokenizer(folder, "GPT2Tokenizer"),
                                                               LLAMA3_CONFIG),
    "qwen2": lambda assets, folder: with_config(write_qwen2_tokenizer(folder), QWEN2_CONFIG),
    "qwen2-prefix-space": lambda assets, folder: with_config(write_qwen2_tokenizer(folder), QWEN2_CONFIG,
                                                             add_prefix_space=True),
}
# Cases whose class rebuilds the file into a tokenizer that encodes some of the texts differently.
REWRITTEN = ("tinyllama", "tinyllama-no-prefix-space", "llama-2-7b", "llama3-declared-gpt2")


def converted(folder) -> Tokenizer:
    """The runtime tokenizer of what tinyconvert would embed for this folder."""
    from tinyinfer.convert.tokenizer_files import hf_tokenizer

    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return Tokenizer.from_metadata(hf_tokenizer(folder, hf_config)[0])


@pytest.fixture(scope="module")
def texts(shared_assets):
    return HARD_STRINGS + wikitext_lines(shared_assets)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, shared_assets, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = CASES[request.param](shared_assets, tmp_path_factory.mktemp("tok") / request.param)
    return request.param, folder, converted(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


def test_encoding_equals_auto_tokenizer(case, texts):
    """Every text encodes to AutoTokenizer's ids (BOS included where it adds one). Where transformers'
    class rebuilds the pre-tokenizer (REWRITTEN), running tokenizer.json as written would give other
    ids for some texts: the rewrite at convert time is what makes the encodings equal."""
    import tokenizers

    name, folder, ours, reference = case
    for text in texts:
        assert ours.encode(text) == reference.encode(text), (name, text)
    if name in REWRITTEN:
        as_written = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert any(as_written.encode(t, add_special_tokens=False).ids != reference.encode(t, add_special_tokens=False)
                   for t in texts)


def test_decoding_equals_auto_tokenizer(case, texts):
    name, _, ours, reference = case
    for text in texts:
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), (name, text)


def test_tinyllama_spaces_and_typed_special_tokens(shared_assets, tmp_path):
    """transformers 5: no lone "▁" before a leading space's word, nor after a special token typed as text."""
    tok = converted(tinyllama(shared_assets, tmp_path / "t"))
    assert tok.encode(" leading space") == [1, 8236, 2913]
    assert tok.encode("<s> typed as text </s>") == [1, 1, 13033, 408, 1426, 29871, 2]


def test_embedded_tokenizer_settings(shared_assets, tmp_path):
    """BOS, the end-of-sequence ids and the special tokens a chat template sees, per family."""
    from tinyinfer.convert.tokenizer_files import hf_tokenizer

    llama3 = with_config(write_llama3_tokenizer(tmp_path / "l3"), LLAMA3_CONFIG)
    meta = hf_tokenizer(llama3, LLAMA3_CONFIG)[0]
    assert (meta["bos_id"], meta["eos_ids"], meta["add_bos"]) == (128000, [128001, 128008, 128009], True)
    assert meta["special_tokens"] == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    qwen2 = with_config(write_qwen2_tokenizer(tmp_path / "q2"), QWEN2_CONFIG)
    meta = hf_tokenizer(qwen2, QWEN2_CONFIG)[0]
    assert (meta["eos_ids"], meta["add_bos"]) == ([151645], False)
    assert meta["special_tokens"] == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert Tokenizer.from_metadata(meta).vocab_size == 151665 < QWEN2_CONFIG["vocab_size"]


def test_sentencepiece_model_encodes_text_as_auto_tokenizer(shared_assets, tmp_path, texts):
    """A folder with only tokenizer.model (stories260K's) is run by SentencePiece, which encodes text
    as AutoTokenizer does; unlike it, BOS is prepended, as llama2.c and Llama's SentencePiece did."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")        # transformers reads the .model through protobuf
    folder = shared_assets / "derived" / "stories260K-hf"
    ours = converted(folder)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert ours.kind == "sentencepiece"
    for text in texts:
        assert ours.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False), text
        assert ours.encode(text)[0] == 1


# ------------------------------------------------------------------------ decoding and streaming

def llama_tokenizers(assets, folder):
    """(tokenizer.json as transformers builds it, the SentencePiece model) for a Llama 2 folder."""
    model = (assets / "llama2-tokenizer" / "tokenizer.model").read_bytes()
    common = dict(bos_id=1, eos_ids=[2], add_bos=True,
                  special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    sp = Tokenizer.from_metadata(dict(kind="sentencepiece", tokenizer_model=model, **common))
    return converted(assets / folder), sp


@pytest.fixture(scope="module", params=["tinyllama-1.1b-chat-v1.0", "llama-2-7b-hf"])
def llama(request, shared_assets):
    return request.param, llama_tokenizers(shared_assets, request.param)


def test_decode_round_trips(llama, shared_assets):
    _, (hf, sp) = llama
    for text in wikitext_lines(shared_assets, 100) + HARD_STRINGS:
        if "<" in text:
            continue   # special tokens are skipped when decoding, so text holding them cannot round-trip
        for tok in (hf, sp):
            # (transformers' Llama decoder strips one leading space: " x" has no lone "▁" to keep it)
            expected = text[1:] if tok.kind == "hf-json" and text.startswith(" ") else text
            assert tok.decode(tok.encode(text)) == expected, (tok.kind, text)


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
        hello_world = tok.encode("Hello world")
        assert stream_text(tok, hello_world[2:], hello_world[:2])[1] == " world"


def test_sentencepiece_encodes_control_tokens_in_text_like_tokenizer_json(shared_assets):
    """The SentencePiece kind splits control pieces typed in text out as their ids, as tokenizer.json's
    added tokens do (compared with the Llama 2 tokenizer.json as written, which keeps SentencePiece's
    dummy prefix on every piece of text)."""
    import tokenizers

    _, sp = llama_tokenizers(shared_assets, "llama-2-7b-hf")
    as_written = tokenizers.Tokenizer.from_file(str(shared_assets / "llama-2-7b-hf" / "tokenizer.json"))
    for text in ["<s>[INST] hi [/INST]", "a</s><s>b", "<s><s>"]:
        assert sp.encode(text, add_bos=False) == as_written.encode(text, add_special_tokens=False).ids
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
