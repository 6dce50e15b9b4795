"""tinyrun: streaming, flags, chat, info, and one-sentence errors without tracebacks."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tinyinfer.runtime import load
from tinyinfer.runtime.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tinyinfer.convert import convert_checkpoint

    spec = importlib.util.spec_from_file_location("demo_offline", REPO / "examples" / "demo_offline.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo.write_random_checkpoint(tmp_path_factory.mktemp("cli") / "random", max_context=128)
    return convert_checkpoint(folder, out=folder.parent / "random-q4.tinf", quant="q4", progress=False)


def tinyrun(capsys, *args):
    """Run main(args); return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_prompt_streams_the_same_text_as_the_api(model_path, capsys):
    code, out, err = tinyrun(capsys, model_path, "--prompt", "the cat", "-n", "20", "--temperature", "0.9",
                             "--top-k", "40", "--top-p", "0.95", "--min-p", "0.01", "--repeat-penalty", "1.1",
                             "--seed", "3", "--device", "cpu")
    expected = "".join(load(model_path, device="cpu").generate(
        "the cat", max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=3))
    assert code == 0
    assert out == expected + "\n"
    assert "tokens/s" in err


def test_quiet_and_seed(model_path, capsys):
    runs = [tinyrun(capsys, model_path, "-p", "hi", "-n", "15", "--temp", "1", "--seed", "5", "-q") for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] == 0 and runs[0][2] == ""


def test_stop_string_is_not_printed(model_path, capsys):
    _, full, _ = tinyrun(capsys, model_path, "-p", "the", "-n", "30", "-q")
    stop = full.strip()[5:8]
    assert stop and stop in full
    code, out, _ = tinyrun(capsys, model_path, "-p", "the", "-n", "30", "-q", "--stop", stop)
    assert code == 0 and out == full[: full.index(stop)] + "\n"


def test_chat_flag_and_stdin_prompt(model_path, capsys, monkeypatch):
    model = load(model_path, device="cpu")
    expected = "".join(model.generate("hello", chat=True, system="Be brief.", max_tokens=10))
    code, out, _ = tinyrun(capsys, model_path, "-p", "hello", "--chat", "--system", "Be brief.", "-n", "10", "-q")
    assert code == 0 and out == expected + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat"))     # not a terminal: the prompt comes from stdin
    _, from_stdin, _ = tinyrun(capsys, model_path, "-n", "10", "-q")
    _, from_flag, _ = tinyrun(capsys, model_path, "-p", "the cat", "-n", "10", "-q")
    assert from_stdin == from_flag


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_interactive_chat_keeps_the_conversation(model_path, capsys, monkeypatch):
    from tinyinfer.runtime.model import Model

    seen = []
    original = Model.generate

    def spy(self, prompt, **kwargs):
        seen.append([dict(m) for m in prompt])
        return original(self, prompt, **kwargs)

    monkeypatch.setattr(Model, "generate", spy)
    monkeypatch.setattr(sys, "stdin", FakeTerminal("first question\n\nsecond question\n"))
    code, out, err = tinyrun(capsys, model_path, "-n", "6", "--system", "sys", "-q")
    assert code == 0 and "Interactive chat" in err
    assert [m["role"] for m in seen[0]] == ["system", "user"]
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[1][2]["content"] and seen[1][2]["content"] in out     # the first reply, as printed
    assert seen[1][3]["content"] == "second question"


def test_info(model_path, capsys):
    code, out, _ = tinyrun(capsys, "info", model_path)
    assert code == 0
    for needle in ["dim=64", "n_layers=2", "hf-json", "template present", "quant=q4", "layers.*.wqkv", "q4 g32",
                   "f16", "bits/weight", "weights in all tensors", "source="]:
        assert needle in out, needle


def one_sentence_error(code, out, err):
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_user_errors_print_one_sentence(model_path, tmp_path, capsys):
    one_sentence_error(*tinyrun(capsys, tmp_path / "missing.tinf", "-p", "x"))
    corrupt = tmp_path / "corrupt.tinf"
    corrupt.write_bytes(b"TINYINF\0" + b"\xff" * 100)
    one_sentence_error(*tinyrun(capsys, corrupt, "-p", "x"))
    one_sentence_error(*tinyrun(capsys, "info", corrupt))
    one_sentence_error(*tinyrun(capsys, model_path, "-p", "x", "-n", "500"))          # context overflow
    from tinyinfer.runtime.model import cuda_backend_class

    if cuda_backend_class()[0] is None:
        code, out, err = tinyrun(capsys, model_path, "-p", "x", "--device", "cuda")
        one_sentence_error(code, out, err)
        assert "No CUDA GPU" in err


def test_chat_without_template_is_one_sentence(model_path, capsys, monkeypatch):
    from tinyinfer.runtime.model import Model

    monkeypatch.setattr(Model, "__init__", wrap_init(Model.__init__))
    one_sentence_error(*tinyrun(capsys, model_path, "-p", "x", "--chat"))
    monkeypatch.setattr(sys, "stdin", FakeTerminal(""))
    code, out, err = tinyrun(capsys, model_path)
    assert code == 1 and "cannot chat" in err


def wrap_init(init):
    def without_template(self, *args):
        init(self, *args)
        self.chat_template = None
    return without_template


def test_bench_and_verify_are_wired(model_path, capsys, monkeypatch, tmp_path):
    calls = {}
    bench = types.ModuleType("tinyinfer.runtime.bench")
    bench.run_bench = lambda model, n, prompt_len=16, reps=3, json_path=None: calls.setdefault(
        "bench", (type(model).__name__, n, prompt_len, reps, json_path)) and {"tokens_per_s": 1.0}
    verify = types.ModuleType("tinyinfer.runtime.verify")
    verify.run_verify = lambda path, n: calls.setdefault("verify", (Path(path), n)) and {"ok": True}
    monkeypatch.setitem(sys.modules, "tinyinfer.runtime.bench", bench)
    monkeypatch.setitem(sys.modules, "tinyinfer.runtime.verify", verify)
    json_file = tmp_path / "bench.json"
    code, out, _ = tinyrun(capsys, model_path, "--bench", "7", "--json", json_file, "--device", "cpu")
    assert code == 0 and calls["bench"] == ("Model", 7, 16, 3, str(json_file)) and "tokens_per_s" in out
    code, out, _ = tinyrun(capsys, model_path, "--verify", "4")
    assert code == 0 and calls["verify"] == (model_path, 4) and '"ok": true' in out


def test_real_process_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tinyinfer.runtime.cli", str(tmp_path / "nope.tinf")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("error: No model file at") and "Traceback" not in result.stderr
