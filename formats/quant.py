"""Tensor encodings (f32, f16, bf16, q8, q4) in NumPy: encode, decode, and the byte layout.

The layout is the one in formats/README.md: rows padded with zeros to `cols_pad`, quantized values
row-major, then (for q8/q4) one fp16 scale per group of `group` consecutive columns, the scale section
starting on a 256-byte boundary. `Tensor.to_float32()` is the single dequantization every backend
and test uses.
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
# Clipping ratios tried by the scale search: scale = ratio * max|w| / qmax.
CLIP_RATIOS = np.linspace(0.70, 1.0, 16, dtype=np.float32)


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
        if self.encoding == "f32":
            full = self.data.astype(np.float32)
        elif self.encoding == "f16":
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


def choose_scales(groups: np.ndarray, qmax: int, qmin: int, scale_search: bool) -> np.ndarray:
    """Per-group fp16-representable scales for groups [n, G] of float32 weights.

    Plain max-abs scaling maps the largest weight to qmax. The search also tries smaller clipping
    ratios and keeps, per group, the scale whose rounded reconstruction has the least squared error.
    """
    amax = np.max(np.abs(groups), axis=-1)
    best_scale = fp16_scale(amax / qmax)
    if not scale_search:
        return best_scale
    best_err = group_error(groups, best_scale, qmax, qmin)
    for ratio in CLIP_RATIOS[:-1]:
        scale = fp16_scale(ratio * amax / qmax)
        err = group_error(groups, scale, qmax, qmin)
        better = err < best_err
        best_scale[better] = scale[better]
        best_err[better] = err[better]
    return best_scale


def fp16_scale(scale: np.ndarray) -> np.ndarray:
    """Round scales to fp16 (what is stored) and back, so quantization uses the stored value."""
    return scale.astype(np.float16).astype(np.float32)


def quantize_groups(groups: np.ndarray, scale: np.ndarray, qmax: int, qmin: int) -> np.ndarray:
    """Rounded, clipped integer values (as float32) for groups [n, G]; all-zero groups give 0."""
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)[:, None]
    q = groups * inv
    np.rint(q, out=q)
    return np.clip(q, qmin, qmax, out=q)


def group_error(groups, scale, qmax, qmin) -> np.ndarray:
    q = quantize_groups(groups, scale, qmax, qmin)
    q *= scale[:, None]
    q -= groups
    return np.einsum("ij,ij->i", q, q)


def encode(w: np.ndarray, encoding: str, group: int = 64, scale_search: bool = True) -> Tensor:
    """Encode a 1-D or 2-D float array. Quantization is symmetric, one fp16 scale per group."""
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
    return encode_quantized(full, shape, encoding, group, scale_search)


def encode_quantized(full, shape, encoding, group, scale_search, block_rows: int = 256) -> Tensor:
    """Quantize [rows, cols_pad] float32 in row blocks (bounded temporaries), blocks in parallel threads."""
    rows, cols_pad = full.shape
    values = np.empty((rows, cols_pad // 2 if encoding == "q4" else cols_pad), dtype=STORAGE_DTYPE[encoding])
    scales = np.empty((rows, cols_pad // group), dtype=np.float16)

    def quantize_block(start: int) -> None:
        block = full[start : start + block_rows]
        groups = block.reshape(-1, group)
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
    """Per-group bound [rows, n_groups] on |w - dequant(w)|: half a step for rounded weights, and
    for weights clipped by the scale search at most qmax * scale * (1/min_ratio - 1)."""
    if t.encoding not in QUANTIZED:
        raise ValueError("only quantized tensors have a step-size error bound")
    scale = t.scales.astype(np.float32)
    clip_steps = QMAX[t.encoding] * (1.0 / float(CLIP_RATIOS[0]) - 1.0)
    return scale * max(0.5, clip_steps) * (1 + 1e-3) + 1e-8
