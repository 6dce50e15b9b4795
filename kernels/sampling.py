"""Launching the device sampler of sampling.cu; its reference is tinyinfer.runtime.sampling.sample()."""

from __future__ import annotations

import numpy as np

from tinyinfer.kernels.build import Launch, module

THREADS = 1024
P_TEMPERATURE, P_TOP_P, P_MIN_P, P_PENALTY, P_TOP_K, P_COUNT = 0, 1, 2, 3, 4, 8


def params_array(params) -> np.ndarray:
    """The float64 parameter block the kernel reads (from a SamplingParams)."""
    out = np.zeros(P_COUNT, dtype=np.float64)
    out[P_TEMPERATURE] = params.temperature
    out[P_TOP_P] = params.top_p
    out[P_MIN_P] = params.min_p
    out[P_PENALTY] = params.repetition_penalty
    out[P_TOP_K] = params.top_k
    return out


def compile_sampler(compute_capability: int):
    return module("sampling.cu", (), compute_capability)


def make_sampler(mod, vocab: int, logits, params, uniforms, seen, scratch, state, out_tokens,
                 embedding, embedding_encoding: str, embedding_cols_pad: int, x, pending=None,
                 head_best=None) -> Launch:
    """Pick the next token, feed it back through `state`, and write its embedding into x (and into
    the fixed-point residual of a fused step, kernels/mlp.py, where given).

    head_best: the uint64 word into which the output head folded the greedy argmax (gemv "store_argmax"),
    or None. Greedy decoding without a repetition penalty then takes the token from it instead of
    scanning the logits; the kernel clears it for the next step in every mode.

    out_tokens[step] receives the token: a device array, or pinned host memory (a NumPy array from
    weights_upload.pinned_empty), which the kernel writes directly since pinned pointers are valid on
    the device."""
    from tinyinfer.kernels.misc import EMBEDDING_ID

    kernel = mod.get_function("sample_token")
    tokens = np.uint64(out_tokens.ctypes.data) if isinstance(out_tokens, np.ndarray) else out_tokens
    args = (logits, np.int32(vocab), params, uniforms, np.int32(uniforms.size), seen, scratch, state,
            tokens, np.int32(out_tokens.size), embedding, np.int32(EMBEDDING_ID[embedding_encoding]),
            np.int32(embedding_cols_pad), np.int32(x.size), x, pending if pending is not None else np.uint64(0),
            head_best if head_best is not None else np.uint64(0))
    return Launch("sample+embed", kernel, (1,), (THREADS,), args, 0, bytes_read=4 * vocab, waits=True)


def batch_seen_words(vocab: int) -> int:
    """32-bit words of batch_sample's history bitmap (its dynamic shared memory)."""
    return -(-vocab // 32)


def make_batch_sample(mod, n_rows: int, vocab: int, logits, best, params, uniforms, positions, slots, history,
                      max_context: int, scratch, tokens) -> Launch:
    """Row b's token of a batched step into tokens[b] (and its slot's history at positions[b] + 1): the
    same sample() as make_sampler's, with row b's params[b] (params_array layout), uniforms[b] and the
    history history[slots[b]][: positions[b] + 1] (sampling.cu's header has the layout). best: the
    rows' greedy argmax (batch_logits) for plain greedy rows to take, or None to scan. scratch:
    float64 [n_rows][vocab] or more. Launched early after batch_logits, it waits before any read."""
    return Launch("batch_sample", mod.get_function("batch_sample"), (n_rows,), (THREADS,), (
        logits, np.int32(vocab), best if best is not None else np.uint64(0), params, uniforms, positions, slots,
        history, np.int32(max_context), scratch, tokens), shared_mem=4 * batch_seen_words(vocab),
        bytes_read=4 * vocab * n_rows, waits=True)
