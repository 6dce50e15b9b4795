"""Pulling .tinf files from the Hub through the real huggingface_hub client.

Offline tests lay out a genuine Hub cache (refs, snapshots, blobs) in a temporary HF_HOME and run
with HF_HUB_OFFLINE=1 in a subprocess (the flag is read when huggingface_hub is imported). Online
tests point HF_ENDPOINT at the FakeHub on 127.0.0.1. Nothing here reaches the network.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fake_hub import WRITE_TOKEN, FakeHub, closed_port_url, hub_env, write_cached_repo  # noqa: E402
from tinf_samples import flip_byte, write_runnable_tinf, write_tiny_tinf  # noqa: E402
from tinyinfer.runtime.hub import HubError, HubRef, parse_ref  # noqa: E402

COMMIT = "a" * 40
OLD_COMMIT = "b" * 40

# Resolves each reference given on the command line and prints {ref: {"path"} or {"error", "message"}}.
RESOLVE = """
import json, sys
from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.hub import resolve_model
token, results = sys.argv[1] or None, {}
for ref in sys.argv[2:]:
    try:
        results[ref] = {"path": str(resolve_model(ref, token=token))}
    except TinyInferError as e:
        results[ref] = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(results))
"""


def resolve(env: dict, refs: list[str], token: str | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", RESOLVE, token or "", *refs], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("ref, expected", [
    ("org/repo", HubRef("org/repo")),
    ("org/repo/model-q4.tinf", HubRef("org/repo", "model-q4.tinf")),
    ("org/repo/sub/dir/m.tinf", HubRef("org/repo", "sub/dir/m.tinf")),
    ("hf://org/repo", HubRef("org/repo", explicit=True)),
    ("hf://org/repo/m.tinf", HubRef("org/repo", "m.tinf", explicit=True)),
    ("hf://org/repo/m.tinf@v1.0", HubRef("org/repo", "m.tinf", "v1.0", explicit=True)),
    ("hf://org/repo/m.tinf@" + COMMIT, HubRef("org/repo", "m.tinf", COMMIT, explicit=True)),
    ("hf://org/repo@refs/pr/3", HubRef("org/repo", None, "refs/pr/3", explicit=True)),
    ("Org.Name/Repo_name-1.5B", HubRef("Org.Name/Repo_name-1.5B")),
])
def test_parse_hub_references(ref, expected):
    assert parse_ref(ref) == expected


@pytest.mark.parametrize("ref", ["model.tinf", "out/model.tinf", "./org/repo", "/abs/org/repo/m.tinf",
                                 "~/m.tinf", "org/repo/m.bin", "a/b/c", "org/re--po", "org/repo."])
def test_local_paths_stay_local(ref):
    assert isinstance(parse_ref(ref), Path)


def test_an_existing_local_path_wins_over_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tiny_tinf(tmp_path / "org" / "repo" / "m.tinf")
    assert parse_ref("org/repo/m.tinf") == Path("org/repo/m.tinf")
    assert parse_ref("org/repo") == Path("org/repo")


@pytest.mark.parametrize("ref, words", [
    ("hf://org", "not a valid Hub reference"),
    ("hf://org/repo/m.bin", "not a valid Hub reference"),
    ("hf://org/repo@", "empty revision"),
    ("hf://org/re--po/m.tinf", "not a valid Hub reference"),
])
def test_malformed_hf_references_fail_with_one_sentence(ref, words):
    with pytest.raises(HubError) as e:
        parse_ref(ref)
    assert words in str(e.value) and str(e.value).endswith(".") and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory):
    """An HF_HOME whose hub cache holds four repos, as huggingface_hub itself would have left it."""
    root = tmp_path_factory.mktemp("offline")
    home, cache = root / "hf", root / "hf" / "hub"
    one = write_tiny_tinf(root / "one.tinf", seed=1).read_bytes()
    old = write_tiny_tinf(root / "old.tinf", seed=2).read_bytes()
    two_a = write_tiny_tinf(root / "a.tinf", seed=3).read_bytes()
    write_cached_repo(cache, "org/single", {"model-q4.tinf": one, "README.md": b"# card\n"}, COMMIT)
    write_cached_repo(cache, "org/single", {"model-q4.tinf": old}, OLD_COMMIT, refs=("v0",))
    write_cached_repo(cache, "org/multi", {"a-q4.tinf": two_a, "q8/b-q8.tinf": one}, COMMIT)
    write_cached_repo(cache, "org/none", {"README.md": b"# nothing here\n"}, COMMIT)
    return {"home": home, "cache": cache, "one": one, "old": old}


def test_offline_resolution_goes_through_huggingface_hub_cache(offline_cache):
    refs = ["org/single", "org/single/model-q4.tinf", "hf://org/single/model-q4.tinf",
            f"hf://org/single/model-q4.tinf@{OLD_COMMIT}", "hf://org/single@v0", "org/multi/q8/b-q8.tinf"]
    results = resolve(hub_env(offline_cache["home"], offline=True), refs)
    snapshot = offline_cache["cache"] / "models--org--single" / "snapshots"
    for ref in refs[:3]:
        assert results[ref] == {"path": str(snapshot / COMMIT / "model-q4.tinf")}, ref
        assert Path(results[ref]["path"]).read_bytes() == offline_cache["one"]
    for ref in refs[3:5]:   # a pinned commit and a tag both reach the older snapshot
        assert results[ref] == {"path": str(snapshot / OLD_COMMIT / "model-q4.tinf")}, ref
        assert Path(results[ref]["path"]).read_bytes() == offline_cache["old"]
    assert Path(results[refs[5]]["path"]).read_bytes() == offline_cache["one"]


def test_offline_errors_are_one_sentence_each(offline_cache):
    refs = ["org/multi", "org/none", "org/absent", "hf://org/single/other.tinf", "hf://org/single@v9"]
    results = resolve(hub_env(offline_cache["home"], offline=True), refs)
    for ref, result in results.items():
        assert result["error"] == "HubError", (ref, result)
        message = result["message"]
        assert message.endswith(".") and "\n" not in message and message.count(";") == 1, message
    assert "several .tinf files (a-q4.tinf, q8/b-q8.tinf)" in results["org/multi"]["message"]
    assert "tinyrun org/multi/a-q4.tinf" in results["org/multi"]["message"]
    assert "holds no .tinf file" in results["org/none"]["message"]
    for ref in refs[2:]:
        assert "not in the Hugging Face cache and the Hub cannot be reached" in results[ref]["message"], ref


def test_unreachable_hub_falls_back_to_the_cache(offline_cache):
    """HF_HUB_OFFLINE unset, but nothing answers at HF_ENDPOINT: a cached file still resolves, a cached
    repo is listed from the cache, and an uncached one fails at once (one request, no retries)."""
    env = hub_env(offline_cache["home"], endpoint=closed_port_url())
    refs = ["org/single/model-q4.tinf", "org/single", "org/absent", "org/absent/model.tinf"]
    started = time.monotonic()
    results = resolve(env, refs)
    assert time.monotonic() - started < 10          # huggingface_hub's retries would take ~24 s
    assert Path(results["org/single/model-q4.tinf"]["path"]).read_bytes() == offline_cache["one"]
    assert Path(results["org/single"]["path"]).read_bytes() == offline_cache["one"]
    for ref in refs[2:]:
        assert "the Hub cannot be reached" in results[ref]["message"], ref


def test_listing_falls_back_to_the_cache_when_the_hub_is_unreachable(offline_cache, monkeypatch):
    """ORG/REPO needs a file listing; when the connection fails the cached snapshot is listed instead,
    and the download is looked up in the cache only. (In-process, with the listing call failing the
    way httpx does, and any further request failing the test.)"""
    from huggingface_hub import HfApi, constants, file_download
    from huggingface_hub.utils import httpx

    from tinyinfer.runtime import hub

    def refuse(*args, **kwargs):
        raise httpx.ConnectError("[Errno 111] Connection refused")

    def no_request(*args, **kwargs):
        raise AssertionError("a request after the listing failed")

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(offline_cache["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", refuse)
    monkeypatch.setattr(file_download, "get_hf_file_metadata", no_request)
    with pytest.raises(HubError, match=r"several .tinf files \(a-q4.tinf, q8/b-q8.tinf\)"):
        hub.download(HubRef("org/multi"))
    assert hub.download(HubRef("org/single", revision="v0")).read_bytes() == offline_cache["old"]
    assert hub.download(HubRef("org/single")).read_bytes() == offline_cache["one"]
    with pytest.raises(HubError, match="not in the Hugging Face cache and the Hub cannot be reached"):
        hub.download(HubRef("org/absent"))


# ----------------------------------------------------------------------------------------- online


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


def test_download_from_the_hub_into_its_cache(hub, tmp_path):
    data = write_tiny_tinf(tmp_path / "m.tinf").read_bytes()
    commit = hub.add_repo("org/tiny", {"tiny-q4.tinf": data, "README.md": b"# card\n"})
    env = hub_env(tmp_path / "hf", endpoint=hub.url)
    results = resolve(env, ["org/tiny"])
    path = Path(results["org/tiny"]["path"])
    assert path == tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / commit / "tiny-q4.tinf"
    assert path.read_bytes() == data
    # The cache names the blob by the sha256 the Hub reported for the LFS file.
    assert path.resolve().name == hashlib.sha256(data).hexdigest()
    assert ("GET", "/api/models/org/tiny") in hub.log          # the listing: one request
    assert ("GET", "/org/tiny/resolve/main/tiny-q4.tinf") in hub.log
    # Offline afterwards, the same reference resolves from the cache without the server.
    hub.stop()
    again = resolve(hub_env(tmp_path / "hf", offline=True), ["org/tiny"])
    assert again["org/tiny"]["path"] == str(path)


def test_a_dropped_connection_resumes_with_a_range_request(hub, tmp_path):
    """huggingface_hub resumes within the run: after a cut it asks only for the bytes it has not
    written yet (it writes in DOWNLOAD_CHUNK_SIZE pieces, so the file must be larger than one)."""
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE
    data = np.random.default_rng(0).integers(0, 256, chunk + (1 << 20), dtype=np.uint8).tobytes()
    hub.add_repo("org/big", {"big.tinf": data})
    hub.cut_next_download = chunk + 1000
    results = resolve(hub_env(tmp_path / "hf", endpoint=hub.url), ["org/big/big.tinf"])
    assert Path(results["org/big/big.tinf"]["path"]).read_bytes() == data
    assert hub.range_starts == [chunk]


def test_hub_errors_are_one_sentence_each(hub, tmp_path):
    data = write_tiny_tinf(tmp_path / "m.tinf").read_bytes()
    hub.add_repo("org/gated", {"g.tinf": data}, gated=True)
    hub.add_repo("org/private", {"p.tinf": data}, private=True)
    hub.add_repo("org/two", {"a.tinf": data, "b.tinf": data})
    refs = ["org/gated", "org/private", "org/missing/m.tinf", "hf://org/missing/m.tinf",
            "hf://org/two/a.tinf@nope", "org/two/c.tinf", "org/two"]
    results = resolve(hub_env(tmp_path / "hf", endpoint=hub.url), refs)
    for ref, result in results.items():
        assert result.get("error") == "HubError", (ref, result)
        assert result["message"].endswith(".") and "\n" not in result["message"], result
    assert results["org/gated"]["message"].startswith(f"org/gated is gated; accept its terms at {hub.url}/org/gated")
    assert results["org/private"]["message"] == (
        "there is no local file org/private and org/private was not found on the Hugging Face Hub (or it is "
        "private); check the path or the repo name, or pass --token.")
    assert results["org/missing/m.tinf"]["message"].startswith("there is no local file org/missing/m.tinf and")
    assert results["hf://org/missing/m.tinf"]["message"].startswith("org/missing was not found")
    assert "revision 'nope' does not exist in org/two" in results["hf://org/two/a.tinf@nope"]["message"]
    assert results["org/two/c.tinf"]["message"] == (f"org/two has no file c.tinf; check its files at "
                                                    f"{hub.url}/org/two/tree/main.")
    assert "several .tinf files (a.tinf, b.tinf)" in results["org/two"]["message"]


def test_token_opens_private_and_gated_repos(hub, tmp_path):
    data = write_tiny_tinf(tmp_path / "m.tinf").read_bytes()
    hub.add_repo("org/gated", {"g.tinf": data}, gated=True)
    hub.add_repo("org/private", {"p.tinf": data}, private=True)
    results = resolve(hub_env(tmp_path / "hf", endpoint=hub.url), ["org/gated", "org/private"], token=WRITE_TOKEN)
    assert all(Path(r["path"]).read_bytes() == data for r in results.values()), results


# ------------------------------------------------------------------------------ the command line


def tinyrun(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyinfer.runtime.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_tinyrun_runs_describes_and_checks_a_cached_model_offline(tmp_path):
    from tinyinfer.runtime import load

    local = write_runnable_tinf(tmp_path / "runnable.tinf")
    snapshot = write_cached_repo(tmp_path / "hf" / "hub", "org/runnable", {"runnable-q4.tinf": local.read_bytes()},
                                 COMMIT)
    env = hub_env(tmp_path / "hf", offline=True)
    ran = tinyrun(env, "org/runnable", "-p", "w3 w4", "-n", "5", "--device", "cpu", "-q", "--seed", "1")
    assert ran.returncode == 0, ran.stderr
    with load(local, device="cpu") as model:
        assert ran.stdout == "".join(model.generate("w3 w4", max_tokens=5, seed=1)) + "\n"
    info = tinyrun(env, "info", f"hf://org/runnable/runnable-q4.tinf@{COMMIT}", "--check")
    assert info.returncode == 0, info.stderr
    assert f"file        {snapshot / 'runnable-q4.tinf'} (" in info.stdout
    assert info.stdout.rstrip().endswith("checked 15 tensors: every checksum matches")
    missing = tinyrun(env, "org/absent", "-p", "hi")
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == ("error: org/absent is not in the Hugging Face cache and the Hub cannot be reached "
                              "(no network, or HF_HUB_OFFLINE=1); connect once to download it, or pass a local "
                              ".tinf path.\n")


def test_tinyrun_tune_refuses_to_rewrite_the_hub_cache(tmp_path):
    data = write_runnable_tinf(tmp_path / "runnable.tinf").read_bytes()
    snapshot = write_cached_repo(tmp_path / "hf" / "hub", "org/runnable", {"r.tinf": data}, COMMIT)
    result = tinyrun(hub_env(tmp_path / "hf", offline=True), "tune", "org/runnable")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is inside the Hugging Face cache, which must not be modified" in result.stderr
    assert (snapshot / "r.tinf").read_bytes() == data


def test_a_download_is_checked_once_before_use_and_a_corrupt_one_removed(hub, tmp_path):
    good = write_tiny_tinf(tmp_path / "good.tinf")
    bad = write_tiny_tinf(tmp_path / "bad.tinf", seed=1)
    flip_byte(bad, "norm", 10)
    hub.add_repo("org/good", {"m.tinf": good.read_bytes()})
    hub.add_repo("org/bad", {"m.tinf": bad.read_bytes()})
    env = hub_env(tmp_path / "hf", endpoint=hub.url)
    results = resolve(env, ["org/good", "org/bad"])
    assert results["org/bad"]["error"] == "IntegrityError"
    assert "(norm)" in results["org/bad"]["message"] and "removed from the cache" in results["org/bad"]["message"]
    assert not list((tmp_path / "hf" / "hub" / "models--org--bad" / "blobs").iterdir())
    # Once in the cache, a file is not read through again: a later run starts at once (tinyrun info
    # --check is there for files that may have changed since).
    cached = Path(results["org/good"]["path"])
    flip_byte(cached.resolve(), "norm", 10)
    assert resolve(env, ["org/good"])["org/good"] == {"path": str(cached)}
