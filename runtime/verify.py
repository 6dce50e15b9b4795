"""tinyrun MODEL --verify N: the GPU against the NumPy reference on the same tokens.

The GPU decodes N tokens greedily after a short prompt; then both backends score that same
sequence (prompt + generated tokens, teacher-forced, so one flipped token cannot derail the rest)
and the logits are compared at every position: relative error ||gpu - ref|| / ||ref|| and argmax.
Bounds: relative error <= 1e-3 everywhere, and no argmax mismatch unless the reference's margin
between the two tokens is within 4x the RMS logit error at that position (a near tie the fp16 KV
cache may break either way; such positions are listed). Anything else raises VerifyError (exit status 1).
"""

from __future__ import annotations

import sys

import numpy as np

from tinyinfer.formats import TinyInferError, open_tinf

MAX_RELATIVE_ERROR = 1e-3
NEAR_TIE_NOISE = 4.0   # a flip is a near tie when the reference's margin is within 4x the RMS logit error
PROMPT = "Once upon a time"


class VerifyError(TinyInferError):
    """The GPU's logits disagree with the reference beyond the bounds."""


def compare_logits(gpu: np.ndarray, reference: np.ndarray) -> dict:
    """Per-position relative error and argmax agreement of two [T, vocab] logit arrays."""
    diff = np.linalg.norm(gpu - reference, axis=1)
    rel = diff / np.maximum(np.linalg.norm(reference, axis=1), 1e-30)
    gpu_top, ref_top = gpu.argmax(axis=1), reference.argmax(axis=1)
    mismatches, near_ties = [], []
    for t in np.flatnonzero(gpu_top != ref_top):
        gap = float(reference[t, ref_top[t]] - reference[t, gpu_top[t]])
        noise = float(np.sqrt(np.mean((gpu[t] - reference[t]) ** 2)))
        (near_ties if gap <= NEAR_TIE_NOISE * noise else mismatches).append(
            {"position": int(t), "gpu": int(gpu_top[t]), "reference": int(ref_top[t]), "gap": gap, "rms_error": noise})
    return {"positions": int(gpu.shape[0]), "max_relative_error": float(rel.max()),
            "mean_relative_error": float(rel.mean()), "argmax_agreement": float(np.mean(gpu_top == ref_top)),
            "mismatches": mismatches, "near_ties": near_ties}


def run_verify(path, n_steps: int) -> dict:
    from tinyinfer.runtime.model import check_model, cuda_backend_class
    from tinyinfer.runtime.numpy_backend import NumpyBackend
    from tinyinfer.runtime.sampling import SamplingParams
    from tinyinfer.runtime.tokenizer import Tokenizer

    cuda_class, why_not = cuda_backend_class()
    if cuda_class is None:
        raise VerifyError(f"--verify compares the GPU with the reference: {why_not}")
    tinf = open_tinf(path)
    check_model(tinf)
    tokenizer = Tokenizer.from_metadata(tinf.metadata["tokenizer"])
    prompt = tokenizer.encode(PROMPT) or [0]
    gpu = cuda_class(tinf, max_context=min(tinf.config["max_context"], len(prompt) + n_steps))
    generated = list(gpu.generate_ids(prompt, 0, SamplingParams(), n_steps, np.random.default_rng(0)))
    sequence = np.asarray(prompt + generated[:-1], dtype=np.int64)
    gpu_logits = gpu.decode_forward(sequence, 0)     # the decode engine itself, token by token
    gpu.close()
    reference = NumpyBackend(open_tinf(path), max_context=len(sequence))
    ref_logits = reference.forward(sequence, 0)
    result = {"model": str(path), "prompt_tokens": len(prompt), "steps": n_steps, **compare_logits(gpu_logits, ref_logits)}
    print(f"verify: {result['positions']} positions, worst relative logit error {result['max_relative_error']:.2e} "
          f"(mean {result['mean_relative_error']:.2e}), argmax agreement {100 * result['argmax_agreement']:.1f}%"
          + (f", {len(result['near_ties'])} near-tie flips" if result["near_ties"] else ""), file=sys.stderr)
    if result["max_relative_error"] > MAX_RELATIVE_ERROR or result["mismatches"]:
        raise VerifyError(f"GPU logits differ from the NumPy reference (worst relative error "
                          f"{result['max_relative_error']:.2e}, {len(result['mismatches'])} argmax mismatches); "
                          "report this with the model file and GPU.")
    return result
