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


# ------------------------------------------------------------------------------------------ tinyrun

@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    import importlib.util
    from pathlib import Path

    from tinyinfer.convert import convert_checkpoint

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("demo_offline", repo / "examples" / "demo_offline.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo.write_random_checkpoint(tmp_path_factory.mktemp("flags") / "random", max_context=128)
    return convert_checkpoint(folder, out=folder.parent / "random-q4.tinf", quant="q4", progress=False)


def tinyrun(*args, **kwargs):
    return run("tinyrun", *args, **kwargs)


def test_tinyrun_version():
    result = tinyrun("--version")
    assert result.returncode == 0 and result.stdout == f"tinyrun {VERSION}\n"


def test_llama_cpp_spellings_equal_the_long_names(model_path):
    sample = ["-p", "the cat", "--top-k", "40", "--device", "cpu", "-q"]
    long = tinyrun(model_path, *sample, "--temperature", "0.9", "--seed", "3", "--max-tokens", "12")
    assert long.returncode == 0 and long.stdout.strip()
    for spelling in (["--temp", "0.9", "-s", "3", "-n", "12"], ["--temp", "0.9", "--seed", "3", "--n-predict", "12"]):
        assert tinyrun(model_path, *sample, *spelling).stdout == long.stdout
    assert tinyrun(model_path, *sample, "--temp", "0.9", "-s", "4", "-n", "12").stdout != long.stdout


def test_t_is_threads_not_temperature(model_path):
    greedy = tinyrun(model_path, "-p", "the cat", "-n", "10", "--device", "cpu", "-q")
    threads = tinyrun(model_path, "-p", "the cat", "-n", "10", "--device", "cpu", "-q", "-t", "1", "--verbose")
    assert threads.returncode == 0 and threads.stdout == greedy.stdout
    assert "1 BLAS threads" in threads.stderr
    two = tinyrun(model_path, "-p", "x", "-n", "1", "--device", "cpu", "-t", "2", "--verbose")
    assert "2 BLAS threads" in two.stderr
    bad = tinyrun(model_path, "-p", "x", "-t", "0.7")
    assert bad.returncode == 2 and "--threads" in bad.stderr and "'0.7' is not a valid integer" in bad.stderr


def test_ctx_size_limits_the_context(model_path):
    result = tinyrun(model_path, "-p", "the cat", "-n", "5", "--device", "cpu", "-c", "32")
    assert result.returncode == 0 and "/32]" in result.stderr
    over = tinyrun(model_path, "-p", "the cat", "-n", "40", "--device", "cpu", "-c", "32")
    one_sentence_error(over, "plus -n 40 new tokens exceeds the context of 32 tokens", "lower -n to at most",
                       "raise -c")
    whole = tinyrun(model_path, "-p", "the cat", "-n", "5", "--device", "cpu", "-c", "0")
    assert "/128]" in whole.stderr
    beyond = tinyrun(model_path, "-p", "the cat", "-n", "5", "--device", "cpu", "-c", "4096")
    assert "-c 4096 is beyond the model's context of 128 tokens; using 128." in beyond.stderr


def test_file_prompt_and_its_conflict_with_p(model_path, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat")
    from_flag = tinyrun(model_path, "-p", "the cat sat", "-n", "8", "--device", "cpu", "-q")
    assert tinyrun(model_path, "-f", prompt, "-n", "8", "--device", "cpu", "-q").stdout == from_flag.stdout
    assert tinyrun(model_path, "--file", "-", "-n", "8", "--device", "cpu", "-q", input="the cat sat").stdout \
        == from_flag.stdout
    both = tinyrun(model_path, "-f", prompt, "-p", "x")
    assert both.returncode == 2 and "not both" in both.stderr


def test_verbose_prompt_shows_the_rendered_chat_and_its_tokens(model_path):
    from tinyinfer.runtime import load

    result = tinyrun(model_path, "-p", "hello", "--chat", "--system-prompt", "Be brief.", "-n", "3",
                     "--device", "cpu", "--verbose-prompt")
    ids = load(model_path, device="cpu").prompt_ids("hello", chat=True, system="Be brief.")
    assert result.returncode == 0
    assert f"--- prompt, {len(ids)} tokens ---\n<s><|system|>\nBe brief.</s>\n<|user|>\nhello</s>\n<|assistant|>\n" \
        in result.stderr
    assert f"--- token ids: {' '.join(map(str, ids))}\n" in result.stderr


def test_weight_cache_size(model_path):
    none = tinyrun(model_path, "-p", "x", "-n", "2", "--device", "cpu", "--verbose", "--weight-cache", "0")
    assert none.returncode == 0 and "0 MiB cached (budget 0 MiB)" in none.stderr
    assert "dequantized per use" in none.stderr
    some = tinyrun(model_path, "-p", "x", "-n", "2", "--device", "cpu", "--verbose", "--weight-cache", "1.5G")
    assert "(budget 1536 MiB)" in some.stderr and "dequantized per use" not in some.stderr
    assert none.stdout == some.stdout
    bad = tinyrun(model_path, "-p", "x", "--weight-cache", "lots")
    assert bad.returncode == 2 and "is not a size" in bad.stderr


def test_the_cpu_fallback_says_so_once(model_path):
    from tinyinfer.runtime.model import cuda_backend_class

    if cuda_backend_class()[0] is not None:
        pytest.skip("a GPU is present: --device auto does not fall back")
    auto = tinyrun(model_path, "-p", "x", "-n", "2")
    notes = [line for line in auto.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "no usable CUDA GPU" in notes[0] and "tokens/s for this model" in notes[0]
    assert "note:" not in tinyrun(model_path, "-p", "x", "-n", "2", "--device", "cpu").stderr
    assert tinyrun(model_path, "-p", "x", "-n", "2", "-q").stderr == ""


def test_bench_runs_on_the_cpu(model_path, tmp_path):
    import json

    out = tmp_path / "bench.json"
    result = tinyrun(model_path, "--bench", "6", "--device", "cpu", "--json", out, "-t", "1")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["backend"] == "numpy" and report["n_tokens"] == 6 and report["blas_threads"] == 1
    assert report["tok_s"] > 0 and len(report["runs_tok_s"]) == 3 and report["cores"] >= 1
    assert "tok/s" in result.stderr and "load average" in result.stderr
