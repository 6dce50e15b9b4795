"""The layout of a linear's weights on the GPU: row-major as in the file, or in blocks of 8 rows.

A .tinf file stores a linear row-major: its values [rows][row_bytes] (row_bytes = kpad * bits / 8)
and, for q8/q4, its fp16 scales [rows][groups] from formats.quant.scale_offset on. The decode GEMV
(gemv.cu) has each warp load one 16-byte piece per lane from 8 rows at once (lane (g, t): row g,
bytes 16 t .. 16 t + 15 of a 64-byte piece of the row), which row-major makes eight 64-byte runs a
row apart. After upload the CUDA backend rewrites, in place, every matrix whose rows are a multiple
of 8 and whose row is a multiple of 64 bytes (can_block) as

    values  [rows / 8][row_bytes / 64][8][64 bytes]: byte b of row r at
            (r - r % 8) * row_bytes + (b // 64) * 512 + (r % 8) * 64 + b % 64
    scales  [rows / 8][groups][8]: scale j of row r at (r - r % 8) * groups + 8 j + r % 8

so those loads read 512 contiguous bytes and the scale loads of 8 rows 16 (gemv.cu's BLOCKED;
the decode step it saves: kernels/README.md, "Blocked layout"). Other matrices (odd sizes) stay
row-major. The file and the NumPy reference keep
the row-major layout; the prefill path dequantizes from the blocked form and hands its f16 GEMMs
(cuBLAS) a row-major copy (unblock_values), which costs f16 prefill one copy of the weights per
prompt chunk.

Every function takes arrays of NumPy or CuPy (xp), so the CUDA backend and the tests rearrange
with the same code.
"""

from __future__ import annotations

import numpy as np

ROWS = 8                    # rows per block
PIECE = 64                  # bytes of one row in a block's piece (4 lanes x 16 bytes)
WORD = np.uint64            # moved as 8-byte words (tensors start 256-byte aligned)
SLAB_BYTES = 64 << 20       # rewritten a slab at a time: the temporary copy stays this small
VALUE_BITS = {"f16": 16, "q8": 8, "q4": 4}


def row_bytes(encoding: str, cols_pad: int) -> int:
    return cols_pad * VALUE_BITS[encoding] // 8


def can_block(encoding: str, rows: int, cols_pad: int) -> bool:
    return rows % ROWS == 0 and row_bytes(encoding, cols_pad) % PIECE == 0


def blocked_view(values):
    """[rows][row_words] words as the 4-D view whose C order is the blocked layout."""
    rows, words = values.shape
    per_piece = PIECE // WORD().itemsize
    return values.reshape(rows // ROWS, ROWS, words // per_piece, per_piece).transpose(0, 2, 1, 3)


def rewrite(flat, arranged, xp) -> None:
    """Write the view `arranged` of flat's own memory back into flat in C order (through a copy)."""
    flat[...] = xp.ascontiguousarray(arranged).reshape(flat.shape)


def block_in_place(tensor, shape, xp=np) -> None:
    """Rearrange a tensor's bytes (uint8 [nbytes], file layout) into the blocked layout, in place.
    shape: a GemvShape (or anything with encoding, rows, cols, cols_pad, group) that can_block."""
    from tinyinfer.formats.quant import scale_offset

    assert can_block(shape.encoding, shape.rows, shape.cols_pad)
    width = row_bytes(shape.encoding, shape.cols_pad)
    values = tensor[: shape.rows * width].view(WORD).reshape(shape.rows, width // WORD().itemsize)
    slab_rows = max(ROWS, SLAB_BYTES // width // ROWS * ROWS)
    for first in range(0, shape.rows, slab_rows):        # blocks never cross a slab: slabs are whole blocks
        slab = values[first: first + slab_rows]
        rewrite(slab.reshape(-1), blocked_view(slab), xp)
    if shape.encoding != "f16":
        start = scale_offset(shape.encoding, (shape.rows, shape.cols), shape.group)
        groups = shape.cols_pad // shape.group
        scales = tensor[start: start + 2 * shape.rows * groups].view(np.uint16)
        rewrite(scales, scales.reshape(shape.rows // ROWS, ROWS, groups).transpose(0, 2, 1), xp)


def unblock_values(tensor, shape, out, xp=np) -> None:
    """Copy the values of a blocked tensor (uint8 [nbytes]) into `out` (any dtype, at least rows x
    row_bytes bytes, contiguous) in the file's row-major layout."""
    width = row_bytes(shape.encoding, shape.cols_pad)
    words = width // WORD().itemsize
    per_piece = PIECE // WORD().itemsize
    source = tensor[: shape.rows * width].view(WORD)
    source = source.reshape(shape.rows // ROWS, words // per_piece, ROWS, per_piece).transpose(0, 2, 1, 3)
    target = out.reshape(-1).view(np.uint8)[: shape.rows * width].view(WORD)
    xp.copyto(target.reshape(shape.rows // ROWS, ROWS, words // per_piece, per_piece), source)
