"""The interactive chat through a real pseudo-terminal (pexpect), as a user types into it: streaming,
Ctrl-C in the middle of a reply and a next turn that sees it, history recall with the arrow keys,
multi-line messages, /clear, and the ways out. Every wait is bounded."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from console_scripts import script  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.repl import on_screen  # noqa: E402

pexpect = pytest.importorskip("pexpect")

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 30
STATS = r"context \d+/\d+\]"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
UP = "\x1b[A"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tinyinfer.convert import convert_checkpoint

    spec = importlib.util.spec_from_file_location("demo_offline", REPO / "examples" / "demo_offline.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo.write_random_checkpoint(tmp_path_factory.mktemp("pty") / "random", max_context=512)
    return convert_checkpoint(folder, out=folder.parent / "random-q8.tinf", quant="q8", progress=False)


class Terminal:
    """A tinyrun chat in a pseudo-terminal; `screen` is everything it printed, without colour codes."""

    def __init__(self, command: list[str], tmp_path: Path, env: dict | None = None):
        env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "PROMPT_TOOLKIT_NO_CPR": "1",
               "TERM": "xterm", **(env or {})}
        self.child = pexpect.spawn(command[0], command[1:], env=env, encoding="utf-8", timeout=TIMEOUT,
                                   dimensions=(50, 250))
        self.output = []
        self.child.logfile_read = self

    def write(self, text):       # pexpect's logfile: keep what the child printed
        self.output.append(text)

    def flush(self):
        pass

    @property
    def screen(self) -> str:
        return ANSI.sub("", "".join(self.output)).replace("\r\n", "\n")

    def expect(self, pattern):
        self.child.expect(pattern)

    def prompt(self):
        self.child.expect(">>>")

    def say(self, line: str):
        """Type a message and wait for its reply's stats line and the next prompt."""
        self.child.sendline(line)
        self.child.expect(STATS)
        self.prompt()

    def close(self) -> int:
        self.child.expect(pexpect.EOF)
        self.child.close()
        return self.child.exitstatus


def prompts(screen: str) -> list[str]:
    """The --verbose-prompt blocks: each turn's rendered conversation."""
    return re.findall(r"--- prompt, \d+ tokens ---\n(.*?)\n--- token ids:", screen, re.S)


def chat(model_path, tmp_path, *args, env=None) -> Terminal:
    term = Terminal([script("tinyrun"), str(model_path), "--device", "cpu", *args], tmp_path, env)
    term.prompt()
    return term


def test_streams_the_reply_and_leaves_with_bye(model_path, tmp_path):
    term = chat(model_path, tmp_path, "-n", "12")
    term.say("hello there")
    expected = "".join(load(model_path, device="cpu").generate([{"role": "user", "content": "hello there"}],
                                                               max_tokens=12))
    assert "\n" + expected + "\n[12 tokens" in term.screen
    term.child.sendline("/bye")
    assert term.close() == 0


def test_history_recall_multiline_and_clear(model_path, tmp_path):
    term = chat(model_path, tmp_path, "-n", "4", "--verbose-prompt")
    term.say("hello there")
    term.child.send(UP)                        # recalls "hello there"
    term.say("")
    term.child.sendline('"""')
    term.child.sendline("line one")
    term.say('line two"""')
    term.child.sendline("/clear")
    term.expect("Cleared")
    term.prompt()
    term.say("fresh start")
    term.child.sendeof()                       # Ctrl-D leaves
    assert term.close() == 0
    turns = prompts(term.screen)
    assert len(turns) == 4
    assert turns[1].count("<|user|>\nhello there</s>") == 2         # the recalled line, sent again
    assert "<|user|>\nline one\nline two</s>" in turns[2] and turns[2].count("<|user|>") == 3
    assert "hello there" not in turns[3] and turns[3].count("<|user|>") == 1 and "fresh start" in turns[3]
    # History outlives the process: a new chat recalls the last message with the arrow key.
    again = chat(model_path, tmp_path, "-n", "4", "--verbose-prompt")
    again.child.send(UP)
    again.say("")
    again.child.sendeof()
    assert again.close() == 0
    assert "<|user|>\nfresh start</s>" in prompts(again.screen)[0]


def test_ctrl_c_on_an_empty_line_says_how_to_leave(model_path, tmp_path):
    term = chat(model_path, tmp_path, "-n", "4")
    term.child.sendintr()
    term.expect("Use Ctrl \\+ d or /bye to exit.")
    term.prompt()
    term.child.send("half typed")
    term.child.sendintr()                      # clears the line instead (else "half typedexit" is sent)
    term.child.sendline("exit")                # leaves; never sent to the model
    assert term.close() == 0
    assert "tokens in" not in term.screen
    assert term.screen.count("Use Ctrl + d") == 1


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ctrl_c_mid_reply_keeps_the_turn_and_the_cache(model_path, tmp_path):
    log = tmp_path / "log.jsonl"
    command = [sys.executable, str(REPO / "tests" / "slow_tinyrun.py"), str(model_path), "--device", "cpu",
               "-n", "200"]
    term = Terminal(command, tmp_path, {"SLOW_TINYRUN_LOG": str(log), "SLOW_TINYRUN_DELAY": "0.05"})
    term.prompt()
    term.child.sendline("Once upon a time")
    deadline = time.monotonic() + TIMEOUT     # until a few chunks have streamed (200 take 10 s)
    while sum("chunk" in r for r in read_log(log)) < 4:
        assert time.monotonic() < deadline, "the reply did not start"
        time.sleep(0.02)
    term.child.sendintr()
    term.expect(STATS)
    term.prompt()
    term.say("and then?")
    term.child.sendline("/bye")
    assert term.close() == 0

    records = read_log(log)
    first, second = ([r for r in records if r["call"] == n] for n in (1, 2))
    partial = "".join(r["chunk"] for r in first if "chunk" in r)
    first_stats, second_stats = first[-1]["stats"], second[-1]["stats"]
    assert second[0]["messages"] == [{"role": "user", "content": "Once upon a time"},
                                     {"role": "assistant", "content": partial},
                                     {"role": "user", "content": "and then?"}]
    shown = term.screen.replace("^C", "", 1)           # the terminal's own echo of Ctrl-C, wherever it landed
    assert partial and on_screen(partial) in shown       # the user saw what became the assistant's turn
    fresh = load(model_path, device="cpu")
    full = "".join(fresh.generate(second[0]["messages"][:1], max_tokens=200))
    assert full.startswith(partial) and len(partial) < len(full) and first_stats["new_tokens"] < 200
    # The second turn reused the first turn's K/V from the cache, and answers as a fresh model does.
    assert second_stats["reused_tokens"] >= first_stats["prompt_tokens"]
    reply = "".join(r["chunk"] for r in second if "chunk" in r)
    assert reply == "".join(fresh.generate(second[0]["messages"], max_tokens=200))
