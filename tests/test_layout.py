"""The GEMV's 8-row block layout (kernels/layout.py), on the CPU: the documented offsets, the inverse
used by prefill, slabs, which matrices are blocked, and the CUDA backend's rearrangement of a file."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.formats.quant import scale_offset
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.runtime.bench import random_encoded, write_random_model
from tinyinfer.runtime.cuda_backend import block_linears

from tinf_samples import stored_bytes  # noqa: E402


def encoded(encoding: str, rows: int, cols: int, seed: int = 0):
    tensor = random_encoded(encoding, (rows, cols), None if encoding == "f16" else 64, np.random.default_rng(seed))
    return tensor, gemv_k.shape_of(tensor)


@pytest.mark.parametrize("encoding,rows,cols", [("q4", 24, 384), ("q8", 16, 192), ("f16", 40, 96)])
def test_blocked_bytes_sit_at_the_documented_offsets(encoding, rows, cols):
    tensor, shape = encoded(encoding, rows, cols)
    assert shape.blocked
    raw = stored_bytes(tensor)
    blocked = raw.copy()
    layout.block_in_place(blocked, shape)
    width = layout.row_bytes(encoding, shape.cols_pad)
    values, moved = raw[: rows * width].reshape(rows, width), blocked[: rows * width]
    r, b = np.meshgrid(np.arange(rows), np.arange(width), indexing="ij")
    at = (r - r % 8) * width + (b // 64) * 512 + (r % 8) * 64 + b % 64    # kernels/layout.py, gemv.cu
    assert np.array_equal(moved[at], values) and not np.array_equal(moved, values.reshape(-1))
    end = rows * width
    if encoding != "f16":
        start, groups = scale_offset(encoding, (rows, cols), 64), shape.cols_pad // 64
        end = start + 2 * rows * groups
        scales = raw[start: end].view(np.uint16).reshape(rows, groups)
        moved_scales = blocked[start: end].view(np.uint16)
        r, j = np.meshgrid(np.arange(rows), np.arange(groups), indexing="ij")
        assert np.array_equal(moved_scales[(r - r % 8) * groups + 8 * j + r % 8], scales)
        assert np.array_equal(blocked[rows * width: start], raw[rows * width: start])   # alignment padding
    assert np.array_equal(blocked[end:], raw[end:])


def test_unblock_values_inverts_the_blocking(monkeypatch):
    tensor, shape = encoded("q4", 64, 512, seed=1)
    raw = stored_bytes(tensor)
    monkeypatch.setattr(layout, "SLAB_BYTES", 3 * 256)     # slabs of 8 rows: the same bytes as one slab
    small_slabs = raw.copy()
    layout.block_in_place(small_slabs, shape)
    monkeypatch.undo()
    one_slab = raw.copy()
    layout.block_in_place(one_slab, shape)
    assert np.array_equal(small_slabs, one_slab)
    out = np.zeros(64 * 256, dtype=np.uint8)
    layout.unblock_values(one_slab, shape, out)
    assert np.array_equal(out, raw[: 64 * 256])


def test_only_whole_blocks_of_whole_pieces_are_blocked():
    assert layout.can_block("q4", 2560, 2048) and layout.can_block("f16", 32000, 4096)
    assert layout.can_block("q8", 4096, 11008 + 64 - 11008 % 64)
    assert not layout.can_block("q4", 100, 256)      # rows not a multiple of 8
    assert not layout.can_block("q4", 64, 64)        # a 32-byte row
    assert not layout.can_block("f16", 64, 176)      # 352 bytes: not whole 64-byte pieces


def test_the_backend_blocks_every_blockable_linear_of_a_file(tmp_path):
    config = {"architecture": "llama", "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
              "ffn_dim": 344, "vocab_size": 100, "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
              "max_context": 64, "tied_embeddings": False}
    path = write_random_model(tmp_path / "m.tinf", config, "q4", 64)
    tinf = open_tinf(path)
    extent = max(info.offset + info.nbytes for info in tinf.infos.values())
    weights = np.array(tinf.memmap[tinf.data_offset: tinf.data_offset + extent])
    original = weights.copy()

    def view(name):
        info = tinf.info(name)
        return weights[info.offset: info.offset + info.nbytes]

    block_linears(tinf, view, np)
    changed = {name for name, info in tinf.infos.items()
               if not np.array_equal(view(name), original[info.offset: info.offset + info.nbytes])}
    # wqkv 512 x 256, wo 256 x 256, w_gate_up 688 x 256 are blocked; w_down (cols 344 -> 384: 192-byte
    # rows) too; output 100 rows is not, nor anything that is not a linear.
    assert changed == {f"layers.{i}.{n}" for i in range(2) for n in ("wqkv", "wo", "w_gate_up", "w_down")}
