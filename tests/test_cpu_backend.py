"""The NumPy backend's float32 weight cache: sized from the memory available, settable, partial when
the model does not fit, and the same results whichever weights it holds."""

from __future__ import annotations

import numpy as np
import pytest

from tinf_samples import RUNNABLE_CONFIG, write_runnable_tinf  # noqa: E402
from tinyinfer.runtime import load, numpy_backend  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_runnable_tinf(tmp_path_factory.mktemp("cpu") / "m.tinf")


def test_default_budget_comes_from_available_memory(model_path, monkeypatch):
    monkeypatch.setattr(numpy_backend, "available_memory_bytes", lambda: 10 << 30)
    backend = load(model_path, device="cpu").backend
    c = RUNNABLE_CONFIG
    kv = 2 * 4 * c["n_layers"] * c["max_context"] * c["n_kv_heads"] * c["head_dim"]
    share, headroom = numpy_backend.BUDGET_SHARE, numpy_backend.BUDGET_HEADROOM_BYTES
    assert backend.cache_budget == int((10 << 30) * share) - headroom - kv
    assert backend.cached_names == set(backend.tinf.names) - {"tok_embeddings"}
    monkeypatch.setattr(numpy_backend, "available_memory_bytes", lambda: None)
    assert load(model_path, device="cpu").backend.cache_budget == numpy_backend.FALLBACK_BUDGET_BYTES
    monkeypatch.setattr(numpy_backend, "available_memory_bytes", lambda: 100 << 20)   # less than the headroom
    assert load(model_path, device="cpu").backend.cached_names == set()


def test_available_memory_reads_proc_meminfo():
    available = numpy_backend.available_memory_bytes()
    try:
        lines = open("/proc/meminfo").read().splitlines()
    except OSError:
        assert available is None
        return
    (line,) = [x for x in lines if x.startswith("MemAvailable:")]
    assert available == int(line.split()[1]) * 1024


def test_a_partial_cache_keeps_what_fits_and_gives_the_same_logits(model_path):
    full = load(model_path, device="cpu")
    names = [n for n in full.tinf.names if n != "tok_embeddings"]
    budget = full.backend.float32_bytes(names[:5]) + 3      # the first five matrices, and a little more
    part = load(model_path, device="cpu", weight_cache_bytes=budget)
    assert part.backend.cached_names <= set(names) and part.backend.cached_bytes() <= budget
    assert set(names[:5]) <= part.backend.cached_names != set(names)
    assert set(part.backend.dequantized) == part.backend.cached_names        # dequantized at load
    ids = list(range(1, 30))
    np.testing.assert_array_equal(part.logits(ids), full.logits(ids))
    assert part.backend.expected_tokens_per_s() < full.backend.expected_tokens_per_s()


@pytest.mark.parametrize("encoding", ["q4", "q8", "f16", "bf16", "f32"])
def test_embedding_rows_equal_the_dequantized_table(model_path, monkeypatch, encoding):
    from tinyinfer.formats import encode

    backend = load(model_path, device="cpu").backend
    rng = np.random.default_rng(0)
    table = encode(rng.standard_normal((64, 64)).astype(np.float32), encoding, 32)
    real_tensor = backend.tinf.tensor
    monkeypatch.setattr(backend.tinf, "tensor", lambda name: table if name == "tok_embeddings" else real_tensor(name))
    ids = np.array([0, 5, 5, 63, 17])
    np.testing.assert_array_equal(backend.embed(ids), table.to_float32()[ids])
