"""tinyrun list, pull and rm through the installed script, against the FakeHub on 127.0.0.1 and a
Hugging Face cache in a temporary HF_HOME (nothing reaches the network)."""

from __future__ import annotations

import os

import pytest

from console_scripts import run  # noqa: E402
from fake_hub import FakeHub, hub_env, write_cached_repo  # noqa: E402
from tinf_samples import write_tiny_tinf  # noqa: E402

COMMIT, OLD = "c" * 40, "d" * 40


def tinyrun(env, *args, input=None):
    return run("tinyrun", *args, env={**env, "TINYINFER_MODELS": env.get("TINYINFER_MODELS", "")}, input=input)


def one_sentence_error(result, *needles):
    assert result.returncode == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


def test_pull_then_list_then_rm(hub, tmp_path):
    data = write_tiny_tinf(tmp_path / "m.tinf").read_bytes()
    hub.add_repo("org/tiny", {"tiny-q4.tinf": data, "README.md": b"# card\n"})
    env = hub_env(tmp_path / "hf", endpoint=hub.url)
    pulled = tinyrun(env, "pull", "org/tiny")
    assert pulled.returncode == 0, pulled.stderr
    assert "pulled org/tiny" in pulled.stdout and "run it with: tinyrun org/tiny" in pulled.stdout
    cached = list((tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots").glob("*/tiny-q4.tinf"))
    assert len(cached) == 1 and cached[0].read_bytes() == data

    listed = tinyrun(env, "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "QUANT", "MODIFIED"]
    assert row.split()[:4] == ["org/tiny/tiny-q4.tinf", f"{len(data) / 2**20:.1f}", "MiB", "q4"]

    refused = tinyrun(env, "rm", "org/tiny")                       # no terminal to ask on
    one_sentence_error(refused, "pass --yes")
    assert cached[0].exists()
    removed = tinyrun(env, "rm", "org/tiny", "--yes")
    assert removed.returncode == 0 and "removed org/tiny from the Hugging Face cache (tiny-q4.tinf" in removed.stdout
    assert not cached[0].exists()
    assert tinyrun(env, "list").stdout == ""
    one_sentence_error(tinyrun(env, "rm", "org/tiny", "-y"), "not in the Hugging Face cache")


def test_rm_of_one_file_keeps_the_others(tmp_path):
    cache = tmp_path / "hf" / "hub"
    a = write_tiny_tinf(tmp_path / "a.tinf", seed=1).read_bytes()
    b = write_tiny_tinf(tmp_path / "b.tinf", seed=2).read_bytes()
    snapshot = write_cached_repo(cache, "org/two", {"a-q4.tinf": a, "q8/b-q8.tinf": b}, COMMIT)
    old = write_cached_repo(cache, "org/two", {"a-q4.tinf": b}, OLD, refs=("v0",))
    env = hub_env(tmp_path / "hf", offline=True)
    names = [line.split()[0] for line in tinyrun(env, "list").stdout.splitlines()[1:]]
    assert sorted(names) == sorted(["org/two/a-q4.tinf", "org/two/q8/b-q8.tinf", f"hf://org/two/a-q4.tinf@{OLD}"])
    result = tinyrun(env, "rm", "org/two/q8/b-q8.tinf", "--yes")
    assert result.returncode == 0, result.stderr
    assert not (snapshot / "q8" / "b-q8.tinf").exists() and (snapshot / "a-q4.tinf").read_bytes() == a
    assert (old / "a-q4.tinf").exists()
    result = tinyrun(env, "rm", "hf://org/two@v0", "--yes")          # one revision
    assert result.returncode == 0 and not old.exists() and (snapshot / "a-q4.tinf").exists()
    write_cached_repo(cache, "org/checkpoint", {"config.json": b"{}"}, COMMIT)
    one_sentence_error(tinyrun(env, "rm", "org/checkpoint", "--yes"), "holds no .tinf file", "hf cache")
    assert (cache / "models--org--checkpoint" / "snapshots" / COMMIT / "config.json").exists()


def test_list_local_folders_and_rm_a_local_file(tmp_path):
    env = hub_env(tmp_path / "hf", offline=True)
    one, two = tmp_path / "models", tmp_path / "more"
    write_tiny_tinf(one / "sub" / "x-q4.tinf")
    write_tiny_tinf(two / "y.tinf")
    (one / "notes.txt").parent.mkdir(exist_ok=True)
    (one / "notes.txt").write_text("not a model")
    empty = tinyrun(env, "list")
    assert empty.returncode == 0 and empty.stdout == "" and "No .tinf models" in empty.stderr
    listed = tinyrun({**env, "TINYINFER_MODELS": str(two)}, "list", "--dir", one)
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == [str(one / "sub" / "x-q4.tinf"),
                                                                             str(two / "y.tinf")]
    fake = tmp_path / "fake.tinf"
    fake.write_text("not a model")
    one_sentence_error(tinyrun(env, "rm", fake, "--yes"), "is not a .tinf file")
    assert fake.exists()
    removed = tinyrun(env, "rm", two / "y.tinf", "--yes")
    assert removed.returncode == 0 and not (two / "y.tinf").exists()
    one_sentence_error(tinyrun(env, "rm", two / "y.tinf", "--yes"), "No file at")


def test_pull_errors_are_one_sentence(tmp_path):
    env = hub_env(tmp_path / "hf", offline=True)
    write_tiny_tinf(tmp_path / "local.tinf")
    one_sentence_error(run("tinyrun", "pull", tmp_path / "local.tinf", env=env), "is not a Hub reference")
    one_sentence_error(run("tinyrun", "pull", "org/absent", env=env), "not in the Hugging Face cache")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_rm_asks_on_a_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    from console_scripts import script

    path = write_tiny_tinf(tmp_path / "m.tinf")
    env = hub_env(tmp_path / "hf", offline=True)
    child = pexpect.spawn(script("tinyrun"), ["rm", str(path)], env=env, encoding="utf-8", timeout=30)
    child.expect(r"Remove .*m\.tinf .*\? \[y/N\]")
    child.sendline("n")
    child.expect(pexpect.EOF)
    assert path.exists() and "nothing removed" in child.before
    child = pexpect.spawn(script("tinyrun"), ["rm", str(path)], env=env, encoding="utf-8", timeout=30)
    child.expect(r"\[y/N\]")
    child.sendline("y")
    child.expect(pexpect.EOF)
    assert not path.exists()
