"""The chat's commands (/set, /show, /clear, /?, the ways out) and its messages, in-process: stdin is a
terminal-like text, so lines come through input() (the pseudo-terminal tests cover prompt_toolkit)."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

from tinyinfer.runtime.cli import main
from tinyinfer.runtime.model import Model
from tinyinfer.runtime.repl import open_block, strip_quotes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tinyinfer.convert import convert_checkpoint

    spec = importlib.util.spec_from_file_location("demo_offline", REPO / "examples" / "demo_offline.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo.write_random_checkpoint(tmp_path_factory.mktemp("repl") / "random", max_context=128)
    return convert_checkpoint(folder, out=folder.parent / "random-q4.tinf", quant="q4", progress=False)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def calls(monkeypatch):
    """Every Model.generate call as (messages, keyword arguments)."""
    seen, original = [], Model.generate

    def spy(self, prompt, **kwargs):
        seen.append(([dict(m) for m in prompt], kwargs))
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Model, "generate", spy)
    return seen


def chat(model_path, capsys, monkeypatch, lines, *args):
    monkeypatch.setattr(sys, "stdin", FakeTerminal("".join(line + "\n" for line in lines)))
    with pytest.raises(SystemExit) as exit_info:
        main([str(model_path), "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_set_parameter_takes_ollamas_names(model_path, capsys, monkeypatch, calls):
    settings = ["temperature 0.5", "top_k 5", "top_p 0.9", "min_p 0.1", "repeat_penalty 1.2", "seed 7",
                "num_predict 3", "stop xyz QQ"]
    lines = [f"/set parameter {s}" for s in settings] + ["hi", "/bye", "never sent"]
    code, out, _ = chat(model_path, capsys, monkeypatch, lines)
    assert code == 0 and len(calls) == 1
    assert calls[0][1] == {"chat": True, "max_tokens": 3, "temperature": 0.5, "top_k": 5, "top_p": 0.9,
                           "min_p": 0.1, "repetition_penalty": 1.2, "seed": 7, "stop": ["xyz", "QQ"]}
    assert out.count("Set parameter") == len(settings)
    _, out, _ = chat(model_path, capsys, monkeypatch, ["/set parameter max_tokens 2", "/set parameter temp 0",
                                                       "/show parameters", "/quit"])
    assert "num_predict     2" in out and "temperature     0.0" in out


def test_bad_parameters_are_refused_and_change_nothing(model_path, capsys, monkeypatch, calls):
    lines = ["/set parameter top_p 7", "/set parameter seed x", "/set parameter bogus 1", "/set parameter",
             "/set parameter num_predict -1", "/set parameter num_ctx 4096", "hi", "exit"]
    code, out, _ = chat(model_path, capsys, monkeypatch, lines, "-n", "2")
    assert code == 0 and calls[0][1]["top_p"] is None and calls[0][1]["seed"] is None
    assert "top_p must be in (0, 1]" in out and "'x' is not an integer" in out
    assert out.count("Usage: /set parameter NAME VALUE") == 2 and "num_predict must be >= 0" in out
    assert "is set when the model loads; restart with -c N" in out


def test_system_clear_show_and_help(model_path, capsys, monkeypatch, calls):
    lines = ["first", "/set system You are terse.", "second", "/show system", "/show info", "/show template",
             "/clear", "third", "/?", "/nonsense", "/show"]
    code, out, err = chat(model_path, capsys, monkeypatch, lines, "-n", "2")   # ends with EOF (Ctrl-D)
    assert code == 0
    first, second, third = (messages for messages, _ in calls)
    assert first == [{"role": "user", "content": "first"}]
    assert second[0] == {"role": "system", "content": "You are terse."} and second[1] == first[0]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert third == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "third"}]
    assert "You are terse." in out and "backend        NumPy (CPU)" in out and "bits/weight" in out
    assert "{% for m in messages %}" in out and "Cleared the conversation." in out
    assert "/set parameter NAME VALUE" in out and "Unknown command '/nonsense'" in out and "Usage: /show" in out
    assert err.count("context ") == 3          # one stats line per reply


def test_multiline_message_between_triple_quotes(model_path, capsys, monkeypatch, calls):
    code, _, _ = chat(model_path, capsys, monkeypatch, ['"""first line', "", "second line", '"""', "/bye"], "-n", "2")
    assert code == 0 and calls[0][0] == [{"role": "user", "content": "first line\n\nsecond line"}]
    assert open_block('"""') and open_block('"""a\nb') and not open_block('"""a"""') and not open_block("a")
    assert strip_quotes('"""\nx\ny\n"""') == "x\ny" and strip_quotes("plain") == "plain"


def test_overflow_names_num_predict_or_the_conversation(model_path, capsys, monkeypatch, calls):
    code, _, err = chat(model_path, capsys, monkeypatch, ["hi", "/set parameter num_predict 4", "hi"], "-n", "200")
    assert code == 0 and len(calls) == 2
    assert "plus num_predict 200 new tokens exceeds the context of 128 tokens" in err
    assert "/set parameter num_predict" in err and "/clear" in err
    assert "[4 tokens" in err                      # after lowering it, the same message goes through
    code, _, err = chat(model_path, capsys, monkeypatch, ["word " * 60, "/bye"], "-c", "32")
    assert "The conversation is" in err and "leaves no room in the context of 32 tokens" in err
    assert "/clear starts a new conversation, or restart with a larger -c (the model allows 128)" in err


def test_control_characters_of_a_reply_are_shown_inert():
    from tinyinfer.runtime.repl import on_screen

    assert on_screen("a\x1b[2Jb\tc\nd\x07\x9b") == "a\ufffd[2Jb\tc\nd\ufffd\ufffd"
    assert on_screen("naïve — 東京") == "naïve — 東京"
