"""Launching the batched decode kernels of batch.cu, how the GEMV splits its work, and the
kernels' NumPy references (what each computes, rounding to fp16 at the same points).

Every launch is a build.Launch with its scalars in their NumPy types, built once per batch size
and captured in that size's CUDA graph (runtime/cuda_batch.py); every kernel waits for the one
before it (pdl_wait), so each may be launched early (kernels/pdl.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tinyinfer.kernels.build import Launch, module

ROW_CHUNK = 8                # rows of h per mma (n of m16n8k16): a batch is padded to a multiple
GEMV_WARPS = 8               # BG_WARPS
ENCODING_ID = {"f16": 0, "q8": 1, "q4": 2}           # BG_F16, BG_Q8, BG_Q4
PIECE_COLS = {"f16": 32, "q8": 64, "q4": 128}        # columns of a 64-byte piece (BatchEncoding)
GEMV_NB = (1, 2, 4)          # batch_gemv<ENC, NB> instances: 8, 16 or 32 rows
STAGE_BYTES = 64 << 10       # shared memory for a block's staged h
BLOCKS_PER_SM = 2            # GEMV blocks resident per SM (__launch_bounds__ minimum)
MAX_WIDEN = 8                # the most tiles per warp a GEMV plan considers
BLOCK_START_ITEMS = 2        # gemv_cost: a block's start, in items
ATTENTION_WARPS = 8          # BA_WARPS (batch_attention_wide: twice as many)
ATTENTION_UNROLL = 4         # BA_UNROLL: key rows in flight per lane
MAX_GROUP = 8                # BA_MAX_GROUP: query heads per KV head
MMA_HEAD_DIMS = (64, 128)    # batch_attention_mma's instances
MMA_WARPS = 4                # its narrow instance's warps (the wide one: twice as many)
MAX_SHARED_BYTES = 227 << 10  # a block's opt-in shared memory on Hopper, where the device does not say
MAX_ROWS = 32
RMSNORM_THREADS = 1024       # BR_THREADS: batch_rmsnorm's largest block
RMSNORM_VEC = 4              # row elements per float4 of a batch_rmsnorm thread
MAX_DIM = 2 * RMSNORM_VEC * RMSNORM_THREADS     # batch_rmsnorm_wide: two float4 per thread
ROPE_THREADS = 64            # batch_rope_store's launch bound: a thread per pair of columns
MAX_HEAD_DIM = 2 * ROPE_THREADS


def gemv_name(encoding: str, padded: int) -> str:
    return f"batch_gemv<{ENCODING_ID[encoding]},{padded // ROW_CHUNK}>"


def compile_batch(compute_capability: int):
    names = tuple(gemv_name(e, ROW_CHUNK * nb) for e in ENCODING_ID for nb in GEMV_NB)
    return module("batch.cu", names, compute_capability)


def padded_rows(n_rows: int) -> int:
    """Rows the GEMV computes for a step of n_rows sequences (a multiple of 8, 8 <= . <= 32)."""
    if not 1 <= n_rows <= MAX_ROWS:
        raise ValueError(f"a batched step takes 1 to {MAX_ROWS} sequences")
    nb = -(-n_rows // ROW_CHUNK)
    return ROW_CHUNK * min(nb2 for nb2 in GEMV_NB if nb2 >= nb)


def can_run(encoding: str, rows: int, cols_pad: int, group: int) -> bool:
    """The batched GEMV reads q4, q8 and f16 in 8-row blocks (layout.can_block), groups of 32 columns
    or more."""
    if encoding not in ENCODING_ID:
        return False
    grouped = encoding == "f16" or (group >= 32 and group % 32 == 0)
    return rows % 8 == 0 and cols_pad % PIECE_COLS[encoding] == 0 and grouped


@dataclass(frozen=True)
class GemvPlan:
    rows: int
    kpad: int
    padded: int               # rows of h (8, 16 or 32)
    pieces_per_slice: int
    slices: int
    tiles_per_block: int
    piece_cols: int = PIECE_COLS["q4"]

    @property
    def grid(self) -> tuple[int, int]:
        tiles = -(-self.rows // 16)
        return -(-tiles // self.tiles_per_block), self.slices

    @property
    def shared_bytes(self) -> int:
        return self.padded * self.pieces_per_slice * self.piece_cols * 2

    @property
    def parts_floats(self) -> int:
        return self.slices * self.padded * self.rows


def plan_gemv(rows: int, kpad: int, padded: int, n_sms: int, encoding: str = "q4") -> GemvPlan:
    """The split of least cost (gemv_cost) over K slices (the staged h within STAGE_BYTES) and tiles
    per warp; among equal costs the fewest slices (the consumer adds every slice), then the fewest
    tiles per block."""
    piece_cols = PIECE_COLS[encoding]
    pieces = kpad // piece_cols
    max_pieces = max(1, STAGE_BYTES // (padded * piece_cols * 2))
    tiles = -(-rows // 16)
    row_groups = -(-tiles // GEMV_WARPS)
    target = BLOCKS_PER_SM * n_sms
    best = None
    for per_slice in range(min(pieces, max_pieces), 0, -1):
        slices = -(-pieces // per_slice)
        per_slice = -(-pieces // slices)                  # even slices
        for widen in range(1, MAX_WIDEN + 1):
            blocks = -(-row_groups // widen) * slices
            key = (gemv_cost(blocks, target, widen, per_slice, padded), slices, widen, per_slice)
            best = key if best is None or key < best else best
    _, slices, widen, per_slice = best
    return GemvPlan(rows, kpad, padded, per_slice, slices, GEMV_WARPS * widen, piece_cols)


def gemv_cost(blocks: int, target: int, tiles_per_warp: int, per_slice: int, padded: int) -> float:
    """A GEMV's time in units of one item (a warp's 16 rows x one piece): the grid runs in waves of
    `target` resident blocks and a partial wave takes as long as a full one; a block takes its warps'
    items, each tile's stored partial sums (padded / 16 items' worth of bytes), and a fixed start
    (staging h, filling the load pipeline)."""
    waves = -(-blocks // target)
    return waves * (tiles_per_warp * (per_slice + padded / 16) + BLOCK_START_ITEMS)


# ------------------------------------------------------------------------------------- launches

def make_gemv(mod, encoding: str, plan: GemvPlan, weight_ptr: int, scale_ptr: int, group: int, h, ldh: int, parts,
              name: str = "batch_gemv") -> Launch:
    """scale_ptr and group are ignored for f16 (pass 0)."""
    assert plan.piece_cols == PIECE_COLS[encoding]
    from tinyinfer.kernels.layout import row_bytes

    kernel = mod.get_function(gemv_name(encoding, plan.padded))
    return Launch(name, kernel, plan.grid, (GEMV_WARPS * 32,), (
        np.uint64(weight_ptr), np.uint64(scale_ptr), np.int32(plan.rows), np.int32(plan.kpad), np.int32(group or 32),
        h, np.int32(ldh), np.int32(plan.pieces_per_slice), np.int32(plan.tiles_per_block), parts),
        shared_mem=plan.shared_bytes, bytes_read=plan.rows * row_bytes(encoding, plan.kpad), waits=True)


def warps_of(threads: int) -> int:
    """threads rounded up to whole warps."""
    return 32 * -(-threads // 32)


def slice_args(parts, plan: GemvPlan | None):
    """(parts, slices, floats per slice) of a linear's output; no slices for a consumer with none."""
    if plan is None:
        return parts, np.int32(0), np.int64(0)
    return parts, np.int32(plan.slices), np.int64(plan.padded * plan.rows)


def make_rmsnorm(mod, n_rows: int, x, parts, plan, weight, dim: int, eps: float, out, ldo: int) -> Launch:
    if dim > MAX_DIM or dim % RMSNORM_VEC:
        raise ValueError(f"batch_rmsnorm takes rows of up to {MAX_DIM} elements, a multiple of {RMSNORM_VEC}")
    p, s, stride = slice_args(parts, plan)
    vecs = 1 if dim <= RMSNORM_VEC * RMSNORM_THREADS else 2
    name = "batch_rmsnorm" if vecs == 1 else "batch_rmsnorm_wide"
    threads = warps_of(-(-dim // (RMSNORM_VEC * vecs)))
    return Launch(name, mod.get_function(name), (n_rows,), (threads,), (
        x, p, s, stride, weight, np.int32(dim), np.float32(eps), out, np.int32(ldo)), waits=True)


def make_rope_store(mod, n_rows: int, parts, plan, bias, positions, slots, n_heads: int, n_kv: int, hd: int,
                    rope_cos, rope_sin, q_out, k_cache, v_cache, slot_stride: int) -> Launch:
    if not 2 <= hd <= MAX_HEAD_DIM or hd % 2:
        raise ValueError(f"batch_rope_store takes an even head_dim of up to {MAX_HEAD_DIM}")
    p, s, stride = slice_args(parts, plan)
    return Launch("batch_rope_store", mod.get_function("batch_rope_store"), (n_rows, n_heads + n_kv),
                  (warps_of(hd // 2),), (
        p, s, stride, bias if bias is not None else np.uint64(0), positions, slots, np.int32(n_heads),
        np.int32(n_kv), np.int32(hd), rope_cos, rope_sin, np.float32(1.0 / math.sqrt(hd)), q_out, k_cache, v_cache,
        np.int64(slot_stride)), waits=True)


def attention_warps(n_blocks: int, n_sms: int) -> int:
    """batch_attention_wide's warps where the padded step's grid (KV heads x padded rows) has fewer
    blocks than SMs (each block then makes one pass over twice the keys), else batch_attention's (two
    blocks per SM)."""
    return 2 * ATTENTION_WARPS if n_blocks < n_sms else ATTENTION_WARPS


def uses_mma(head_dim: int, group: int) -> bool:
    """batch_attention_mma serves head_dim 64 and 128 (groups up to MAX_GROUP); other shapes take the
    scalar kernels, whose scores in shared memory bound the positions per slot."""
    return head_dim in MMA_HEAD_DIMS and group <= MAX_GROUP


def attention_kernel(head_dim: int, group: int, n_blocks: int, n_sms: int) -> str:
    """The batched attention kernel for a padded step's grid of n_blocks (KV heads x padded rows): the
    tensor-core one with 8 warps a block where the grid has fewer blocks than SMs, else 4 (two or
    three blocks an SM); the scalar ones by attention_warps."""
    if uses_mma(head_dim, group):
        return f"batch_attention_mma{head_dim}_{2 * MMA_WARPS if n_blocks < n_sms else MMA_WARPS}"
    return "batch_attention" if attention_warps(n_blocks, n_sms) == ATTENTION_WARPS else "batch_attention_wide"


def attention_shared_bytes(head_dim: int, max_keys: int, group: int, warps: int = ATTENTION_WARPS) -> int:
    """The scores and the warps' p . V sums of one block: every query head of a KV head's group."""
    return 4 * group * (max_keys + warps * head_dim)


def attention_max_keys(shared_bytes: int, head_dim: int, group: int) -> int | None:
    """The most positions whose scores fit a block's shared memory at either width of the scalar
    kernels (attention_shared_bytes); None where the tensor-core kernel serves the shape (no bound)."""
    if uses_mma(head_dim, group):
        return None
    return shared_bytes // (4 * group) - 2 * ATTENTION_WARPS * head_dim


def attention_supports(n_heads: int, n_kv: int, head_dim: int) -> bool:
    return n_heads % n_kv == 0 and n_heads // n_kv <= MAX_GROUP and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


def make_attention(mod, n_rows: int, q, k_cache, v_cache, slot_stride: int, positions, slots, n_heads: int,
                   n_kv: int, hd: int, window: int | None, max_keys: int, out, ldo: int, n_sms: int,
                   kernel: str | None = None, early: bool = True) -> Launch:
    """kernel: force one (tests); by default attention_kernel's choice. It goes by the padded step's
    grid, as the GEMV plans: a row's sums do not depend on how many rows share its step, only on the
    padded size. early False: no early launch, for a step where a slot has several rows (a prompt's):
    the kernels load a row's keys below pos before their PDL wait, which holds only where row pos is
    the slot's one row written in the step."""
    group = n_heads // n_kv
    name = kernel or attention_kernel(hd, group, n_kv * padded_rows(n_rows), n_sms)
    if name.startswith("batch_attention_mma"):
        threads, shared = 32 * int(name.rsplit("_", 1)[1]), 0
    else:
        warps = ATTENTION_WARPS if name == "batch_attention" else 2 * ATTENTION_WARPS
        threads, shared = 32 * warps, attention_shared_bytes(hd, max_keys, group, warps)
    return Launch(name, mod.get_function(name), (n_kv, n_rows), (threads,), (
        q, k_cache, v_cache, np.int64(slot_stride), positions, slots, np.int32(n_heads), np.int32(n_kv),
        np.int32(hd), np.int32(window or 0), np.int32(max_keys), out, np.int32(ldo)),
        shared_mem=shared, waits=early)


def make_swiglu(mod, n_rows: int, parts, plan, ffn: int, out, ldo: int) -> Launch:
    p, s, stride = slice_args(parts, plan)
    blocks = max(1, min(4096, -(-n_rows * ffn // 256)))
    return Launch("batch_swiglu", mod.get_function("batch_swiglu"), (blocks,), (256,), (
        p, s, stride, np.int32(n_rows), np.int32(ffn), out, np.int32(ldo)), waits=True)


def make_logits(mod, n_rows: int, parts, plan, vocab: int, logits, best) -> Launch:
    p, s, stride = slice_args(parts, plan)
    return Launch("batch_logits", mod.get_function("batch_logits"), (n_rows,), (1024,), (
        p, s, stride, np.int32(vocab), logits, best), waits=True)


# ----------------------------------------------------------------------------------- references

def gemv_reference(h: np.ndarray, weight_fp16: np.ndarray) -> np.ndarray:
    """[rows_h, n] float32: h (fp16 [rows_h, kpad]) times the weight as prefill dequantizes it
    (fp16 [n, kpad]: prefill.dequant_reference, or an f16 tensor's values), in float64."""
    return (h.astype(np.float64) @ weight_fp16.astype(np.float64).T).astype(np.float32)


def weight_reference(tensor) -> np.ndarray:
    """fp16 [rows, kpad]: a linear as the batched GEMV multiplies it (prefill's dequantization, f16 as stored)."""
    if tensor.encoding == "f16":
        return np.asarray(tensor.data, np.float16)
    from tinyinfer.kernels import prefill as prefill_k

    return prefill_k.dequant_reference(tensor)


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    from tinyinfer.runtime import reference as ref

    return ref.rms_norm(x, weight, eps).astype(np.float16)


def rope_store_reference(qkv: np.ndarray, positions: np.ndarray, n_heads: int, n_kv: int, hd: int, cos, sin,
                         bias: np.ndarray | None = None):
    """(q float32 [B, n_heads, hd] times 1/sqrt(hd), k fp16 [B, n_kv, hd] rotated, v fp16 [B, n_kv, hd])."""
    from tinyinfer.runtime import reference as ref

    if bias is not None:
        qkv = qkv + bias.astype(np.float32)
    q_size, kv_size = n_heads * hd, n_kv * hd
    b = qkv.shape[0]
    q = ref.apply_rope(qkv[:, :q_size].reshape(b, n_heads, hd), positions, cos, sin) / np.float32(math.sqrt(hd))
    k = ref.apply_rope(qkv[:, q_size: q_size + kv_size].reshape(b, n_kv, hd), positions, cos, sin)
    v = qkv[:, q_size + kv_size:].reshape(b, n_kv, hd)
    return q.astype(np.float32), k.astype(np.float16), v.astype(np.float16)


def attention_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions, slots,
                        window: int | None = None) -> np.ndarray:
    """fp16 [B, n_heads * hd]: row b's query (pre-scaled, float32 [B, n_heads, hd]) over its slot's
    cache (fp16 [slots, ctx, n_kv, hd]) up to its position, by reference.attention."""
    from tinyinfer.runtime import reference as ref

    rows = []
    for b, (pos, slot) in enumerate(zip(positions, slots)):
        k = k_cache[slot, : pos + 1].astype(np.float32)
        v = v_cache[slot, : pos + 1].astype(np.float32)
        # reference.attention scales by 1/sqrt(hd); q here already carries it.
        unscaled = q[b: b + 1] * np.float32(math.sqrt(q.shape[-1]))
        rows.append(ref.attention(unscaled, k, v, np.array([pos]), window))
    return np.concatenate(rows).astype(np.float16)


def swiglu_reference(gate_up: np.ndarray) -> np.ndarray:
    from tinyinfer.runtime import reference as ref

    return ref.swiglu(gate_up).astype(np.float16)
