"""The model's math in NumPy: the one source of truth every backend is tested against.

Each function is a plain float32 transcription of one step of a Llama decoder layer, in the
Hugging Face conventions (rotate-half RoPE, RMSNorm with the weight applied after normalising,
SwiGLU MLP, grouped-query attention, optional Q/K/V biases and a sliding attention window). CUDA
kernels may fuse and reorder these steps, but each kernel has one of these functions (or a
composition of them) as its oracle.
"""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: [..., dim] -> x / rms(x) * weight, computed in float32."""
    x = x.astype(np.float32, copy=False)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(mean_square + np.float32(eps))) * weight.astype(np.float32, copy=False)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float64, with HF's linear and llama3 rope scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_context / low
        high_freq_wavelen = old_context / high
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def rope_tables(head_dim: int, max_positions: int, theta: float, scaling: dict | None):
    """cos and sin tables [max_positions, head_dim // 2], float32 (computed in float64)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [T, heads, head_dim]; element i pairs with i + head_dim/2."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def first_key(pos: int, window: int | None) -> int:
    """The first cache row the query at `pos` attends to: 0, or with a sliding window of `window`
    positions (Mistral, Qwen2) pos - window + 1, so it sees `window` rows counting its own, as
    transformers' sliding-window mask does (key > query - window)."""
    return 0 if window is None else max(0, pos - window + 1)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
              window: int | None = None) -> np.ndarray:
    """Causal grouped-query attention.

    q: [T, n_heads, head_dim]; k_cache, v_cache: [S, n_kv_heads, head_dim] holding every position
    up to max(positions); the query at position p attends to cache rows first_key(p, window)..p.
    Returns [T, n_heads*head_dim].
    """
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k_cache.shape[1]
    out = np.empty((n_tokens, n_heads, head_dim), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for t, pos in enumerate(positions):
        rows = slice(first_key(pos, window), pos + 1)
        keys = np.repeat(k_cache[rows], group, axis=1)            # [rows, n_heads, hd]
        values = np.repeat(v_cache[rows], group, axis=1)
        scores = np.einsum("hd,shd->hs", q[t], keys) * scale      # [n_heads, rows]
        out[t] = np.einsum("hs,shd->hd", softmax(scores), values)
    return out.reshape(n_tokens, n_heads * head_dim)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up: [T, 2*ffn] (gate rows first, then up, as fused in the file) -> silu(gate) * up."""
    ffn = gate_up.shape[-1] // 2
    return (silu(gate_up[..., :ffn]) * gate_up[..., ffn:]).astype(np.float32)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x: [T, K] float32, weight: [N, K] float32 (already dequantized), bias: [N] or None -> [T, N]."""
    y = (x.astype(np.float32, copy=False) @ weight.T).astype(np.float32, copy=False)
    return y if bias is None else y + bias.astype(np.float32, copy=False)
