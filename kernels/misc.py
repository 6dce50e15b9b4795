"""Launching the small kernels of misc.cu: embedding gather, read-bandwidth probe, GPU-side wait."""

from __future__ import annotations

import numpy as np

from tinyinfer.kernels.build import Launch, module

EMBEDDING_ID = {"f32": 0, "f16": 1, "bf16": 2}


def compile_misc(compute_capability: int):
    return module("misc.cu", (), compute_capability)


def make_embed(mod, table, encoding: str, cols_pad: int, dim: int, state, x, pending=None, head_best=None) -> Launch:
    """x = the embedding of the state's token, also written into the fixed-point residual of a fused
    step (`pending`, kernels/mlp.py) where given; head_best, the output head's argmax key
    (kernels/sampling.py), is cleared where given."""
    if encoding not in EMBEDDING_ID:
        raise ValueError(f"no embedding kernel for encoding {encoding}")
    kernel = mod.get_function("embed")
    args = (table, np.int32(EMBEDDING_ID[encoding]), np.int32(cols_pad), np.int32(dim), state, x,
            pending if pending is not None else np.uint64(0), head_best if head_best is not None else np.uint64(0))
    itemsize = 4 if encoding == "f32" else 2
    return Launch("embed", kernel, (max(1, min(64, -(-dim // 256))),), (256,), args, 0, bytes_read=dim * itemsize)


def make_read_bandwidth(mod, data, sink, n_sms: int) -> Launch:
    """Read all of `data` (CuPy array, size a multiple of 16 bytes) once."""
    kernel = mod.get_function("read_bandwidth")
    args = (data, np.uint64(data.nbytes // 16), np.uint32(0x9E3779B9), sink)
    return Launch("read_bandwidth", kernel, (n_sms * 8,), (512,), args, 0, bytes_read=data.nbytes)


def make_wait(mod, nanoseconds: int) -> Launch:
    return Launch("wait", mod.get_function("gpu_wait"), (1,), (1,), (np.int64(nanoseconds),))
