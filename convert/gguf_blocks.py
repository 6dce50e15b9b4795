"""GGML quantization blocks copied bit for bit into tinyinfer's q8/q4 encodings with group 32.

A GGML Q8_0/Q4_0/Q4_1 row is a run of 32-weight blocks, each an fp16 scale (Q4_1: and an fp16
minimum) followed by the quantized values. tinyinfer stores the values of a row first and its
fp16 scales after them, so a block maps onto one group of 32 columns:
- Q8_0 (w = d * q, q int8) -> q8: the same q and d, when no q is -128 (q8 holds [-127, 127]);
- Q4_0 (w = d * (u - 8), u a nibble) -> q4: the same u and d; -> q8: q = u - 8 and d;
- Q4_1 (w = d * u + m) needs an encoding with a per-group offset, which q4 does not have: it is
  dequantized and re-quantized instead.
GGML packs a block's 32 nibbles as byte j = u[j] | u[j + 16] << 4; tinyinfer packs byte j of a row
as column 2j | column 2j+1 << 4, so the nibbles are reordered, never recomputed.
"""

from __future__ import annotations

import numpy as np

from tinyinfer.formats import Tensor
from tinyinfer.formats.quant import pack_q4

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# GGML type -> the (encoding, group) pairs it maps onto exactly.
EXACT = {"Q8_0": (("q8", BLOCK),), "Q4_0": (("q4", BLOCK), ("q8", BLOCK))}


def exact_encodings(type_name: str) -> tuple[tuple[str, int], ...]:
    return EXACT.get(type_name, ())


def split_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [rows, row_bytes] -> (fp16 d [rows, n_blocks], the rest of each block [rows, n_blocks, k])."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[type_name])
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    return d, blocks[..., 2:]


def nibbles(packed: np.ndarray) -> np.ndarray:
    """GGML nibbles [rows, n_blocks, 16] -> u [rows, n_blocks * 32] in column order."""
    u = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return u.reshape(packed.shape[0], -1)


def exact_tensor(raw: np.ndarray, type_name: str, encoding: str, shape: tuple) -> Tensor | None:
    """The tinf tensor holding exactly the weights of a GGML tensor, or None where it cannot."""
    if (encoding, BLOCK) not in exact_encodings(type_name):
        return None
    d, rest = split_blocks(raw, type_name)
    if type_name == "Q8_0":
        q = np.ascontiguousarray(rest).view(np.int8).reshape(raw.shape[0], -1)
        if (q == -128).any():
            return None
        return Tensor("q8", shape, q, d.copy(), BLOCK)
    u = nibbles(rest)
    if encoding == "q8":
        return Tensor("q8", shape, u.astype(np.int8) - np.int8(8), d.copy(), BLOCK)
    return Tensor("q4", shape, pack_q4(u.astype(np.int8) - 8), d.copy(), BLOCK)
