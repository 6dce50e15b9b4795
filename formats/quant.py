"""Tensor encodings (f32, f16, bf16, q8, q4) in NumPy: encode, decode, and the byte layout.

The layout is the one in formats/README.md: rows padded with zeros to `cols_pad`, quantized values
row-major, then (for q8/q4) one fp16 scale per group of `group` consecutive columns, the scale section
starting on a 256-byte boundary. `Tensor.to_float32()` is the single dequantization every backend
and test uses.

q4's scales are chosen per group by a weighted least-squares search (q4_scales): each weight's
error counts in proportion to sqrt(sigma^2 + w^2) (a trained model's large weights matter most),
times the mean square of the input column it multiplies when a calibration pass measured them (an
importance matrix, as llama.cpp's imatrix). Scales are signed, so the group's largest weight can
take level -8, as llama.cpp's Q4_0 does. BENCHMARKS.md ("Quality") has the measurements behind it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

ENCODINGS = ("f32", "f16", "bf16", "q8", "q4")
QUANTIZED = ("q8", "q4")
GROUP_SIZES = (32, 64, 128)
SECTION_ALIGN = 256
QMAX = {"q8": 127, "q4": 7}
QMIN = {"q8": -127, "q4": -8}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
STORAGE_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "q8": np.int8, "q4": np.uint8}
# q8's clipping ratios tried by its scale search: scale = ratio * max|w| / qmax.
CLIP_RATIOS = np.linspace(0.70, 1.0, 16, dtype=np.float32)
# q4's candidate scales: the group's largest weight w_peak at level -(8 + step), i.e.
# scale = w_peak / -(8 + step), each refitted by weighted least squares (llama.cpp's make_qx_quants
# explores the same band around Q4_0's rule, step 0).
Q4_PEAK_STEPS = np.linspace(-1.5, 1.5, 9)
# A searched q4 scale is kept only if no weight of its group is off by more than this many steps;
# otherwise the group falls back to Q4_0's rule (error at most one step).
Q4_MAX_ERROR_STEPS = 2.0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def rows_cols(shape) -> tuple[int, int]:
    """A 1-D tensor is one row; a 2-D tensor is [rows, cols]."""
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), int(shape[1])


def padded_cols(encoding: str, cols: int, group: int | None) -> int:
    if encoding in QUANTIZED:
        return round_up(cols, group)
    return round_up(cols, 16 // ITEMSIZE[encoding])


def scale_offset(encoding: str, shape, group: int) -> int:
    """Byte offset of the scale section inside a q8/q4 tensor."""
    rows, cols = rows_cols(shape)
    cols_pad = padded_cols(encoding, cols, group)
    value_bytes = rows * cols_pad // (2 if encoding == "q4" else 1)
    return round_up(value_bytes, SECTION_ALIGN)


def tensor_nbytes(encoding: str, shape, group: int | None = None) -> int:
    """Bytes a tensor occupies in a .tinf file."""
    rows, cols = rows_cols(shape)
    cols_pad = padded_cols(encoding, cols, group)
    if encoding in QUANTIZED:
        return scale_offset(encoding, shape, group) + rows * (cols_pad // group) * 2
    return rows * cols_pad * ITEMSIZE[encoding]


@dataclass
class Tensor:
    """An encoded tensor: storage arrays plus what is needed to decode them."""

    encoding: str
    shape: tuple
    data: np.ndarray                  # [rows, cols_pad] (q4: uint8 [rows, cols_pad // 2])
    scales: np.ndarray | None = None  # float16 [rows, cols_pad // group] for q8/q4
    group: int | None = None

    @property
    def rows(self) -> int:
        return rows_cols(self.shape)[0]

    @property
    def cols(self) -> int:
        return rows_cols(self.shape)[1]

    @property
    def cols_pad(self) -> int:
        return padded_cols(self.encoding, self.cols, self.group)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.encoding, self.shape, self.group)

    def to_float32(self) -> np.ndarray:
        """Dequantize to float32 with the logical shape."""
        if self.encoding in ("f32", "f16"):
            full = self.data.astype(np.float32)
        elif self.encoding == "bf16":
            full = bf16_to_f32(self.data)
        else:
            q = unpack_q4(self.data) if self.encoding == "q4" else self.data.astype(np.float32)
            grouped = q.reshape(self.rows, -1, self.group)
            full = (grouped * self.scales.astype(np.float32)[:, :, None]).reshape(self.rows, -1)
        return np.ascontiguousarray(full[:, : self.cols]).reshape(self.shape)

    def parts(self) -> list[tuple[int, np.ndarray]]:
        """(byte offset within the tensor, array) pairs to write, in file order."""
        if self.encoding in QUANTIZED:
            return [(0, self.data), (scale_offset(self.encoding, self.shape, self.group), self.scales)]
        return [(0, self.data)]


def bf16_to_f32(u16: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact: a bfloat16 is the upper half of a float32. Widens in one pass, into `out` if given."""
    if out is None:
        out = np.empty(u16.shape, np.float32)
    np.left_shift(u16, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def unpack_q4(packed: np.ndarray) -> np.ndarray:
    """uint8 [rows, n/2] -> float32 [rows, n] signed values; low nibble is the even column."""
    low = (packed & 0x0F).astype(np.int8) - 8
    high = (packed >> 4).astype(np.int8) - 8
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1).astype(np.float32)


def pack_q4(q: np.ndarray) -> np.ndarray:
    """int [rows, n] in [-8, 7] -> uint8 [rows, n/2]."""
    u = (q + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def fp16(scale: np.ndarray) -> np.ndarray:
    """Round scales to fp16 (what is stored) and back, so quantization uses the stored value."""
    return np.asarray(scale, np.float32).astype(np.float16).astype(np.float32)


def quantize_groups(groups: np.ndarray, scale: np.ndarray, qmax: int, qmin: int) -> np.ndarray:
    """Rounded, clipped integer values (as float32) for groups [n, G]; all-zero groups give 0."""
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)[:, None]
    q = groups * inv
    np.rint(q, out=q)
    return np.clip(q, qmin, qmax, out=q)


# ------------------------------------------------------------------------------------------ q8


def choose_scales(groups: np.ndarray, qmax: int, qmin: int, scale_search: bool) -> np.ndarray:
    """q8: per-group fp16-representable scales for groups [n, G] of float32 weights.

    Plain max-abs scaling maps the largest weight to qmax. The search also tries smaller clipping
    ratios and keeps, per group, the scale whose rounded reconstruction has the least squared error.
    """
    amax = np.max(np.abs(groups), axis=-1)
    best_scale = fp16(amax / qmax)
    if not scale_search:
        return best_scale
    best_err = group_error(groups, best_scale, qmax, qmin)
    for ratio in CLIP_RATIOS[:-1]:
        scale = fp16(ratio * amax / qmax)
        err = group_error(groups, scale, qmax, qmin)
        better = err < best_err
        best_scale[better] = scale[better]
        best_err[better] = err[better]
    return best_scale


def group_error(groups, scale, qmax, qmin) -> np.ndarray:
    q = quantize_groups(groups, scale, qmax, qmin)
    q *= scale[:, None]
    q -= groups
    return np.einsum("ij,ij->i", q, q)


# ------------------------------------------------------------------------------------------ q4


def q4_weights(groups: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """How much each weight's squared error counts: sqrt(sigma^2 + w^2), sigma^2 twice the group's
    mean square, times its input column's importance (mean square activation) where given."""
    squares = groups * groups
    sigma2 = 2.0 * np.einsum("ij->i", squares)[:, None] / groups.shape[1]
    squares += sigma2
    weights = np.sqrt(squares, out=squares)
    if importance is not None:
        weights *= importance
    return weights


def q4_scales(groups: np.ndarray, importance: np.ndarray | None, search: bool) -> np.ndarray:
    """Per-group signed fp16 scales for groups [n, G] of float32 weights (codes: quantize_groups).

    Q4_0's rule puts the group's largest-magnitude weight w_peak at level -8 (scale = w_peak / -8),
    which bounds every weight's error by one step. The search tries scales around it, refits each
    candidate's codes by weighted least squares (scale = sum(w x q) / sum(w q^2)) and keeps the least
    weighted error (computed from the sums). Temporaries are reused (out=): at these sizes allocating
    them costs more than the arithmetic.
    """
    peak = groups[np.arange(len(groups)), np.argmax(np.abs(groups), axis=1)]
    rule = fp16(peak / -8.0)
    if not search:
        return rule
    weights = q4_weights(groups, importance)
    wx = weights * groups
    s_xx = np.einsum("ij,ij->i", wx, groups).astype(np.float64)
    best, best_err = rule.copy(), np.full(len(groups), np.inf)
    q, wq = np.empty_like(groups), np.empty_like(groups)
    for step in (None, *Q4_PEAK_STEPS):          # None: Q4_0's rule's own codes
        if step is None:
            q = quantize_groups(groups, rule, QMAX["q4"], QMIN["q4"])
        else:
            inv = np.divide(-(8.0 + step), peak, out=np.zeros_like(peak), where=peak != 0)
            np.multiply(groups, inv[:, None], out=q)
            np.rint(q, out=q)
            np.clip(q, QMIN["q4"], QMAX["q4"], out=q)
        np.multiply(weights, q, out=wq)
        s_qq = np.einsum("ij,ij->i", wq, q).astype(np.float64)
        s_xq = np.einsum("ij,ij->i", wx, q).astype(np.float64)
        fitted = fp16(np.divide(s_xq, s_qq, out=np.zeros_like(s_xq), where=s_qq > 0))
        err = s_xx - 2 * fitted * s_xq + fitted.astype(np.float64) ** 2 * s_qq
        better = err < best_err
        best[better], best_err[better] = fitted[better], err[better]
    # Keep the error bound: a group whose fitted scale leaves a weight far off takes the rule.
    q = quantize_groups(groups, best, QMAX["q4"], QMIN["q4"])
    q *= best[:, None]
    q -= groups
    far = np.abs(q).max(axis=1) > q4_error_bound(best)
    best[far] = rule[far]
    return best


def q4_error_bound(scale: np.ndarray) -> np.ndarray:
    """What q4_scales guarantees per group: Q4_MAX_ERROR_STEPS steps (Q4_0's rule: one step, plus
    the peak's share of the scale's fp16 rounding)."""
    return np.abs(scale) * Q4_MAX_ERROR_STEPS * (1 + 2e-3) + 1e-8


# ------------------------------------------------------------------------------------------ encode


def encode(w: np.ndarray, encoding: str, group: int = 64, scale_search: bool = True,
           importance: np.ndarray | None = None) -> Tensor:
    """Encode a 1-D or 2-D float array: one fp16 scale per group for q8/q4. importance (q4 only):
    [cols] mean square inputs of the columns, from a calibration pass, to weigh the scale search."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; expected one of {ENCODINGS}")
    w = np.asarray(w)
    if w.ndim not in (1, 2):
        raise ValueError(f"only 1-D and 2-D tensors can be encoded, got shape {w.shape}")
    shape = tuple(int(s) for s in w.shape)
    rows, cols = rows_cols(shape)
    q_group = group if encoding in QUANTIZED else None
    if q_group is not None and q_group not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group}")
    cols_pad = padded_cols(encoding, cols, q_group)
    full = np.zeros((rows, cols_pad), dtype=np.float32)
    full[:, :cols] = w.reshape(rows, cols)
    if encoding == "f32":
        return Tensor(encoding, shape, full)
    if encoding == "f16":
        return Tensor(encoding, shape, full.astype(np.float16))
    if encoding == "bf16":
        return Tensor(encoding, shape, f32_to_bf16(full))
    column_weight = None
    if encoding == "q4":
        column_weight = np.zeros(cols_pad, np.float32)       # padding columns' errors do not count
        column_weight[:cols] = 1.0 if importance is None else np.maximum(np.asarray(importance, np.float32), 0)
    return encode_quantized(full, shape, encoding, group, scale_search, column_weight)


def encode_quantized(full, shape, encoding, group, scale_search, column_weight=None, block_rows: int = 256) -> Tensor:
    """Quantize [rows, cols_pad] float32 in row blocks (bounded temporaries), blocks in parallel threads."""
    rows, cols_pad = full.shape
    values = np.empty((rows, cols_pad // 2 if encoding == "q4" else cols_pad), dtype=STORAGE_DTYPE[encoding])
    scales = np.empty((rows, cols_pad // group), dtype=np.float16)
    per_group = None if column_weight is None else column_weight.reshape(-1, group)

    def quantize_block(start: int) -> None:
        block = full[start : start + block_rows]
        groups = block.reshape(-1, group)
        if encoding == "q4":
            importance = np.tile(per_group, (len(block), 1))
            scale = q4_scales(groups, importance, scale_search)
        else:
            scale = choose_scales(groups, QMAX[encoding], QMIN[encoding], scale_search)
        q = quantize_groups(groups, scale, QMAX[encoding], QMIN[encoding]).astype(np.int8).reshape(block.shape)
        values[start : start + block_rows] = pack_q4(q) if encoding == "q4" else q
        scales[start : start + block_rows] = scale.reshape(len(block), -1).astype(np.float16)

    starts = range(0, rows, block_rows)
    if rows > block_rows and (os.cpu_count() or 1) > 1:
        with ThreadPoolExecutor(max_workers=min(os.cpu_count(), 16)) as pool:  # NumPy releases the GIL
            list(pool.map(quantize_block, starts))
    else:
        for start in starts:
            quantize_block(start)
    return Tensor(encoding, shape, values, scales, group)


def max_abs_error_bound(t: Tensor) -> np.ndarray:
    """Per-group bound [rows, n_groups] on |w - dequant(w)|. q8: half a step for rounded weights,
    and for weights clipped by the scale search at most qmax * scale * (1/min_ratio - 1). q4: what
    q4_scales keeps."""
    if t.encoding not in QUANTIZED:
        raise ValueError("only quantized tensors have a step-size error bound")
    scale = t.scales.astype(np.float32)
    if t.encoding == "q4":
        return q4_error_bound(scale)
    clip_steps = QMAX[t.encoding] * (1.0 / float(CLIP_RATIOS[0]) - 1.0)
    return scale * max(0.5, clip_steps) * (1 + 1e-3) + 1e-8
