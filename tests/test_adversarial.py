"""Crafted hostile inputs, one group per class of issue 44, each run in a worker process with a time
and a 2 GB memory limit (tests/adversary.py): none may hang, crash or leak a non-project exception,
and those marked so must be refused with the project's own error.

Classes: 1 chat templates, 2 tokenizer metadata types, 3 token ids, 4 tokenizer.json truncation and
padding, 5 the config, 6 reader and generation defaults, 7 converter inputs (HF, llama2.c, GGUF),
8 integrity. The converter's output rules (never over an input, --force, SIGTERM, stale temporary
files) are checked in-process at the end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from adversary import WorkerPool  # noqa: E402
from checkpoints import write_hf_llama, write_sentencepiece  # noqa: E402
from fuzz_tinf import (ATTACK_TEMPLATES, COLLIDING_SPECIAL_TOKENS, nested, seed_gguf, seed_hf_files,  # noqa: E402
                       seed_tinf, split_tinf, with_metadata, with_value)
from tinf_samples import flip_byte  # noqa: E402
from tinyinfer.runtime.bench import synthetic_tokenizer  # noqa: E402

REFUSE, ANY = True, False   # must end in a project error / must only not fail
MAX_MESSAGE_CHARS = 600
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2) as workers:
        yield workers


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> bytes:
    return seed_tinf(tmp_path_factory.mktemp("seed"))


def run_each(pool, label: str, cases: list) -> None:
    """cases: (name, case, must_refuse). None may fail; each must-refuse one must end in a project error."""
    started = time.monotonic()
    must = {name for name, _, must_refuse in cases if must_refuse}
    tally = pool.run_all((name, case) for name, case, _ in cases)
    wrong = [(name, outcome) for name, outcome in tally.outcomes.items() if name in must and outcome == "ok"]
    COUNTS[label] = len(cases)
    print(f"\n{label}: {len(cases)} crafted cases in {time.monotonic() - started:.1f} s: {tally.counts}",
          file=sys.stderr)
    assert tally.failed() == 0, tally.failures
    assert not wrong, f"accepted where a project error was due: {wrong}"
    assert tally.longest_message <= MAX_MESSAGE_CHARS


def tinf_case(data: bytes):
    return ("tinf", data)


# ------------------------------------------------------------------------ 1. chat templates

HARMLESS_TEMPLATES = {"collision messages", "collision generation prompt", "collision tools", "dict items",
                      "power tower", "recursive loop", "wordwrap", "strftime", "lone surrogate", "long template",
                      "format escape", "value error", "float overflow", "globals escape"}


def test_class_1_chat_templates(pool, seed):
    cases = [(f"template {name}", tinf_case(with_metadata(seed, chat_template=source)),
              REFUSE if name not in HARMLESS_TEMPLATES else ANY) for name, source in ATTACK_TEMPLATES.items()]
    metadata, _ = split_tinf(seed)
    colliding = {**metadata["tokenizer"], "special_tokens": COLLIDING_SPECIAL_TOKENS}
    for name in ("collision messages", "collision generation prompt", "collision tools"):
        cases.append((f"special tokens vs {name}", tinf_case(with_metadata(
            seed, tokenizer=colliding, chat_template=ATTACK_TEMPLATES[name])), ANY))
    run_each(pool, "1 chat templates", cases)


def test_special_tokens_never_replace_the_render_arguments():
    from tinyinfer.runtime.chat import render_chat

    text = render_chat("{{ messages[0]['content'] }}|{{ add_generation_prompt }}|{{ tools }}|{{ bos_token }}",
                       [{"role": "user", "content": "hi"}], COLLIDING_SPECIAL_TOKENS)
    assert text == "hi|True|None|<s>"


def test_template_limits_hold_off_the_main_thread(monkeypatch):
    """The deadline is checked inside the sandbox, not by a signal: a server's worker thread gets it too."""
    import threading

    from tinyinfer.runtime import chat
    from tinyinfer.runtime.errors import ChatTemplateError

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    outcome = {}

    def render():
        started = time.monotonic()
        try:
            chat.render_chat(ATTACK_TEMPLATES["nested ranges"], [{"role": "user", "content": "x"}])
        except ChatTemplateError as e:
            outcome["error"] = str(e)
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=render)
    thread.start()
    thread.join(timeout=30)
    assert "ran longer than 0.3 s" in outcome["error"] and outcome["seconds"] < 5


# ------------------------------------------------------------------------ 2. tokenizer metadata types

def test_class_2_tokenizer_metadata_types(pool, seed):
    bad_values = {
        "kind": [5, None, "bpe", ["hf-json"]],
        "tokenizer_json": [7, b"{}", "", "{", "[]", nested(200), "x" * 100000],
        "tokenizer_model": [10**9, 2**62, "model", b"\x00" * 64],
        "eos_ids": ["abc", [1.5], {"a": 1}, [True], [2**40], 2, [-1]],
        "bos_id": [-1, 2**40, True, "1", 1.0, [1]],
        "pad_id": [-1, 64, "x"],
        "add_bos": ["yes", 1, None, [True]],
        "special_tokens": [["<s>"], {"bos_token": 5}, {"bos_token": ["<s>"]}, "x", {"eos_token": "x" * 5000}],
    }
    cases = []
    for key, values in bad_values.items():
        for value in values:
            # The seed's tokenizer is hf-json: its tokenizer_model is never read, whatever it holds.
            must = REFUSE if not (key == "add_bos" and value is None) and key != "tokenizer_model" else ANY
            cases.append((f"tokenizer {key}={str(value)[:30]}", tinf_case(with_value(seed, ("tokenizer", key), value)),
                          must))
    sentencepiece = {"kind": "sentencepiece", "tokenizer_model": 10**9, "bos_id": 1, "eos_ids": [2]}
    cases.append(("sentencepiece model as an int", tinf_case(with_metadata(seed, tokenizer=sentencepiece)), REFUSE))
    cases.append(("tokenizer map missing", tinf_case(with_metadata(seed, tokenizer=None)), REFUSE))
    run_each(pool, "2 tokenizer metadata", cases)


# ------------------------------------------------------------------------ 3. token ids

def test_class_3_token_ids(pool, seed):
    larger = synthetic_tokenizer(80)   # 80 ids for a 64-row embedding
    cases = [(f"{key} {value}", tinf_case(with_value(seed, ("tokenizer", key), value)), REFUSE)
             for key, value in [("bos_id", -1), ("bos_id", 64), ("eos_ids", [-1]), ("eos_ids", [2, 64]),
                                ("pad_id", -1), ("pad_id", 10**6)]]
    cases.append(("tokenizer with more ids than embedding rows", tinf_case(with_metadata(seed, tokenizer=larger)),
                  REFUSE))
    run_each(pool, "3 token ids", cases)


def test_out_of_range_ids_never_reach_the_backend(tmp_path, seed):
    from tinyinfer.runtime.errors import TokenIdError
    from tinyinfer.runtime.model import load

    path = tmp_path / "m.tinf"
    path.write_bytes(seed)
    with load(path, device="cpu") as model:
        def no_forward(*args, **kwargs):
            raise AssertionError("an out-of-range id reached backend.forward")

        model.backend.forward = no_forward
        for ids in ([-1], [64], [3, 2**40], [3.5]):
            with pytest.raises(TokenIdError):
                model.logits(ids)
        model.tokenizer.bos_id = -1   # as a hostile file would have it, were it not refused at load
        with pytest.raises(TokenIdError):
            "".join(model.generate("w3", max_tokens=1))


# ------------------------------------------------------------------------ 4. truncation and padding

TRUNCATIONS = [
    {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
    {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 5},   # panics when applied
    {"direction": "Left", "max_length": 0, "strategy": "OnlyFirst", "stride": 0},
    {"direction": "Right", "max_length": 2**64 - 1, "strategy": "LongestFirst", "stride": 2**64 - 1},
    {"direction": "Sideways", "max_length": 1}, 5, "x",
]
PADDINGS = [
    {"strategy": {"Fixed": 2**40}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
     "pad_type_id": 0, "pad_token": "<unk>"},
    {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": 2**40, "pad_id": 2**40,
     "pad_type_id": 0, "pad_token": "<unk>"},
    {"strategy": {"Fixed": 0}, "direction": "Right", "pad_to_multiple_of": 0, "pad_id": -1, "pad_type_id": 0,
     "pad_token": "<pad>"},
]


def tokenizer_json_with(seed: bytes, **settings) -> bytes:
    metadata, _ = split_tinf(seed)
    tree = json.loads(metadata["tokenizer"]["tokenizer_json"])
    tree.update(settings)
    return with_value(seed, ("tokenizer", "tokenizer_json"), json.dumps(tree))


def test_class_4_truncation_and_padding(pool, seed):
    cases = [(f"truncation {i}", tinf_case(tokenizer_json_with(seed, truncation=t)), ANY)
             for i, t in enumerate(TRUNCATIONS)]
    cases += [(f"padding {i}", tinf_case(tokenizer_json_with(seed, padding=p)), ANY) for i, p in enumerate(PADDINGS)]
    cases += [(f"truncation {i} and padding {j}", tinf_case(tokenizer_json_with(seed, truncation=t, padding=p)), ANY)
              for i, t in enumerate(TRUNCATIONS[:4]) for j, p in enumerate(PADDINGS)]
    run_each(pool, "4 truncation and padding", cases)


def test_truncation_and_padding_of_tokenizer_json_are_not_applied(seed):
    from tinyinfer.runtime.tokenizer import Tokenizer

    metadata, _ = split_tinf(seed)
    tokenizer = metadata["tokenizer"]
    plain = Tokenizer.from_metadata(tokenizer).encode("w3 w4 w5 w6 w7 w8")
    tree = json.loads(tokenizer["tokenizer_json"])
    tree.update(truncation=TRUNCATIONS[0], padding=PADDINGS[0])
    limited = Tokenizer.from_metadata({**tokenizer, "tokenizer_json": json.dumps(tree)})
    assert limited.encode("w3 w4 w5 w6 w7 w8") == plain and len(plain) == 7


# ------------------------------------------------------------------------ 5. config

CONFIG_VALUES = {
    "n_layers": [0, -1, 3, 10**9, 2**31 - 1, 2**63 - 1, True, 2.0, "2", None],
    "max_context": [0, 2**24 + 1, 2**31, 2**40, 2**63 - 1, True, 64.5, "64"],
    "dim": [0, -64, 2**31, 2**40, True, 64.0],
    "n_heads": [0, 3, 2**40, True],
    "n_kv_heads": [0, 3, 5, True],
    "head_dim": [0, 15, 17, 2**40],
    "ffn_dim": [0, 2**40, "128"],
    "vocab_size": [0, 1, 63, 65, 2**40, True],
    "norm_eps": [None, "x", math.nan, math.inf, 0, -1e-5, 2.0, True, [1e-5]],
    "rope_theta": [None, "1e4", -1.0, 0.0, math.inf, math.nan, True, {}],
    "rope_scaling": [5, "linear", [], {"rope_type": "yarn", "factor": 2.0}, {"rope_type": "linear"},
                     {"rope_type": "linear", "factor": 0}, {"rope_type": "linear", "factor": math.nan},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192},
                     {"rope_type": "llama3", "factor": 8.0}, {"type": "linear", "factor": True}],
    "architecture": [None, "gpt2", 5],
    "qkv_bias": ["yes", 1, True],
    "sliding_window": [0, -1, True, 2.5, "x", 2**40, 2**64 - 1],
    "tied_embeddings": ["no", 1],
}


def test_class_5_config(pool, seed):
    cases = []
    for key, values in CONFIG_VALUES.items():
        for value in values:
            if value is None:
                cases.append((f"config without {key}", tinf_case(with_value(seed, ("config", key), 0, delete=True)),
                              REFUSE))
                continue
            cases.append((f"config {key}={str(value)[:40]}", tinf_case(with_value(seed, ("config", key), value)),
                          REFUSE))
    for key in ("dim", "n_layers", "head_dim", "vocab_size", "max_context", "architecture"):
        cases.append((f"config without {key}", tinf_case(with_value(seed, ("config", key), 0, delete=True)), REFUSE))
    cases.append(("config is a list", tinf_case(with_metadata(seed, config=[1, 2])), REFUSE))
    run_each(pool, "5 config", cases)


def test_real_model_dimensions_pass_the_config_check():
    """Llama-3.1-70B's config with its 128K context, and a 1M-token context, pass; only the tensor
    directory (here a stand-in of the right size) limits the layer count."""
    from tinyinfer.runtime.validate import check_config

    llama_70b = {"architecture": "llama", "dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8,
                 "head_dim": 128, "ffn_dim": 28672, "vocab_size": 128256, "max_context": 131072, "norm_eps": 1e-5,
                 "rope_theta": 500000.0, "tied_embeddings": False, "qkv_bias": False, "sliding_window": None,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    check_config(llama_70b, "llama-70b.tinf", n_tensors=3 + 6 * 80)
    check_config({**llama_70b, "max_context": 1 << 20}, "long.tinf", n_tensors=3 + 6 * 80)


# ------------------------------------------------------------------------ 6. reader and generation

def test_class_6_reader_and_generation_defaults(pool, seed):
    metadata, _ = split_tinf(seed)
    q4 = next(i for i, t in enumerate(metadata["tensors"]) if t["encoding"] == "q4")
    cases = [(f"group {value!r}", tinf_case(with_value(seed, ("tensors", q4, "group"), value)), REFUSE)
             for value in (64.0, 32.0, True, "32", 16, 0, -32, None, [32])]
    cases += [(f"deep {where}", tinf_case(with_value(seed, path, nested(400))), REFUSE)
              for where, path in [("shape", ("tensors", 0, "shape")), ("encoding", ("tensors", 0, "encoding")),
                                  ("config value", ("config", "dim")), ("name", ("tensors", 0, "name"))]]
    cases += [(f"long {where}", tinf_case(with_value(seed, path, "x" * 1_000_000)), REFUSE)
              for where, path in [("encoding", ("tensors", 0, "encoding")), ("name", ("tensors", 0, "name")),
                                  ("architecture", ("config", "architecture")), ("kind", ("tokenizer", "kind"))]]
    generation = {"temperature": ["hot", math.nan, -1.0, math.inf], "top_k": [2.5, -1, "5"],
                  "top_p": [0, 1.5, math.nan], "min_p": [2, -0.1], "repetition_penalty": [0, -1, math.nan],
                  "max_new_tokens": [7.5, -1, "8", 2**63 - 1], "do_sample": ["yes", 1]}
    for key, values in generation.items():
        for value in values:
            must = REFUSE if not (key == "max_new_tokens" and value == 2**63 - 1) else ANY
            cases.append((f"generation {key}={value!r}", tinf_case(with_value(seed, ("generation", key), value)), must))
    cases.append(("generation not a map", tinf_case(with_metadata(seed, generation=[1])), REFUSE))
    run_each(pool, "6 reader and generation", cases)


# ------------------------------------------------------------------------ 7. converter inputs

def json_config(files: dict, **changes) -> dict:
    config = json.loads(files["config.json"])
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return {**files, "config.json": json.dumps(config).encode()}


def llama2c_v0(n_layers=2, seq_len=32, dim=64, hidden=96, n_heads=4, n_kv=2, vocab=64, body=True) -> bytes:
    header = struct.pack("<7i", dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len)
    if not body:
        return header
    kv = n_kv * dim // n_heads
    floats = vocab * dim + n_layers * (2 * dim + 2 * dim * dim + 2 * kv * dim + 3 * hidden * dim) + dim
    floats += seq_len * dim // n_heads
    rng = np.random.default_rng(0)
    return header + (rng.standard_normal(floats) * 0.05).astype(np.float32).tobytes()


def test_class_7_converter_inputs(pool, tmp_path):
    files = seed_hf_files()
    cases = [("hf seed", ("hf", files), ANY)]
    config_changes = {
        "num_hidden_layers": [10**9, 2**31 - 1, 2**63, "2", 2.0, True, None],
        "max_position_embeddings": [2**40, 2**24 + 1, 0, "64", None],
        "hidden_size": ["64", 64.5, 2**40, -64],
        "num_key_value_heads": [3.5, "2", 0, 3],
        "head_dim": ["16", 15, 2**40],
        "rms_norm_eps": ["x", [1e-5], -1, 1e999, True],
        "rope_theta": [[1], "1e4", -1, 1e999],
        "tie_word_embeddings": ["yes", 1],
        "rope_scaling": [{"rope_type": "llama3", "factor": True, "low_freq_factor": 1, "high_freq_factor": 4,
                          "original_max_position_embeddings": 1e999}, {"rope_type": "linear", "factor": "2"}, 5],
        "vocab_size": [2**40, "64"],
        "model_type": [["llama"], 5],
        "sliding_window": ["x", [1]],
    }
    for key, values in config_changes.items():
        for value in values:
            must = REFUSE if key != "sliding_window" else ANY   # a Llama config's sliding_window is never read
            cases.append((f"hf config {key}={str(value)[:30]}", ("hf", json_config(files, **{key: value})), must))
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    digits = ('{"hidden_size": ' + "9" * 5000 + "}").encode()
    for name in ("config.json", "tokenizer_config.json", "generation_config.json", "tokenizer.json"):
        cases.append((f"{name} nested 100000 deep", ("hf", {**files, name: deep}), REFUSE))
        cases.append((f"{name} with a 5000-digit number", ("hf", {**files, name: digits}), REFUSE))
    qwen_window = json_config(files, model_type="qwen2", use_sliding_window=True, layer_types=[5, 6],
                              max_window_layers="x")
    cases.append(("qwen2 layer types of the wrong type", ("hf", qwen_window), REFUSE))
    cases.append(("chat template list with a list name", ("hf", {**files, "tokenizer_config.json": json.dumps(
        {"chat_template": [{"name": ["default"], "template": "x"}]}).encode()}), ANY))
    cases.append(("generation defaults of the wrong type", ("hf", {**files, "generation_config.json": json.dumps(
        {"temperature": "hot", "top_k": 2.5, "do_sample": "yes", "max_new_tokens": 7.5}).encode()}), ANY))

    tokenizer = write_sentencepiece(tmp_path / "tok.model").read_bytes()
    cases.append(("llama2c seed", ("llama2c", (llama2c_v0(), tokenizer)), ANY))
    for name, binary in [("2^31-1 layers", llama2c_v0(n_layers=2**31 - 1, body=False)),
                         ("2^20 layers", llama2c_v0(n_layers=2**20, body=False)),
                         ("2^30 positions", llama2c_v0(seq_len=2**30, body=False)),
                         ("2^24+1 positions", llama2c_v0(seq_len=2**24 + 1, body=False)),
                         ("negative dim", llama2c_v0(dim=-64, body=False)),
                         ("huge dim", llama2c_v0(dim=2**30, body=False)),
                         ("truncated", llama2c_v0()[:-100]),
                         ("v1 version 7", struct.pack("<Ii", 0x616B3432, 7) + bytes(300))]:
        cases.append((f"llama2c {name}", ("llama2c", (binary, tokenizer)), REFUSE))

    gguf = seed_gguf()
    cases.append(("gguf seed", ("gguf", gguf), ANY))
    for key, value in [(b"llama.block_count", 2**31 - 1), (b"llama.block_count", 2**20),
                       (b"llama.context_length", 2**31), (b"llama.embedding_length", 2**31),
                       (b"llama.attention.head_count", 0), (b"tokenizer.ggml.bos_token_id", 2**31)]:
        cases.append((f"gguf {key.decode()}={value}", ("gguf", gguf_with_u32(gguf, key, value)), REFUSE))
    at = gguf.index(b"general.name") - 8
    cases.append(("gguf key length 2^63", ("gguf", gguf[:at] + struct.pack("<Q", 2**63) + gguf[at + 8:]), REFUSE))
    cases.append(("gguf tensor count 2^40", ("gguf", gguf[:8] + struct.pack("<Q", 2**40) + gguf[16:]), REFUSE))
    cases.append(("gguf kv count 2^40", ("gguf", gguf[:16] + struct.pack("<Q", 2**40) + gguf[24:]), REFUSE))
    run_each(pool, "7 converter inputs", cases)


def gguf_with_u32(data: bytes, key: bytes, value: int) -> bytes:
    """The GGUF file with the value of a uint32 key replaced (the key, then its type, then the value)."""
    at = data.index(key) + len(key)
    (value_type,) = struct.unpack_from("<I", data, at)
    width = {4: 4, 5: 4, 10: 8, 11: 8}[value_type]   # uint32, int32, uint64, int64
    return data[: at + 4] + value.to_bytes(width, "little") + data[at + 4 + width:]


# ------------------------------------------------------------------------ 8. integrity

def test_class_8_integrity(pool, seed, tmp_path):
    path = tmp_path / "m.tinf"
    cases = []
    metadata, _ = split_tinf(seed)
    for i, entry in enumerate(metadata["tensors"][:6]):
        path.write_bytes(seed)
        flip_byte(path, entry["name"], i * 7)
        cases.append((f"flipped byte in {entry['name']}", tinf_case(path.read_bytes()), REFUSE))
    run_each(pool, "8 integrity", cases)


# ------------------------------------------------------------------------ converter outputs

@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "ckpt"
    write_hf_llama(folder, dim=64, n_layers=1, vocab_size=64, shards=2)
    return folder


def convert(source, out, **kwargs):
    from tinyinfer.convert import convert_checkpoint

    return convert_checkpoint(source, out, quant="q8", progress=False, **kwargs)


def test_the_converter_never_writes_over_an_input(hf_folder, tmp_path):
    from tinyinfer.convert import ConvertError

    shard = sorted(hf_folder.glob("*.safetensors"))[0]
    before = shard.read_bytes()
    link = tmp_path / "link.safetensors"
    link.symlink_to(shard)
    for out in (shard, hf_folder / "config.json", link):
        for force in (False, True):
            with pytest.raises(ConvertError, match="checkpoint being converted|input of this conversion"):
                convert(hf_folder, out, force=force)
    assert shard.read_bytes() == before
    tokenizer = write_sentencepiece(tmp_path / "tok.model")
    binary = tmp_path / "model.bin"
    binary.write_bytes(llama2c_v0())
    for out in (binary, tokenizer):
        with pytest.raises(ConvertError, match="input of this conversion"):
            convert(binary, out, tokenizer=tokenizer, force=True)
    assert binary.read_bytes() == llama2c_v0()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(seed_gguf())
    with pytest.raises(ConvertError, match="input of this conversion"):
        convert(gguf, gguf, force=True)


def test_existing_outputs_tinf_replaced_others_only_with_force(hf_folder, tmp_path):
    from tinyinfer.convert import ConvertError
    from tinyinfer.formats import open_tinf

    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(ConvertError, match="--force"):
        convert(hf_folder, notes)
    assert notes.read_text() == "keep me"
    convert(hf_folder, notes, force=True)
    open_tinf(notes).close()
    out = tmp_path / "m.tinf"
    convert(hf_folder, out)
    convert(hf_folder, out)   # an existing .tinf is replaced without --force
    open_tinf(out).close()


def test_output_errors_are_one_sentence(hf_folder, tmp_path):
    from tinyinfer.convert import ConvertError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConvertError, match=r"^cannot write .*file/m.tinf \(.*\); check"):
        convert(hf_folder, blocker / "m.tinf")


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    import fcntl

    from tinyinfer.formats.tinf import remove_stale_temporaries

    out = tmp_path / "m.tinf"
    stale = tmp_path / "m.tinf.tmp-dead"
    stale.write_bytes(b"x" * 100)
    live = tmp_path / "m.tinf.tmp-live"
    live.write_bytes(b"y")
    other = tmp_path / "other.tinf.tmp-x"
    other.write_bytes(b"z")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)   # a writer still running
    try:
        remove_stale_temporaries(out)
    finally:
        os.close(fd)
    assert not stale.exists() and live.exists() and other.exists()


SLOW_CONVERSION = """
import sys, time
from tinyinfer.convert import pipeline
real = pipeline.encoded_tensor
def slow(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(0.5)
    return real(*args, **kwargs)
pipeline.encoded_tensor = slow
from tinyinfer.convert.cli import main
main([sys.argv[1], "-o", sys.argv[2], "--quant", "q8"])
"""


def test_sigterm_removes_the_temporary_file(hf_folder, tmp_path):
    out = tmp_path / "m.tinf"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERSION, str(hf_folder), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert list(tmp_path.glob("m.tinf.tmp-*"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp_path.glob("m.tinf.tmp-*")) and not out.exists()
