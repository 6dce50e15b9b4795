"""The generated model card: every fact it states is checked against the file, computed independently."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import yaml

from tinf_samples import PROVENANCE, TENSORS, write_tiny_tinf  # noqa: E402
from tinyinfer.convert import model_card as card_module  # noqa: E402
from tinyinfer.convert.model_card import file_sha256, model_card  # noqa: E402
from tinyinfer.formats import FormatError, tensor_nbytes  # noqa: E402

REPO = "someone/tiny-llama-tinf"


def split_card(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    front, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def table(body: str) -> dict[str, str]:
    """The | key | value | rows of the card's file table."""
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 2 and cells[0]:
            rows[cells[0]] = cells[1]
    return rows


def expected_bits(encodings=None) -> float:
    """Bits per weight from the spec's size formula, independent of the reader."""
    items = [(shape, enc, group) for shape, enc, group in TENSORS.values() if encodings is None or enc in encodings]
    n_bytes = sum(tensor_nbytes(enc, shape, group) for shape, enc, group in items)
    n_weights = sum(int(np.prod(shape)) for shape, _, _ in items)
    return 8 * n_bytes / n_weights


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_tinf(tmp_path / "tiny-llama-q4.tinf")


def test_front_matter_copies_license_and_names_the_base_model(tiny):
    meta, _ = split_card(model_card(tiny, REPO))
    assert meta == {"license": "apache-2.0", "base_model": PROVENANCE["source"],
                    "base_model_relation": "quantized", "tags": ["tinyinfer", "tinf", "q4"]}


def test_every_fact_in_the_table_matches_the_file(tiny):
    _, body = split_card(model_card(tiny, REPO))
    rows = table(body)
    data = tiny.read_bytes()
    assert rows["file"] == "`tiny-llama-q4.tinf`"
    assert rows["size"] == f"{len(data)} bytes ({len(data) / 2**20:.1f} MiB)"
    assert rows["sha256"] == f"`{hashlib.sha256(data).hexdigest()}`"
    assert rows["quantization"] == "q4, group size 32, clipping search"
    assert rows["bits per weight"] == (f"{expected_bits():.2f} over all tensors (embeddings and norms included), "
                                       f"{expected_bits({'q4'}):.2f} in the quantized layers (scales included)")
    n_weights = sum(int(np.prod(shape)) for shape, _, _ in TENSORS.values())
    assert rows["weights"] == f"{n_weights:,} (llama, context 128)"
    assert rows["source model"] == f"`{PROVENANCE['source']}`"
    assert rows["source revision"] == f"`{PROVENANCE['revision']}`"
    assert rows["license"] == "`apache-2.0`, copied from the source model; the source's terms apply"
    assert rows["converted by"] == "tinyinfer 0.1.0, 2026-11-30T12:00:00Z"


def test_the_exact_run_command_and_check_commands(tiny, tmp_path):
    _, body = split_card(model_card(tiny, REPO))
    assert f'\ntinyrun {REPO}/tiny-llama-q4.tinf --prompt "Once upon a time"\n' in body
    assert f"\ntinyrun info {REPO}/tiny-llama-q4.tinf --check" in body
    assert "\nsha256sum tiny-llama-q4.tinf " in body
    chat = write_tiny_tinf(tmp_path / "chat.tinf", chat_template="{{ messages }}")
    _, chat_body = split_card(model_card(chat, REPO))
    assert f'\ntinyrun {REPO}/chat.tinf --chat --prompt "Hello! Who are you?"\n' in chat_body


def test_a_local_source_without_license_names_neither(tmp_path):
    provenance = dict(PROVENANCE, source="/home/me/checkpoints/llama", revision=None, license=None,
                      quant="q8", scale_search=False)
    path = write_tiny_tinf(tmp_path / "local.tinf", provenance=provenance)
    meta, body = split_card(model_card(path, REPO))
    assert meta == {"tags": ["tinyinfer", "tinf", "q8"]}
    rows = table(body)
    assert rows["license"] == "not declared by the source; check the source model's terms"
    assert rows["source revision"] == "not recorded (converted from a local checkpoint)"
    assert rows["quantization"] == "q8, group size 32, max-abs scales"


def test_a_file_without_provenance_still_gets_a_card(tmp_path):
    path = write_tiny_tinf(tmp_path / "bare.tinf", provenance=None)
    meta, body = split_card(model_card(path, REPO))
    assert meta == {"tags": ["tinyinfer", "tinf"]}
    assert table(body)["quantization"] == "not recorded"
    assert "converted from `an unrecorded source`" in body


def test_yaml_values_cannot_inject_keys(tmp_path):
    odd = 'custom: "x"\nlicense_link: evil\n---\n# fake'
    path = write_tiny_tinf(tmp_path / "odd.tinf", provenance=dict(PROVENANCE, license=odd))
    meta, _ = split_card(model_card(path, REPO))
    assert meta["license"] == odd and "license_link" not in meta


def test_benchmarks_appear_only_when_the_file_carries_them(tiny, tmp_path):
    _, body = split_card(model_card(tiny, REPO))
    assert "## Benchmarks" not in body
    autotune = {
        "NVIDIA H200|sm_90|abc123": {"choices": {"matvec": 1}, "bench": {"decode_tok_s": 412.3456, "tokens": 128}},
        "NVIDIA A10|sm_86|abc123": {"choices": {"matvec": 2}},            # tuned, but not benchmarked
    }
    path = write_tiny_tinf(tmp_path / "bench.tinf", autotune=autotune)
    _, body = split_card(model_card(path, REPO))
    section = body.split("## Benchmarks", 1)[1].split("## ", 1)[0]
    assert "- `NVIDIA H200|sm_90|abc123`: decode_tok_s 412.3, tokens 128" in section
    assert "A10" not in section


def test_sha256_is_streamed_in_chunks(tiny, monkeypatch):
    monkeypatch.setattr(card_module, "SHA256_CHUNK", 1000)   # many chunks, the last one partial
    assert file_sha256(tiny) == hashlib.sha256(tiny.read_bytes()).hexdigest()


def test_a_given_sha256_is_used_as_is(tiny):
    _, body = split_card(model_card(tiny, REPO, sha256="f" * 64))
    assert table(body)["sha256"] == f"`{'f' * 64}`"


def test_the_card_refuses_an_invalid_file(tmp_path):
    bad = tmp_path / "bad.tinf"
    bad.write_bytes(b"not a tinf file at all, just text" * 10)
    with pytest.raises(FormatError, match="not a .tinf file"):
        model_card(bad, REPO)
