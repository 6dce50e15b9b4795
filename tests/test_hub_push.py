"""Publishing through the real huggingface_hub client against the FakeHub on 127.0.0.1 (HF_ENDPOINT).

Exercised here: create_repo, README.md YAML validation, preupload, the Git LFS batch + PUT + verify
upload of the .tinf (Xet is disabled with HF_HUB_DISABLE_XET=1, as the fake server cannot speak it),
the NDJSON commit, and a download of what was pushed. Not exercised: the Xet upload that the real
Hub uses when hf_xet is installed, and the real Hub's authentication and YAML rules.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_hub import WRITE_TOKEN, FakeHub, closed_port_url, hub_env  # noqa: E402
from tinf_samples import write_tiny_tinf  # noqa: E402
from tinyinfer.convert.model_card import model_card  # noqa: E402
from tinyinfer.convert.push import PushError, push_to_hub  # noqa: E402

# push_to_hub(FILE, REPO, private=bool(PRIVATE)) in a fresh process (HF_ENDPOINT is read at import);
# prints {"url"} or {"error", "message"}.
PUSH = """
import json, sys
from tinyinfer.formats import TinyInferError
from tinyinfer.convert.push import push_to_hub
path, repo, private = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    result = {"url": push_to_hub(path, repo, private=private, progress=False)}
except TinyInferError as e:
    result = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(result))
"""
RESOLVE = """
import sys
from tinyinfer.runtime.hub import resolve_model
print(resolve_model(sys.argv[1], token=sys.argv[2]))
"""


def push(env: dict, path, repo: str, private: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", PUSH, str(path), repo, "1" if private else "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hub_calls(hub: FakeHub) -> list[tuple[str, str]]:
    """The request log without huggingface_hub's own side requests (e.g. agent detection on 2.x)."""
    return [(m, p) for m, p in hub.log if not p.startswith("/api/agent")]


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_tinf(tmp_path / "tiny-q4.tinf")


def test_push_creates_the_repo_and_uploads_file_and_card_in_one_commit(hub, tiny, tmp_path):
    result = push(hub_env(tmp_path / "hf", endpoint=hub.url, token=WRITE_TOKEN), tiny, "me/tiny", private=True)
    repo = hub.repos["me/tiny"]
    assert result == {"url": f"{hub.url}/me/tiny/commit/{repo.head}"}
    assert repo.private
    data = tiny.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    assert set(repo.files) == {"tiny-q4.tinf", "README.md"}
    assert repo.files["tiny-q4.tinf"].lfs and repo.files["tiny-q4.tinf"].data == data
    assert hub.lfs_objects == {sha: data}     # the server checked the body against this sha256 on PUT
    assert repo.files["README.md"].data.decode() == model_card(tiny, "me/tiny")
    assert len(repo.commits) == 2             # the repo's initial commit, then ours
    assert hub_calls(hub) == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),
        ("POST", "/api/models/me/tiny/preupload/main"),
        ("POST", "/me/tiny.git/info/lfs/objects/batch"),
        ("PUT", f"/_lfs/{sha}"),
        ("POST", f"/_lfs/{sha}/verify"),
        ("POST", "/api/models/me/tiny/commit/main"),
    ]


def test_pushing_the_same_file_again_uploads_nothing(hub, tiny, tmp_path):
    env = hub_env(tmp_path / "hf", endpoint=hub.url, token=WRITE_TOKEN)
    first = push(env, tiny, "me/tiny")
    log_length = len(hub.log)
    second = push(env, tiny, "me/tiny")
    assert second == first                     # same commit: the client skipped unchanged files
    again = hub.log[log_length:]
    assert ("POST", "/api/models/me/tiny/preupload/main") in again    # it asked, was told nothing changed
    assert not any(method == "PUT" or path.endswith("/commit/main") for method, path in again), again
    assert not hub.repos["me/tiny"].private


def test_a_pushed_file_can_be_pulled_back(hub, tiny, tmp_path):
    env = hub_env(tmp_path / "hf", endpoint=hub.url, token=WRITE_TOKEN)
    assert "url" in push(env, tiny, "me/tiny", private=True)
    pulled = subprocess.run([sys.executable, "-c", RESOLVE, "me/tiny", WRITE_TOKEN], env=env, capture_output=True,
                            text=True, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path.is_relative_to(tmp_path / "hf" / "hub") and path.read_bytes() == tiny.read_bytes()


def test_push_without_a_write_token_fails_with_one_sentence(hub, tiny, tmp_path):
    result = push(hub_env(tmp_path / "hf", endpoint=hub.url), tiny, "me/tiny")
    assert result == {"error": "PushError", "message": (
        "the Hub refused to let you write to me/tiny (HTTP 401); pass a token with write access "
        "(--token or `hf auth login`).")}
    assert "me/tiny" not in hub.repos


def test_push_to_an_unreachable_hub_fails_with_one_sentence(tiny, tmp_path):
    endpoint = closed_port_url()
    result = push(hub_env(tmp_path / "hf", endpoint=endpoint, token=WRITE_TOKEN), tiny, "me/tiny")
    assert result["error"] == "PushError"
    assert result["message"].startswith(f"cannot reach the Hub at {endpoint} (")
    assert result["message"].endswith("check the network (or HF_ENDPOINT) and try again.")


@pytest.mark.parametrize("repo", ["tiny", "me/tiny/extra", "me/ti--ny", "-me/tiny", "me/"])
def test_a_malformed_repo_id_is_refused_before_any_request(tiny, repo):
    with pytest.raises(PushError, match="is not a Hub repo id; pass the destination as ORG/REPO"):
        push_to_hub(tiny, repo, token="unused")


def test_only_valid_tinf_files_are_pushed(tmp_path):
    other = tmp_path / "model.bin"
    write_tiny_tinf(tmp_path / "x.tinf").rename(other)
    with pytest.raises(PushError, match=r"does not end in \.tinf"):
        push_to_hub(other, "me/tiny", token="unused")
    broken = tmp_path / "broken.tinf"
    broken.write_bytes(b"\0" * 100)
    with pytest.raises(Exception, match="not a .tinf file"):
        push_to_hub(broken, "me/tiny", token="unused")


# ------------------------------------------------------------------------------ the command lines


def cli(env: dict, module: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_tinyrun_push_publishes_and_says_how_to_run(hub, tiny, tmp_path):
    env = hub_env(tmp_path / "hf", endpoint=hub.url, token=WRITE_TOKEN)
    result = cli(env, "tinyinfer.runtime.cli", "push", tiny, "me/tiny", "--private")
    assert result.returncode == 0, result.stderr
    repo = hub.repos["me/tiny"]
    assert repo.private and repo.files["tiny-q4.tinf"].data == tiny.read_bytes()
    assert result.stdout.splitlines() == [f"pushed tiny-q4.tinf to me/tiny ({hub.url}/me/tiny/commit/{repo.head})",
                                          "run it with: tinyrun me/tiny/tiny-q4.tinf"]


def test_convert_from_the_hub_push_then_run_from_the_hub(hub, tmp_path):
    """tinyconvert ORG/SRC --push-to-hub, then tinyrun ORG/REPO: the whole round trip on the fake hub."""
    from checkpoints import write_hf_llama

    from tinyinfer.runtime import load

    source = tmp_path / "source"
    write_hf_llama(source, dtype="f16", license="llama2")
    source_commit = hub.add_repo("org/src", {p.name: p.read_bytes() for p in source.iterdir()})
    env = hub_env(tmp_path / "hf", endpoint=hub.url, token=WRITE_TOKEN)
    out = tmp_path / "out" / "src-q4.tinf"
    converted = cli(env, "tinyinfer.convert.cli", "org/src", "-o", out, "--push-to-hub", "me/src-tinf", "--private")
    assert converted.returncode == 0, converted.stderr
    assert "run it with: tinyrun me/src-tinf/src-q4.tinf" in converted.stderr
    repo = hub.repos["me/src-tinf"]
    assert repo.private and repo.files["src-q4.tinf"].data == out.read_bytes()
    card = repo.files["README.md"].data.decode()
    assert card == model_card(out, "me/src-tinf")
    assert card.startswith('---\nlicense: "llama2"\nbase_model: "org/src"\n')
    assert f"| source revision | `{source_commit}` |" in card

    ran = cli(hub_env(tmp_path / "hf2", endpoint=hub.url, token=WRITE_TOKEN), "tinyinfer.runtime.cli",
              "me/src-tinf", "-p", "w3 w4 w5", "-n", "6", "--device", "cpu", "-q", "--seed", "2")
    assert ran.returncode == 0, ran.stderr
    with load(out, device="cpu") as model:
        assert ran.stdout == "".join(model.generate("w3 w4 w5", max_tokens=6, seed=2)) + "\n"


@pytest.mark.parametrize("args, words", [
    (["--private"], "--private only applies when publishing"),
    (["--push-to-hub", "no-slash"], "is not a Hub repo id"),
])
def test_tinyconvert_checks_publishing_options_before_converting(tmp_path, args, words):
    from checkpoints import write_hf_llama

    write_hf_llama(tmp_path / "src", dtype="f16")
    out = tmp_path / "m.tinf"
    result = cli(hub_env(tmp_path / "hf"), "tinyinfer.convert.cli", tmp_path / "src", "-o", out, *args)
    assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and not out.exists()


def test_tinyconvert_autotune_without_a_gpu_fails_before_converting(tmp_path):
    from conftest import cuda_available

    if cuda_available():
        pytest.skip("this machine has a GPU")
    from checkpoints import write_hf_llama

    write_hf_llama(tmp_path / "src", dtype="f16")
    out = tmp_path / "m.tinf"
    result = cli(hub_env(tmp_path / "hf"), "tinyinfer.convert.cli", tmp_path / "src", "-o", out, "--autotune")
    assert result.returncode == 1 and not out.exists()
    assert result.stderr == ("error: autotuning needs an NVIDIA GPU and CuPy (tinyinfer[cuda12] or [cuda13]), which "
                             "this machine lacks; run `tinyrun tune FILE.tinf` on a GPU machine instead.\n")
