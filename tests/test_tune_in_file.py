"""The autotune cache inside a .tinf file: keys, lookup (match / stale / foreign) and atomic rewrites."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from tinf_samples import write_tiny_tinf  # noqa: E402
from tinyinfer.formats import open_tinf  # noqa: E402
from tinyinfer.runtime import tune_in_file  # noqa: E402
from tinyinfer.runtime.tune_in_file import (TuneFileError, file_key, load_file_entry, lookup,  # noqa: E402
                                            store_file_entry)

H200 = file_key("NVIDIA H200", "90", "k1")
H200_OLD_KERNELS = file_key("NVIDIA H200", "90", "k0")
A10 = file_key("NVIDIA A10", "86", "k1")
CHOICES = {"matvec_q4": {"threads": 256, "rows_per_block": 4}, "attention": {"split": 2}}


def tensor_state(path) -> dict:
    """Every tensor's bytes (hashed) and recorded CRC: what a metadata rewrite must not change."""
    with open_tinf(path) as f:
        return {n: (hashlib.sha256(f.raw(n)).hexdigest(), f.info(n).crc32, f.check(n)) for n in f.names}


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_tinf(tmp_path / "m.tinf")


def test_key_names_gpu_capability_and_kernel_hash():
    assert H200 == "NVIDIA H200|sm_90|k1"
    with pytest.raises(ValueError):
        file_key("odd|name", "90", "k1")
    with pytest.raises(ValueError):
        file_key("NVIDIA H200", "90", "")


def test_store_then_load_in_place_keeps_every_tensor_byte(tiny):
    before = tensor_state(tiny)
    assert store_file_entry(tiny, H200, CHOICES) == tiny
    with open_tinf(tiny) as f:
        assert load_file_entry(f, H200) == CHOICES
        assert load_file_entry(f, A10) is None
        entry = f.metadata["autotune"][H200]
        assert entry["tuned_by"].startswith("tinyinfer ") and entry["created"].endswith("Z")
        assert "bench" not in entry
    assert tensor_state(tiny) == before
    assert all(ok for _, _, ok in before.values())
    assert not [p for p in tiny.parent.iterdir() if ".tmp-" in p.name]   # no temporary file left behind


def test_entries_for_other_gpus_are_kept_and_a_key_is_replaced(tiny):
    store_file_entry(tiny, A10, {"matvec_q4": {"threads": 128}})
    store_file_entry(tiny, H200, {"old": 1})
    store_file_entry(tiny, H200, CHOICES, bench={"decode_tok_s": 300.0})
    with open_tinf(tiny) as f:
        assert list(f.metadata["autotune"]) == [A10, H200]
        assert load_file_entry(f, A10) == {"matvec_q4": {"threads": 128}}
        assert load_file_entry(f, H200) == CHOICES
        assert f.metadata["autotune"][H200]["bench"] == {"decode_tok_s": 300.0}


def test_writing_to_another_path_leaves_the_source_untouched(tiny, tmp_path):
    original = tiny.read_bytes()
    out = store_file_entry(tiny, H200, CHOICES, out=tmp_path / "tuned.tinf")
    assert tiny.read_bytes() == original
    assert tensor_state(out) == tensor_state(tiny)
    with open_tinf(out) as f:
        assert load_file_entry(f, H200) == CHOICES


def test_lookup_tells_match_stale_foreign_and_empty(tiny):
    with open_tinf(tiny) as f:
        assert lookup(f, H200).status == "empty"
    store_file_entry(tiny, A10, CHOICES)
    with open_tinf(tiny) as f:
        found = lookup(f, H200)
        assert (found.status, found.choices, found.others) == ("foreign", None, (A10,))
        assert "other GPUs only (NVIDIA A10|sm_86|k1)" in found.describe(H200)
    store_file_entry(tiny, H200_OLD_KERNELS, CHOICES)
    with open_tinf(tiny) as f:
        found = lookup(f, H200)
        assert found.status == "stale" and found.choices is None
        assert "other kernel sources" in found.describe(H200)
    store_file_entry(tiny, H200, CHOICES)
    with open_tinf(tiny) as f:
        found = lookup(f, H200)
        assert found.status == "match" and found.choices == CHOICES
        assert found.describe(H200) == f"autotune: using the choices stored in the file for {H200} (no timing needed)"


def test_a_malformed_entry_is_not_used(tmp_path):
    path = write_tiny_tinf(tmp_path / "odd.tinf", autotune={H200: {"choices": "not a map"}, A10: [1, 2]})
    with open_tinf(path) as f:
        assert load_file_entry(f, H200) is None and load_file_entry(f, A10) is None


def test_a_growing_header_moves_the_data_and_stays_valid(tiny):
    with open_tinf(tiny) as f:
        old_offset = f.data_offset
    before = tensor_state(tiny)
    big = {f"kernel_{i}": {"threads": 256, "note": "x" * 100} for i in range(100)}   # ~12 KB of metadata
    store_file_entry(tiny, H200, big)
    with open_tinf(tiny) as f:
        assert f.data_offset > old_offset
        assert load_file_entry(f, H200) == big
    assert tensor_state(tiny) == before


def test_the_oldest_entries_make_room_beyond_the_limit(tiny, monkeypatch):
    monkeypatch.setattr(tune_in_file, "MAX_ENTRIES", 3)
    keys = [file_key(f"GPU {i}", "80", "k") for i in range(5)]
    for key in keys:
        store_file_entry(tiny, key, {"i": 1})
    with open_tinf(tiny) as f:
        assert list(f.metadata["autotune"]) == keys[2:]


def test_file_mode_and_symlinks_are_respected(tiny, tmp_path):
    os.chmod(tiny, 0o644)
    link = tmp_path / "link.tinf"
    link.symlink_to(tiny)
    store_file_entry(link, H200, CHOICES)
    assert link.is_symlink() and link.resolve() == tiny.resolve()
    assert (tiny.stat().st_mode & 0o777) == 0o644
    with open_tinf(tiny) as f:
        assert load_file_entry(f, H200) == CHOICES


def test_the_hugging_face_cache_is_never_rewritten(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    blob = cache / "models--org--repo" / "blobs" / "abc"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(tiny.read_bytes())
    snapshot = cache / "models--org--repo" / "snapshots" / ("a" * 40) / "m.tinf"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(blob)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for target in (blob, snapshot):
        with pytest.raises(TuneFileError, match="inside the Hugging Face cache, which must not be modified"):
            store_file_entry(snapshot, H200, CHOICES, out=target)
    assert blob.read_bytes() == tiny.read_bytes()
    # A tuned copy elsewhere is fine.
    copy = store_file_entry(snapshot, H200, CHOICES, out=tmp_path / "tuned.tinf")
    with open_tinf(copy) as f:
        assert load_file_entry(f, H200) == CHOICES


def test_a_reader_holding_the_old_file_keeps_its_bytes(tiny):
    """The rewrite renames a new file over the old one, so a mapping of the old inode stays valid."""
    with open_tinf(tiny) as old:
        before = np.array(old.raw("norm"))
        store_file_entry(tiny, H200, CHOICES)
        assert np.array_equal(np.array(old.raw("norm")), before)
        assert old.check("norm")
        assert load_file_entry(old, H200) is None     # it still sees the metadata it opened


def test_only_known_gemv_configurations_are_accepted():
    from tinyinfer.kernels import gemv

    roles = candidates(["wqkv", "wo"])
    roles["wo"].append(gemv.GemvConfig(1, 8, 2))                             # wo may split K, wqkv not
    good = {"wqkv": {"row_tiles": 2, "warps": 4}, "wo": {"row_tiles": 1, "warps": 8}}
    assert tune_in_file.gemv_configs(good, roles) == {"wqkv": gemv.GemvConfig(2, 4), "wo": gemv.GemvConfig(1, 8)}
    split = dict(good, wo={"row_tiles": 1, "warps": 8, "split": 2})
    assert tune_in_file.gemv_configs(split, roles)["wo"] == gemv.GemvConfig(1, 8, 2)
    # an entry without a depth (written before depths were tuned) means the depth it was timed at
    assert tune_in_file.gemv_configs(good, roles)["wo"].depth == gemv.DEFAULT_DEPTH[1]
    deep = dict(good, wo={"row_tiles": 1, "warps": 8, "depth": 1})
    assert tune_in_file.gemv_configs(deep, roles)["wo"] == gemv.GemvConfig(1, 8, depth=1)
    balanced = dict(good, wo={"row_tiles": 1, "warps": 8, "balanced": True})
    assert tune_in_file.gemv_configs(balanced, roles)["wo"] == gemv.GemvConfig(1, 8, balanced=True)
    refilled = dict(good, wo={"row_tiles": 1, "warps": 8, "depth": 1, "refill": True})
    assert tune_in_file.gemv_configs(refilled, roles)["wo"] == gemv.GemvConfig(1, 8, depth=1, refill=True)
    for bad in ({"wqkv": good["wqkv"]},                                      # a role missing
                dict(good, wo={"row_tiles": 3, "warps": 8}),                 # not a candidate
                dict(good, wqkv={"row_tiles": 2, "warps": 4, "split": 2}),   # not a candidate for this role
                dict(good, wo={"row_tiles": [1], "warps": 8}),               # not a number
                dict(good, wo={"row_tiles": 1, "warps": 8, "depth": True}),  # not a number, though True == 1
                dict(good, wo={"row_tiles": 1, "warps": 8, "depth": "1"}),
                dict(good, wqkv={"row_tiles": 2, "warps": 4, "depth": 3}),   # R = 2 tries depths 1 and 2
                dict(good, wo={"row_tiles": 1, "warps": 8, "balanced": 1}),  # not a bool
                dict(good, wo={"row_tiles": 1, "warps": 8, "refill": "yes"}),
                dict(good, wqkv="2x4"),                                      # not a map
                "not a map", None):
        assert tune_in_file.gemv_configs(bad, roles) is None, bad


def test_a_fused_mlp_choice_must_name_a_candidate():
    """The fused MLP's choice ("mlp", kernels/mlp.py) comes with the GEMVs' or not at all; absent or
    null, the MLP runs as two GEMVs."""
    from tinyinfer.kernels import mlp

    roles = candidates(["wqkv"])
    good = {"wqkv": {"row_tiles": 2, "warps": 4}}
    assert "mlp" not in tune_in_file.gemv_configs(good, roles, mlp.CANDIDATES)
    assert "mlp" not in tune_in_file.gemv_configs(dict(good, mlp=None), roles, mlp.CANDIDATES)
    fused = dict(good, mlp={"warps": 8, "depth": 1, "row_tiles": 2})
    assert tune_in_file.gemv_configs(fused, roles, mlp.CANDIDATES)["mlp"] == mlp.MlpConfig(8, 1, 2)
    assert tune_in_file.gemv_configs(fused, roles, ()) is None             # this GPU or model cannot fuse
    for bad in ({"warps": 16, "depth": 1}, {"warps": 8, "depth": 3, "row_tiles": 2}, {"warps": 8},
                {"warps": 8, "depth": True}, "fused"):
        assert tune_in_file.gemv_configs(dict(good, mlp=bad), roles, mlp.CANDIDATES) is None, bad


def candidates(roles) -> dict:
    """role -> the configurations the tuner tries on a GPU without clusters (every depth, either grid,
    either ring refill)."""
    from tinyinfer.kernels import gemv

    return {role: [gemv.GemvConfig(rt, warps, depth=d, balanced=b, refill=f) for rt, warps in gemv.CANDIDATES
                   for d in gemv.STEP_DEPTHS[rt] for b in (False, True) for f in (False, True)]
            for role in roles}


GPU_CONFIG = {"architecture": "llama", "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
              "ffn_dim": 512, "vocab_size": 512, "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
              "max_context": 256, "tied_embeddings": False}


@pytest.mark.gpu
def test_tuned_choices_are_used_at_load_and_loading_never_writes(cupy_gpu, tmp_path, monkeypatch, capsys):
    from tinyinfer.kernels import gemv
    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import write_random_model

    monkeypatch.setenv("TINYINFER_CACHE_DIR", str(tmp_path / "user-cache"))
    source = tmp_path / "random.tinf"
    write_random_model(source, GPU_CONFIG)
    key, tuned = tune_in_file.tune_file(source, out=tmp_path / "tuned.tinf")
    with open_tinf(tuned) as f:
        stored = load_file_entry(f, key)
    assert stored and all((c["row_tiles"], c["warps"]) in gemv.CANDIDATES and c.get("split", 1) in gemv.SPLITS
                          for c in stored.values())
    shipped = tuned.read_bytes()
    monkeypatch.setenv("TINYINFER_CACHE_DIR", str(tmp_path / "fresh-cache"))   # only the file can supply them
    with load(tuned, device="cuda", verbose=True) as model:
        assert model.backend.tuning_source == "file"
        assert {role: c.as_dict() for role, c in model.backend.tuning.items()} == stored
    assert "using the choices stored in the file" in capsys.readouterr().err
    assert tuned.read_bytes() == shipped
    with load(source, device="cuda", verbose=True) as model:   # no entry in this one: tuned as before
        assert model.backend.tuning_source in ("measured", "cache")
    assert "carries no autotune entries" in capsys.readouterr().err


def test_the_backend_gets_configs_only_from_a_usable_matching_entry(tmp_path):
    roles = candidates(["wqkv", "wo"])
    good = {"wqkv": {"row_tiles": 2, "warps": 4}, "wo": {"row_tiles": 1, "warps": 8}}
    path = write_tiny_tinf(tmp_path / "m.tinf", autotune={
        H200: {"choices": good}, A10: {"choices": {"wqkv": {"row_tiles": 9, "warps": 9}}}})
    with open_tinf(path) as f:
        configs, message = tune_in_file.shipped_gemv_configs(f, H200, roles)
        assert {r: c.as_dict() for r, c in configs.items()} == good and "using the choices stored" in message
        configs, message = tune_in_file.shipped_gemv_configs(f, A10, roles)
        assert configs is None and "incomplete or names unknown configurations; ignoring it" in message
        configs, message = tune_in_file.shipped_gemv_configs(f, H200_OLD_KERNELS, roles)
        assert configs is None and "other kernel sources" in message
