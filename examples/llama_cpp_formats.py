"""llama.cpp's quantization formats applied to float weights, for comparing quality (examples/quality.py).

Q4_0, Q4_1 and Q8_0 are quantized by the `gguf` package (gguf.quants, ggml's own NumPy port). It has
no quantizer for Q4_K, only a dequantizer, so `quantize_q4_k` here follows llama.cpp's reference
algorithm (quantize_row_q4_K_ref: a weighted min/scale search per 32-weight sub-block,
make_qkx2_quants, then 6-bit sub-block scales and mins under fp16 super-block ones) and packs real
Q4_K blocks, which gguf.quants dequantizes: the format is ggml's, only the search is written here.

A matrix's rows are padded with zeros to the block size (32), as llama.cpp requires whole blocks per
row; Q4_K's 256-weight super-blocks run over the padded matrix flattened, since the models compared
here have rows that are not a multiple of 256 (llama.cpp itself would fall back to another type for
such rows). Bits are counted over the logical weights, padding included in the bytes.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")
QK_K = 256


def quantize_dequantize(w: np.ndarray, fmt: str) -> tuple[np.ndarray, int]:
    """(the float32 weights llama.cpp's format `fmt` reconstructs, bytes the format stores) for w [rows, cols]."""
    rows, cols = w.shape
    padded = np.zeros((rows, -(-cols // 32) * 32), np.float32)
    padded[:, :cols] = w
    if fmt == "Q4_K":
        flat = np.zeros(-(-padded.size // QK_K) * QK_K, np.float32)
        flat[: padded.size] = padded.ravel()
        blocks = quantize_q4_k(flat.reshape(-1, QK_K))
        back = dequantize(blocks, GGMLQuantizationType.Q4_K).ravel()[: padded.size].reshape(padded.shape)
        return np.ascontiguousarray(back[:, :cols]), blocks.nbytes
    qtype = GGMLQuantizationType[fmt]
    blocks = quantize(padded, qtype)
    return np.ascontiguousarray(dequantize(blocks, qtype)[:, :cols]), blocks.nbytes


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks x [n, 256] float32 -> Q4_K blocks uint8 [n, 144] (d, dmin, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes of nibbles), as llama.cpp's quantize_row_q4_K_ref."""
    n = len(x)
    sub = x.reshape(n, 8, 32)
    av_x = np.sqrt(np.mean(sub * sub, axis=2, keepdims=True))
    weights = av_x + np.abs(sub)
    scales, mins = make_qkx2_quants(sub.reshape(-1, 32), weights.reshape(-1, 32), 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    inv_scale = np.divide(63.0, max_scale, out=np.zeros_like(max_scale), where=max_scale > 0)
    inv_min = np.divide(63.0, max_min, out=np.zeros_like(max_min), where=max_min > 0)
    ls = np.minimum(np.rint(inv_scale[:, None] * scales), 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins), 63).astype(np.uint8)
    d = (max_scale / 63.0).astype(np.float16)
    dmin = (max_min / 63.0).astype(np.float16)
    sub_d = d.astype(np.float32)[:, None] * ls
    sub_m = dmin.astype(np.float32)[:, None] * lm
    inv_d = np.divide(1.0, sub_d, out=np.zeros_like(sub_d), where=sub_d > 0)
    codes = np.clip(np.rint((sub + sub_m[:, :, None]) * inv_d[:, :, None]), 0, 15).astype(np.uint8)
    out = np.zeros((n, 144), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    out[:, 4:16] = pack_scales(ls, lm)
    pairs = codes.reshape(n, 4, 2, 32)                  # 64 weights per 32 bytes: low nibbles first
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out


def pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12 bytes holding 8 six-bit scales and mins (ggml's get_scale_min_k4, inverted)."""
    q = np.zeros((len(ls), 12), np.uint8)
    q[:, 0:4] = (ls[:, 0:4] & 63) | ((ls[:, 4:8] >> 4) << 6)
    q[:, 4:8] = (lm[:, 0:4] & 63) | ((lm[:, 4:8] >> 4) << 6)
    q[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return q


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Per row of x [n, 32]: (scale, min) with x ≈ scale * L - min, L in 0..nmax, min >= 0, from
    llama.cpp's search over the range's step count and a weighted least-squares refit."""
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = x.max(axis=1)
    width = hi - lo
    flat = width <= 0
    sum_w = weights.sum(axis=1)
    sum_x = (weights * x).sum(axis=1)
    inv = np.divide(nmax, width, out=np.zeros_like(width), where=~flat)
    codes = np.clip(np.rint(inv[:, None] * (x - lo[:, None])), 0, nmax)
    best_scale = np.divide(1.0, inv, out=np.zeros_like(inv), where=inv > 0)
    best_min = lo.copy()
    best_err = (weights * (best_scale[:, None] * codes + best_min[:, None] - x) ** 2).sum(axis=1)
    for step in range(nstep + 1):
        iscale = np.divide(rmin + rdelta * step + nmax, width, out=np.zeros_like(width), where=~flat)
        trial = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        sum_l, sum_l2 = (weights * trial).sum(axis=1), (weights * trial * trial).sum(axis=1)
        sum_xl = (weights * trial * x).sum(axis=1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        minimum = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = minimum > 0                          # mins are stored subtracted, so at most 0
        scale = np.where(positive, np.divide(sum_xl, sum_l2, out=np.zeros_like(sum_xl), where=sum_l2 > 0), scale)
        minimum = np.where(positive, 0.0, minimum)
        err = (weights * (scale[:, None] * trial + minimum[:, None] - x) ** 2).sum(axis=1)
        better = ok & (err < best_err)
        best_err[better], best_scale[better], best_min[better] = err[better], scale[better], minimum[better]
    best_scale[flat], best_min[flat] = 0.0, lo[flat]
    return best_scale.astype(np.float32), (-best_min).astype(np.float32)
