"""SmolLM2-135M-Instruct converted from its GGUF file, on the GPU: CUDA logits against the NumPy
reference at 64 positions (argmax equal except near ties, relative error within the bound below) and
the same greedy answer. Needs ../shared (or TINYINFER_SHARED) and a GPU.

Why the bound is 2e-2 (f16) and 3e-2 (default) here and 1e-3 on random weights: the prefill rounds
its activations, K/V and probabilities to fp16 (kernels/README.md "Prefill"), each rounding adds
about 2e-4 locally on any model, and this trained model amplifies that 10-40x (attention scores up to
77, a residual channel near 25,000). An exact NumPy emulation of the kernels' roundings gives the same
error as the GPU (5.4e-3 f16 and 2.1e-2 default on this prompt; 9e-3 and 2.7e-2 at worst over 32
fp32 summation orders), and transformers itself, run in fp16 on the CPU, is 1.9e-2 from its fp32
logits on the same prompt. Only an fp32-equivalent prefill reaches 1e-3."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer.convert import convert_checkpoint
from tinyinfer.runtime import load

pytestmark = pytest.mark.gpu
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BOUND = {"f16": 2e-2, "default": 3e-2}


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
    assert len(ids) == 64 and errors.max() <= BOUND[label]
    assert not np.any(mismatch & ~near_tie)


def test_cuda_greedy_answer(models):
    label, gpu_model, cpu_model = models
    if label != "f16":
        pytest.skip("the default conversion re-quantizes SmolLM2's Q4_1 weights; its answer is not the model's")
    text = "".join(gpu_model.generate(QUESTION, max_tokens=24, temperature=0))
    assert text == "".join(cpu_model.generate(QUESTION, max_tokens=24, temperature=0))
    assert "The capital of France is Paris." in text
