"""Launching the fused MLP of mlp.cu (gate/up and down projections in one kernel, Hopper), and its
NumPy reference.

An MlpShape pairs the two GEMV shapes it replaces (the fused [gate; up] matrix with RMSNorm and
SwiGLU, the down matrix); an MlpConfig is the tunable part (warps per block, ring depth, row tiles
per item). The kernel
adds its output to `pending`, the residual held in int64 fixed point (common.cuh), which the GEMVs
around it read and write: see mlp.cu.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyinfer.kernels.build import Launch, module
from tinyinfer.kernels.gemv import (CHUNK_K, ENCODING_ID, STEP_DEPTHS, WIDE_WARPS, GemvShape, gemv_reference,
                                    scale_offset)

CLUSTER = 8                  # blocks per cluster (mlp.cu MLP_CLUSTER)
TILES = 4                    # phase-1 tiles per block (mlp.cu T): 8 * TILES outputs
SLICE = 8 * TILES * CLUSTER  # FFN columns per cluster
MIN_COMPUTE_CAPABILITY = 90  # thread-block clusters
PENDING_ONE = 2.0 ** 32      # the fixed point of the residual `pending` (common.cuh PENDING_ONE)


@dataclass(frozen=True)
class MlpShape:
    gate_up: GemvShape       # rows 2 ffn, cols dim; rmsnorm input, swiglu output
    down: GemvShape          # rows dim, cols ffn

    @property
    def key(self) -> str:
        return f"mlp[{self.gate_up.key}|{self.down.key}]"

    @property
    def weight_bytes(self) -> int:
        return self.gate_up.weight_bytes + self.down.weight_bytes


@dataclass(frozen=True)
class MlpConfig:
    warps: int = 8           # 8, or WIDE_WARPS (one block per SM)
    depth: int = 2           # ring slots per warp, across both phases
    row_tiles: int = 1       # 16-row tiles per item (mlp.cu RT, as gemv's R)

    @property
    def wide(self) -> bool:
        return self.warps == WIDE_WARPS

    @property
    def label(self) -> str:
        return f"mlp/R{self.row_tiles}/w{self.warps}/d{self.depth}"

    def as_dict(self) -> dict:
        return {"warps": self.warps, "depth": self.depth, "row_tiles": self.row_tiles}


# What the tuner tries. Not 16 warps: on TinyLlama its 176 blocks need two rounds of an H200's 132 SMs,
# and it stepped slower than 8 warps (kernels/README.md, "Fused MLP").
# Depths as gemv.STEP_DEPTHS: with R = 2, depths 3 and 4 spill (nvcc, sm_90).
CANDIDATES = tuple(MlpConfig(8, depth, rt) for rt in (1, 2) for depth in STEP_DEPTHS[rt])


def fits(shape: MlpShape, config: MlpConfig) -> bool:
    """Whether this configuration's work split divides the shape: K of the gate/up matrix in whole
    chunks for every warp of a tile group, and whole groups of row tiles of the down matrix per block."""
    chunk, dim = CHUNK_K[shape.gate_up.encoding], shape.gate_up.cols
    warps_per_group = config.warps * config.row_tiles // TILES
    return dim % (chunk * warps_per_group) == 0 and dim % (16 * config.row_tiles * CLUSTER) == 0


def can_fuse(shape: MlpShape, compute_capability: int) -> bool:
    """Whether mlp.cu runs this pair in every configuration the tuner tries: clusters (Hopper), both
    matrices in 8-row blocks with one encoding, whole slices of the FFN."""
    gu, down = shape.gate_up, shape.down
    ffn, dim = gu.rows // 2, gu.cols
    return (compute_capability >= MIN_COMPUTE_CAPABILITY and gu.blocked and down.blocked
            and (gu.encoding, gu.group) == (down.encoding, down.group) and gu.input == "rmsnorm"
            and gu.output == "swiglu" and down.rows == dim and down.cols == ffn and ffn % SLICE == 0
            and SLICE % CHUNK_K[gu.encoding] == 0 and gu.cols_pad == dim
            and all(fits(shape, config) for config in CANDIDATES))


def blocks(shape: MlpShape) -> int:
    """The kernel's grid: a cluster of CLUSTER blocks per SLICE of the FFN."""
    return shape.gate_up.rows // 2 // SLICE * CLUSTER


def name_expression(shape: MlpShape, config: MlpConfig) -> str:
    gu = shape.gate_up
    return f"mlp<{ENCODING_ID[gu.encoding]},{gu.group},{TILES},{config.row_tiles},{config.depth},{int(config.wide)}>"


def shared_bytes(shape: MlpShape, config: MlpConfig) -> int:
    """mlp.cu's layout: per-warp sums, the slice, x staged (+ 64 zero bytes per warp, bias corrections),
    the slice staged, the warps' sums of squares."""
    kpl = CHUNK_K[shape.gate_up.encoding] // 8
    dim = shape.gate_up.cols_pad
    staged = lambda k: 2 * 2 * (k + k // 64 * 8) + 32      # hi and lo (gemv.cu staged_index), 32 bytes apart
    return (4 * (config.warps * config.row_tiles * 16 + SLICE) + staged(dim) + 64 * config.warps + 4 * dim // kpl
            + staged(SLICE) + 4 * SLICE // kpl + 4 * config.warps)


def compile_mlp(shape: MlpShape, config: MlpConfig, compute_capability: int):
    return module("mlp.cu", (name_expression(shape, config),), compute_capability)


def make_mlp(mod, shape: MlpShape, config: MlpConfig, gate_up, down, x, norm, eps: float, pending,
             name: str = "mlp") -> Launch:
    """pending += W_down swiglu(W_gate_up rms_norm(x, norm, eps)), one cluster per SLICE of the FFN.
    gate_up, down: CuPy uint8 arrays of the two tensors in the blocked layout."""
    gu, dn = shape.gate_up, shape.down
    if not fits(shape, config):
        raise ValueError(f"{config.label} does not divide {shape.key}")
    kernel = mod.get_function(name_expression(shape, config))

    def pointers(tensor, gemv_shape):
        ptr = tensor.data.ptr
        return np.uint64(ptr), np.uint64(ptr + scale_offset(gemv_shape))     # f16: no scales, offset 0

    args = (*pointers(gate_up, gu), *pointers(down, dn), np.int32(gu.cols), np.int32(gu.rows // 2),
            np.int32(gu.cols_pad), np.int32(dn.cols_pad), x, norm, np.float32(eps), pending)
    return Launch(name, kernel, (blocks(shape),), (32 * config.warps,), args, shared_bytes(shape, config),
                  bytes_read=shape.weight_bytes, waits=True, cluster=CLUSTER)


def mlp_reference(gate_up_tensor, down_tensor, x: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """What the kernel adds to pending (as float32): W_down swiglu(W_gate_up rms_norm(x)), the two
    GEMVs it replaces."""
    h = gemv_reference(gate_up_tensor, x, "rmsnorm", norm, eps, output="swiglu")
    return gemv_reference(down_tensor, h)
