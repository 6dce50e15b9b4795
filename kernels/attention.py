"""Launching the decode attention kernels of attention.cu, and their NumPy reference.

Three kernels, chosen by shape (`plan`): `attention_mma64/128` (a block per KV head, or at long
contexts a cluster of blocks sharing its rows; the cached rows in registers, products on the tensor
cores) for groups of at most MMA_MAX_GROUP query heads per
KV head of head_dim 64 or 128; else `attention_rows` (a block per query head, the cached rows in
registers) for groups of at least ROWS_MIN_GROUP; else `attention` (a block per KV head and context
slice, chunks staged in shared memory, every row read once per group, the slices merged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
ROW_REGS = 8          # ATT_ROW_REGS: K/V rows a lane group of attention_rows holds in registers
PASS_ROWS = 256       # attention_rows: rows a block holds per pass (about)
ROWS_MIN_GROUP = 8    # attention_rows serves groups of at least this many query heads per KV head
MMA_MAX_GROUP = 8     # MMA_MAX_GROUP: attention_mma's A rows 8-15 carry the low halves of q
MMA_HEAD_DIMS = (64, 128)
MMA_THREADS = 256     # 32 * MMA_WARPS
SMS_PER_SLICE = 2     # attention_mma at long contexts: at most one block per this many SMs


def uses_cluster(compute_capability: int) -> bool:
    """Merge the slices inside thread-block clusters (Hopper and newer): faster in the decode graph
    than the global merge (kernels/README.md, "Attention kernels")."""
    return compute_capability >= CLUSTER_MIN_COMPUTE_CAPABILITY


def threads_for(n_heads: int, n_kv_heads: int, head_dim: int, slices: int, n_sms: int) -> int:
    """Threads per block: 256 when the grid has at most one block per SM (TinyLlama: 32 blocks), else
    128 (Llama-2-7B: 256 blocks, whose decode step was slower with 256 threads), and
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


def rows_per_lane_group(head_dim: int, threads: int) -> int:
    """attention_rows: K/V rows each lane group holds per pass, so that a pass covers about
    PASS_ROWS rows (the first pass's go out before the PDL wait)."""
    lanes = 1
    while lanes < head_dim // 8:
        lanes *= 2
    return max(1, min(ROW_REGS, -(-PASS_ROWS // (threads // lanes))))


@dataclass(frozen=True)
class AttentionPlan:
    kernel: str       # the function: "attention_mma64" / "attention_mma128", "attention_rows" or "attention"
    cluster: bool     # the module is compiled with thread-block clusters (ATT_USE_CLUSTER)
    slices: int       # blocks per KV head
    threads: int      # per block
    long_slices: int = 1   # attention_mma: blocks per KV head (a cluster) for steps at positions >= long_from
    long_from: int = 0     # 0: no long-context variant

    def slices_at(self, long_context: bool) -> int:
        return self.long_slices if long_context else self.slices


def plan(n_heads: int, n_kv_heads: int, head_dim: int, max_context: int, n_sms: int, compute_capability: int,
         kernel: str | None = None) -> AttentionPlan:
    """The kernel for a shape. attention_mma (a block per KV head, the products on the tensor cores)
    where it fits (mma_fits): it made both TinyLlama's and Llama-2-7B's decode steps faster than the
    other two kernels (kernels/README.md, "Attention kernels"). Else attention_rows (a block per
    query head) for groups of at least
    ROWS_MIN_GROUP query heads per KV head, and the chunked kernel for the rest. attention_mma also
    gets a long-context variant where clusters exist: mma_long_slices blocks per KV head from
    mma_long_from (the backend captures a second step graph for those positions).
    kernel ("mma" / "rows" / "chunked") forces one; so does TINYINFER_ATTENTION (for measurements)."""
    kernel = kernel or os.environ.get("TINYINFER_ATTENTION") or None
    if kernel not in (None, "mma", "rows", "chunked"):
        raise ValueError(f"unknown attention kernel {kernel!r} (mma, rows or chunked)")
    group = n_heads // n_kv_heads
    if kernel == "mma" or (kernel is None and mma_fits(n_heads, n_kv_heads, head_dim)):
        if not mma_fits(n_heads, n_kv_heads, head_dim):
            raise ValueError(f"attention_mma serves at most {MMA_MAX_GROUP} query heads per KV head of head_dim "
                             f"{' or '.join(map(str, MMA_HEAD_DIMS))}, not {group} of {head_dim}")
        long_slices = mma_long_slices(n_kv_heads, n_sms, compute_capability)
        long_from = mma_long_from(head_dim, long_slices)
        if long_slices == 1 or long_from >= max_context:
            long_slices, long_from = 1, 0
        return AttentionPlan(f"attention_mma{head_dim}", False, 1, MMA_THREADS, long_slices, long_from)
    if kernel == "rows" or (kernel is None and group >= ROWS_MIN_GROUP):
        slices, cluster, name = group, False, "attention_rows"
    else:
        cluster = uses_cluster(compute_capability)
        slices, name = n_slices(n_kv_heads, max_context, n_sms, cluster), "attention"
    return AttentionPlan(name, cluster, slices, threads_for(n_heads, n_kv_heads, head_dim, slices, n_sms))


def mma_long_from(head_dim: int, long_slices: int) -> int:
    """The first position of the long-context step: where one block would need a second pass when
    the split's merge is one peer's state (2 blocks), else a third (the merge of more costs more;
    kernels/README.md, "Context split")."""
    return mma_pass_rows(head_dim) * (1 if long_slices <= 2 else 2)


def mma_pass_rows(head_dim: int) -> int:
    """Cached rows one attention_mma block holds per pass (attention.cu PASS_ROWS): 256 for head_dim
    64, 128 for 128. Each pass after the first costs a dependent round trip after the PDL wait."""
    return (MMA_THREADS // 32) * 16 * (128 // head_dim)


def mma_long_slices(n_kv_heads: int, n_sms: int, compute_capability: int) -> int:
    """attention_mma's blocks per KV head at long contexts (a thread-block cluster sharing the rows;
    Hopper and newer): the most, up to CLUSTER_SIZE, whose grid leaves half the SMs to the kernels
    launched early beside it (SMS_PER_SLICE).

    At long contexts the split saves passes, at short ones the cluster's merge costs more than the
    passes it saves (kernels/README.md, "Context split"). Hence one block per KV head at short
    contexts and this many from mma_long_from on."""
    if compute_capability < CLUSTER_MIN_COMPUTE_CAPABILITY:
        return 1
    slices = 1
    while slices < CLUSTER_SIZE and 2 * slices * n_kv_heads * SMS_PER_SLICE <= n_sms:
        slices *= 2
    return slices


def mma_shared_bytes(n_heads: int, n_kv_heads: int, head_dim: int, slices: int) -> int:
    """attention_mma's dynamic shared memory: with a split, block 0 gathers every block's state
    (attention.cu `gathered`: per block and head, head_dim sums, a max and a denominator)."""
    return 0 if slices == 1 else 4 * slices * (n_heads // n_kv_heads) * (head_dim + 2)


def mma_fits(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """attention_mma's shapes: at most MMA_MAX_GROUP query heads per KV head, head_dim 64 or 128."""
    return n_heads // n_kv_heads <= MMA_MAX_GROUP and head_dim in MMA_HEAD_DIMS


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
                   v_cache, state, rope_cos, rope_sin, part_o, part_ml, counters, out, kv_bytes: int = 0,
                   kernel: str = "attention", window: int | None = None) -> Launch:
    """One layer's attention. k_cache/v_cache: this layer's [max_context, n_kv, head_dim] fp16 views;
    part_o/part_ml/counters serve the chunked kernel's global merge (GPUs before Hopper).
    kernel "attention_rows" (see plan) takes a block per query head and none of the merge buffers;
    "attention_mma64/128" `slices` blocks per KV head (a cluster) and none of them. window: the sliding
    window in positions (Mistral, Qwen2), None for full causal attention."""
    check_shape(n_heads, n_kv_heads, head_dim, threads)
    head_args = (np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim))
    window_arg = np.int32(window or 0)           # 0: full causal attention
    if kernel.startswith("attention_mma"):
        if kernel != f"attention_mma{head_dim}" or not mma_fits(n_heads, n_kv_heads, head_dim):
            raise ValueError(f"{kernel} does not serve {n_heads} query heads over {n_kv_heads} KV heads of {head_dim} "
                             "dims")
        args = (qkv, k_cache, v_cache, state, rope_cos, rope_sin, *head_args[:2], np.int32(k_cache.shape[0]),
                window_arg, out)
        return Launch("attention", mod.get_function(kernel), (n_kv_heads * slices,), (MMA_THREADS,), args,
                      mma_shared_bytes(n_heads, n_kv_heads, head_dim, slices), bytes_read=kv_bytes, waits=True,
                      cluster=slices)
    if kernel == "attention_rows":
        if slices != n_heads // n_kv_heads:
            raise ValueError(f"attention_rows runs a block per query head: {n_heads // n_kv_heads} per KV head, "
                             f"not {slices}")
        args = (qkv, k_cache, v_cache, state, rope_cos, rope_sin, *head_args, np.int32(k_cache.shape[0]),
                np.int32(rows_per_lane_group(head_dim, threads)), window_arg, out)
        return Launch("attention", mod.get_function(kernel), (n_kv_heads, slices), (threads,), args, 0,
                      bytes_read=kv_bytes, waits=True)
    args = (qkv, k_cache, v_cache, state, rope_cos, rope_sin, *head_args, part_o, part_ml, counters, window_arg, out)
    return Launch("attention", mod.get_function("attention"), (n_kv_heads, slices), (threads,), args,
                  shared_bytes(n_heads, n_kv_heads, head_dim, slices, threads), bytes_read=kv_bytes, waits=True)


def attention_reference(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: int, n_heads: int,
                        n_kv_heads: int, head_dim: int, cos: np.ndarray, sin: np.ndarray, window: int | None = None):
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
    return ref.attention(q, keys, values, positions, window)[0], k_row, v_row
