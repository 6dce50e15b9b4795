"""The llama.cpp/Ollama spellings and new options of tinyrun and tinyconvert, through the installed scripts."""

from __future__ import annotations

import importlib.metadata

import pytest

from console_scripts import run  # noqa: E402
from tinf_samples import write_tiny_tinf  # noqa: E402

VERSION = importlib.metadata.version("tinyinfer")


def one_sentence_error(result, *needles):
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


# ------------------------------------------------------------------------------------- tinyconvert

def test_tinyconvert_version():
    result = run("tinyconvert", "--version")
    assert result.returncode == 0 and result.stdout == f"tinyconvert {VERSION}\n"


def test_tinyconvert_of_a_tinf_file_says_it_is_one(tmp_path):
    path = write_tiny_tinf(tmp_path / "model.tinf")
    renamed = tmp_path / "model.bin"                      # recognised by its content, not its name
    renamed.write_bytes(path.read_bytes())
    for source in (path, renamed):
        result = run("tinyconvert", source)
        one_sentence_error(result, "is already a .tinf file", f"tinyrun {source}")
        assert "--tokenizer" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "model.tinf"]
