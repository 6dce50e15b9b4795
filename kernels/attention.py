"""Launching the decode attention kernel of attention.cu, and its NumPy reference."""

from __future__ import annotations

import numpy as np

from tinyinfer.kernels.build import Launch, module

TILE = 32             # n_slices: at full context a slice holds at least this many positions
MAX_HEAD_DIM = 256
WARPS = 4             # ATT_WARPS in attention.cu
MERGE_HEADS = 8       # ATT_MERGE_HEADS
STAGE_HALVES = 4096   # ATT_STAGE_HALVES
CLUSTER_SIZE = 8      # ATT_CLUSTER_SIZE
CLUSTER_MIN_COMPUTE_CAPABILITY = 90   # thread-block clusters (ATT_USE_CLUSTER)


def use_tile(n_heads: int, n_kv_heads: int) -> bool:
    """Several query heads per pass over the K/V rows pay only when several heads share a K/V head."""
    return n_heads // n_kv_heads > 1


def uses_cluster(compute_capability: int, cluster: bool | None = None) -> bool:
    """Whether the kernel merges slices inside a thread-block cluster (Hopper and newer; `cluster`
    False forces the global merge, as a module compiled with -DATT_USE_CLUSTER=0 does)."""
    return compute_capability >= CLUSTER_MIN_COMPUTE_CAPABILITY if cluster is None else cluster


def n_slices(n_kv_heads: int, max_context: int, n_sms: int, cluster: bool) -> int:
    """Grid width over the context: one cluster of CLUSTER_SIZE slices; else about two blocks per SM
    at full context, at most one per tile."""
    if cluster:
        return CLUSTER_SIZE
    tiles = -(-max_context // TILE)
    return max(1, min(tiles, -(-2 * n_sms // n_kv_heads)))


def warps_for(n_heads: int, n_kv_heads: int, tile: bool) -> int:
    """Both variants: WARPS warps, taking (head chunk, context range) pairs."""
    return WARPS


def heads_per_pass(tile: bool) -> int:
    """AttConfig<TILE>::HEADS in attention.cu."""
    return 4 if tile else 1


def shared_bytes(n_heads: int, n_kv_heads: int, head_dim: int, slices: int, tile: bool) -> int:
    """Mirrors the layout at the top of attention.cu's kernel."""
    group = n_heads // n_kv_heads
    chunks = -(-group // heads_per_pass(tile))
    parts = max(1, WARPS // chunks)
    pad4 = lambda n: (n + 3) // 4 * 4
    floats = (2 + parts) * group * head_dim + pad4(2 * parts * group) + pad4(2 * group)
    stage_rows = STAGE_HALVES // head_dim
    return 4 * floats + 2 * 2 * head_dim + 4 * pad4(MERGE_HEADS * slices) + 2 * 2 * stage_rows * head_dim


def compile_attention(compute_capability: int, cluster: bool | None = None):
    """cluster=False builds the global-merge variant even where clusters exist (for tests)."""
    defines = () if cluster is None else (f"-DATT_USE_CLUSTER={int(cluster)}",)
    return module("attention.cu", ("attention<true>", "attention<false>"), compute_capability, defines)


def make_attention(mod, n_heads: int, n_kv_heads: int, head_dim: int, slices: int, qkv, k_cache, v_cache,
                   state, rope_cos, rope_sin, part_o, part_ml, counters, out, tile: bool | None = None,
                   kv_bytes: int = 0) -> Launch:
    """One layer's attention. k_cache/v_cache: this layer's [max_context, n_kv, head_dim] fp16 views."""
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim {head_dim} is not supported (a multiple of 8, at most {MAX_HEAD_DIM})")
    tile = use_tile(n_heads, n_kv_heads) if tile is None else tile
    kernel = mod.get_function("attention<true>" if tile else "attention<false>")
    args = (qkv, k_cache, v_cache, state, rope_cos, rope_sin, np.int32(n_heads), np.int32(n_kv_heads),
            np.int32(head_dim), part_o, part_ml, counters, out)
    return Launch("attention" + ("_tile" if tile else "_split"), kernel, (n_kv_heads, slices),
                  (32 * warps_for(n_heads, n_kv_heads, tile),), args,
                  shared_bytes(n_heads, n_kv_heads, head_dim, slices, tile), bytes_read=kv_bytes, waits=True)


def attention_reference(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: int, n_heads: int,
                        n_kv_heads: int, head_dim: int, cos: np.ndarray, sin: np.ndarray):
    """(out [n_heads*hd], new k row, new v row) for one token at `pos`, from runtime.reference.

    k_cache/v_cache: [>pos, n_kv, hd] holding positions < pos (float32 values of the fp16 cache). The
    new K/V rows are rounded to fp16 as the kernel stores them before reading them back.
    """
    from tinyinfer.runtime import reference as ref

    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    positions = np.array([pos])
    q = ref.apply_rope(qkv[None, :q_size].reshape(1, n_heads, head_dim), positions, cos, sin)
    k = ref.apply_rope(qkv[None, q_size: q_size + kv_size].reshape(1, n_kv_heads, head_dim), positions, cos, sin)
    v = qkv[q_size + kv_size: q_size + 2 * kv_size].reshape(n_kv_heads, head_dim)
    k_row = k[0].astype(np.float16).astype(np.float32)
    v_row = v.astype(np.float16).astype(np.float32)
    keys = np.array(k_cache[: pos + 1], dtype=np.float32)
    values = np.array(v_cache[: pos + 1], dtype=np.float32)
    keys[pos], values[pos] = k_row, v_row
    return ref.attention(q, keys, values, positions)[0], k_row, v_row
