"""SmolLM2-135M-Instruct converted from its GGUF file, on the GPU: CUDA logits against the NumPy
reference at 64 positions (||gpu - ref|| / ||ref|| <= 1e-3, argmax equal except near ties) and
the same greedy answer. Needs ../shared (or TINYINFER_SHARED) and a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer.convert import convert_checkpoint
from tinyinfer.runtime import load

pytestmark = pytest.mark.gpu
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["f16", None], ids=["f16", "default"])
def models(request, shared_assets, tmp_path_factory, cupy_gpu):
    source = shared_assets / "smollm2-135m-instruct" / FILE
    if not source.is_file():
        pytest.skip(f"{source} not found")
    path = convert_checkpoint(source, tmp_path_factory.mktemp("smollm2") / "m.tinf", quant=request.param,
                              progress=False)
    return request.param or "default", load(path, device="cuda"), load(path, device="cpu")


def test_cuda_logits_match_the_numpy_reference(models):
    label, gpu_model, cpu_model = models
    ids = gpu_model.prompt_ids(QUESTION + [{"role": "assistant", "content": "The capital of France is Paris, "
                                            "a city of art, food and history on the Seine river."}])[:64]
    gpu, reference = gpu_model.logits(ids), cpu_model.logits(ids)
    errors = np.linalg.norm(gpu - reference, axis=-1) / np.linalg.norm(reference, axis=-1)
    top2 = np.sort(reference, axis=-1)[:, -2:]
    near_tie = top2[:, 1] - top2[:, 0] <= 3e-3 * np.sqrt(np.mean(reference ** 2, axis=-1))
    mismatch = gpu.argmax(-1) != reference.argmax(-1)
    print(f"SmolLM2 {label} CUDA vs NumPy: max relative {errors.max():.2e}, max abs "
          f"{np.abs(gpu - reference).max():.3g}, argmax agreement {1 - mismatch.mean():.3f}")
    assert len(ids) == 64 and errors.max() <= 1e-3
    assert not np.any(mismatch & ~near_tie)


def test_cuda_greedy_answer(models):
    label, gpu_model, cpu_model = models
    if label != "f16":
        pytest.skip("the default conversion re-quantizes SmolLM2's Q4_1 weights; its answer is not the model's")
    text = "".join(gpu_model.generate(QUESTION, max_tokens=24, temperature=0))
    assert text == "".join(cpu_model.generate(QUESTION, max_tokens=24, temperature=0))
    assert "The capital of France is Paris." in text
