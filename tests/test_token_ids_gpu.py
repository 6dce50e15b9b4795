"""On the CUDA backend, an out-of-range token id is refused before any kernel launch.

A GPU embedding gather has no bounds check, so a prompt id, a BOS/EOS/pad id or a tokenizer id
beyond the embedding's rows would read outside it. The checks sit in Model and at load, in front of
every backend: here the backend's entry points are replaced by ones that fail when called, and the
device's logits buffer is poisoned with NaN first, so a launch that slipped through would show.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuzz_tinf import with_value  # noqa: E402
from tinf_samples import RUNNABLE_CONFIG, write_runnable_tinf  # noqa: E402
from tinyinfer.formats import FormatError  # noqa: E402
from tinyinfer.runtime import model as model_module  # noqa: E402
from tinyinfer.runtime.errors import TokenIdError  # noqa: E402
from tinyinfer.runtime.model import load  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = RUNNABLE_CONFIG["vocab_size"]


@pytest.fixture
def gpu_model(tmp_path, cupy_gpu):
    path = write_runnable_tinf(tmp_path / "m.tinf")
    with load(path, device="cuda") as model:
        assert type(model.backend).__name__ == "CudaBackend"
        yield model


def refuse_launches(backend):
    def launched(*args, **kwargs):
        raise AssertionError("an out-of-range id reached the CUDA backend")

    for name in ("forward", "decode_forward", "generate_ids"):
        setattr(backend, name, launched)


@pytest.mark.parametrize("ids", [[-1], [VOCAB], [3, VOCAB + 1000], [3, -(2**31)], [2**40]])
def test_out_of_range_prompt_ids_are_refused_before_any_launch(gpu_model, cupy_gpu, ids):
    backend = gpu_model.backend
    backend.stream.synchronize()
    backend.logits.fill(np.nan)
    refuse_launches(backend)
    with pytest.raises(TokenIdError):
        gpu_model.logits(ids)
    backend.stream.synchronize()
    assert bool(cupy_gpu.isnan(backend.logits).all())   # nothing ran on the device


def test_a_hostile_bos_id_is_refused_before_generation(gpu_model, cupy_gpu):
    backend = gpu_model.backend
    refuse_launches(backend)
    gpu_model.tokenizer.bos_id = VOCAB + 5   # what load refuses in a file (next test); here set by hand
    with pytest.raises(TokenIdError):
        "".join(gpu_model.generate("w3 w4", max_tokens=2))


@pytest.mark.parametrize("key, value", [("bos_id", -1), ("bos_id", VOCAB), ("eos_ids", [-1]), ("pad_id", VOCAB)])
def test_files_with_out_of_range_special_ids_never_get_a_backend(tmp_path, cupy_gpu, monkeypatch, key, value):
    seed = write_runnable_tinf(tmp_path / "seed.tinf").read_bytes()
    path = tmp_path / "hostile.tinf"
    path.write_bytes(with_value(seed, ("tokenizer", key), value))

    def no_backend(*args, **kwargs):
        raise AssertionError("a backend was made for a file with an out-of-range id")

    monkeypatch.setattr(model_module, "make_backend", no_backend)
    with pytest.raises(FormatError, match=key):
        load(path, device="cuda")


def test_in_range_ids_still_run_on_the_gpu(gpu_model):
    logits = gpu_model.logits([1, 3, VOCAB - 1])
    assert logits.shape == (3, VOCAB) and np.isfinite(logits).all()
