"""Launching the decode attention kernel of attention.cu, and its NumPy reference."""

from __future__ import annotations

import numpy as np

from tinyinfer.kernels.build import Launch, module

MIN_SLICE = 32        # global merge: at full context a slice holds at least this many positions
MAX_HEAD_DIM = 256
MAX_THREADS = 256     # ATT_THREADS in attention.cu: the most threads per block
MERGE_HEADS = 8       # ATT_MERGE_HEADS
STAGE_HALVES = 4096   # ATT_STAGE_HALVES
MAX_ITEMS = 4         # ATT_MAX_ITEMS
CLUSTER_SIZE = 8      # ATT_CLUSTER_SIZE
CLUSTER_MIN_COMPUTE_CAPABILITY = 90   # thread-block clusters (ATT_USE_CLUSTER)


def uses_cluster(compute_capability: int) -> bool:
    """Merge the slices inside thread-block clusters (Hopper and newer). Measured on an H200 in the
    decode graph, against the global merge: about 2 us per layer faster for TinyLlama and 7B."""
    return compute_capability >= CLUSTER_MIN_COMPUTE_CAPABILITY


def threads_for(n_heads: int, n_kv_heads: int, head_dim: int, slices: int, n_sms: int) -> int:
    """Threads per block: 256 when the grid has at most one block per SM (TinyLlama: 32 blocks), else
    128 (Llama-2-7B: 256 blocks; with 256 threads its decode step was 7% slower on an H200), and
    more where the p . V items of a large group need them."""
    threads = MAX_THREADS if n_kv_heads * slices <= n_sms else MAX_THREADS // 2
    while (n_heads // n_kv_heads) * head_dim > 8 * MAX_ITEMS * threads and threads < MAX_THREADS:
        threads *= 2
    return threads


def n_slices(n_kv_heads: int, max_context: int, n_sms: int, cluster: bool) -> int:
    """Grid width over the context: one cluster of CLUSTER_SIZE slices; else about two blocks per SM
    at full context, each of at least MIN_SLICE positions."""
    if cluster:
        return CLUSTER_SIZE
    most = -(-max_context // MIN_SLICE)
    return max(1, min(most, -(-2 * n_sms // n_kv_heads)))


def check_shape(n_heads: int, n_kv_heads: int, head_dim: int, threads: int = MAX_THREADS) -> None:
    """The kernel's limits (ValueError): head_dim a multiple of 8 up to MAX_HEAD_DIM, and a group
    whose p . V items fit MAX_ITEMS per thread."""
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim {head_dim} is not supported (a multiple of 8, at most {MAX_HEAD_DIM})")
    if n_heads % n_kv_heads or (n_heads // n_kv_heads) * head_dim > 8 * MAX_ITEMS * threads:
        raise ValueError(f"{n_heads} query heads over {n_kv_heads} KV heads of {head_dim} dims are not supported "
                         f"(at most {8 * MAX_ITEMS * threads} query values per KV head)")


def shared_bytes(n_heads: int, n_kv_heads: int, head_dim: int, slices: int, threads: int) -> int:
    """Mirrors the layout at the top of attention.cu's kernel."""
    group = n_heads // n_kv_heads
    stage = STAGE_HALVES // head_dim
    pad4 = lambda n: (n + 3) // 4 * 4
    floats = 2 * group * head_dim + pad4(group * stage) + pad4(3 * group) + pad4(2 * group) + pad4(MERGE_HEADS * slices)
    parts = max(1, threads // (group * head_dim // 8))
    staged = max(2 * 2 * stage * (head_dim + 8), 4 * parts * group * head_dim)   # later the p . V part sums
    return 4 * floats + 2 * 2 * head_dim + staged


def compile_attention(compute_capability: int, cluster: bool):
    """The kernel with the cluster merge (compute capability 9.0+) or the global merge."""
    return module("attention.cu", (), compute_capability, (f"-DATT_USE_CLUSTER={int(cluster)}",))


def make_attention(mod, n_heads: int, n_kv_heads: int, head_dim: int, slices: int, threads: int, qkv, k_cache,
                   v_cache, state, rope_cos, rope_sin, part_o, part_ml, counters, out, kv_bytes: int = 0) -> Launch:
    """One layer's attention. k_cache/v_cache: this layer's [max_context, n_kv, head_dim] fp16 views;
    part_o/part_ml/counters serve the global merge (GPUs before Hopper)."""
    check_shape(n_heads, n_kv_heads, head_dim, threads)
    args = (qkv, k_cache, v_cache, state, rope_cos, rope_sin, np.int32(n_heads), np.int32(n_kv_heads),
            np.int32(head_dim), part_o, part_ml, counters, out)
    return Launch("attention", mod.get_function("attention"), (n_kv_heads, slices), (threads,), args,
                  shared_bytes(n_heads, n_kv_heads, head_dim, slices, threads), bytes_read=kv_bytes, waits=True)


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
