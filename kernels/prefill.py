"""Launching the prefill kernels of prefill.cu and the cuBLAS GEMM, and their NumPy references.

Shapes change with every chunk, so these are plain calls on the current stream rather than the
fixed Launch objects of the decode graph. Every scalar is wrapped in its NumPy type (CuPy passes
Python ints as 64-bit). The references compute what each kernel computes, rounding to fp16 at the
same points, and are what the CPU tests run the prefill driver with.
"""

from __future__ import annotations

import math

import numpy as np

from tinyinfer.kernels.build import allow_shared_memory, module

HEAD_DIMS = (64, 80, 96, 128)      # attention_prefill<HD>: a multiple of 16, at most 128
TILE_Q = 64                        # query rows per attention block (FA_BQ)
TILE_K = 64                        # keys per attention tile (FA_BK)
ATTENTION_THREADS = 128
LOG2E = 1.4426950408889634

# cuBLAS / CUDA enum values (cudaDataType_t, cublasComputeType_t, cublasOperation_t, cublasGemmAlgo_t).
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
_ONE = np.ones(1, dtype=np.float32)     # host scalars for alpha/beta: alive for the whole process
_ZERO = np.zeros(1, dtype=np.float32)


def supports_head_dim(head_dim: int) -> bool:
    return head_dim in HEAD_DIMS


def attention_name(head_dim: int) -> str:
    return f"attention_prefill<{head_dim}>"


def compile_prefill(compute_capability: int, head_dim: int):
    """The prefill module with the attention kernel for this head size."""
    return module("prefill.cu", (attention_name(head_dim),), compute_capability)


def blocks_for(n: int, threads: int = 256, cap: int = 65535) -> int:
    return max(1, min(cap, -(-n // threads)))


# ------------------------------------------------------------------------------------- launches

def embed_rows(mod, table, encoding_id: int, cols_pad: int, dim: int, ids, x) -> None:
    """x [T, dim] float32 = rows `ids` (int32 [T]) of the embedding table."""
    mod.get_function("embed_rows")((ids.size,), (256,), (table, np.int32(encoding_id), np.int32(cols_pad),
                                                         np.int32(dim), ids, x))


def rmsnorm_rows(mod, x, weight, rows: int, dim: int, eps: float, out) -> None:
    """out [rows, dim] fp16 = rms_norm(x [rows, dim]) * weight."""
    mod.get_function("rmsnorm_rows")((rows,), (256,), (x, weight, np.int32(dim), np.float32(eps), out))


def swiglu_rows(mod, gate_up, rows: int, ffn: int, out) -> None:
    """out [rows, ffn] fp16 = silu(gate) * up, gate_up [rows, 2 ffn] float32."""
    n = rows * ffn
    mod.get_function("swiglu_rows")((blocks_for(n),), (256,), (gate_up, np.int32(ffn), np.uint64(n), out))


def dequant(mod, encoding: str, weight_ptr: int, scale_ptr: int, rows: int, cols_pad: int, group: int,
            blocked: bool, out) -> None:
    """out [rows, cols_pad] fp16 = the q4/q8 matrix whose values start at weight_ptr (in 8-row
    blocks if `blocked`: kernels/layout.py)."""
    per_thread = 32 if encoding == "q4" else 16
    n = rows * cols_pad // per_thread
    mod.get_function(f"dequant_{encoding}")((blocks_for(n),), (256,), (
        np.uint64(weight_ptr), np.uint64(scale_ptr), np.int32(rows), np.int32(cols_pad), np.int32(group),
        np.int32(blocked), out))


def rope_store(mod, qkv, n_tokens: int, start: int, n_heads: int, n_kv: int, head_dim: int, rope_cos, rope_sin,
               q_out, k_cache, v_cache, bias=None) -> None:
    """q_out [n_heads, T, hd] fp16 (rotated, times log2(e)/sqrt(hd)); k (rotated) and v into the cache;
    bias (float32 [(n_heads + 2 n_kv) hd], Qwen2's) added to q, k and v first."""
    q_scale = np.float32(LOG2E / math.sqrt(head_dim))
    mod.get_function("rope_store")((n_tokens,), (256,), (
        qkv, bias if bias is not None else np.uint64(0), np.int32(n_tokens), np.int32(start), np.int32(n_heads),
        np.int32(n_kv), np.int32(head_dim), rope_cos, rope_sin, q_scale, q_out, k_cache, v_cache))


def attention_shared_bytes(head_dim: int) -> int:
    """Two buffers of a K and a V tile, rows padded by 8 halves (attention_prefill's dynamic shared memory)."""
    return 2 * 2 * TILE_K * (head_dim + 8) * 2


def attention(mod, q, k_cache, v_cache, n_tokens: int, start: int, n_heads: int, n_kv: int, head_dim: int,
              out, window: int | None = None) -> None:
    """out [T, n_heads * hd] fp16: causal attention of the chunk's queries over cache positions < start + T
    (each query over the last `window` of them, with a sliding window)."""
    grid = (-(-n_tokens // TILE_Q), n_heads)
    kernel = mod.get_function(attention_name(head_dim))
    shared = attention_shared_bytes(head_dim)
    allow_shared_memory(kernel, shared)
    kernel(grid, (ATTENTION_THREADS,), (q, k_cache, v_cache, np.int32(n_tokens), np.int32(start), np.int32(n_heads),
                                        np.int32(n_kv), np.int32(window or 0), out), shared_mem=shared)


def gemm(weight_ptr: int, n_out: int, k: int, ld_weight: int, x_ptr: int, n_tokens: int, ld_x: int, y_ptr: int,
         ld_y: int, accumulate: bool, stream) -> None:
    """y [T, n_out] float32 (+)= x [T, k] fp16 @ W[n_out, k]^T fp16, on the tensor cores through cuBLAS.

    Row-major y = x W^T is column-major y^T = W x^T: W (row-major, ld_weight) is op(A) = A^T,
    x^T is B as stored. fp32 accumulation and output; accumulate adds into y (the residual)."""
    from cupy.cuda import device
    from cupy_backends.cuda.libs import cublas

    handle = device.get_cublas_handle()
    cublas.setStream(handle, stream.ptr)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    beta = _ONE if accumulate else _ZERO
    cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tokens, k,
                  _ONE.ctypes.data, weight_ptr, CUDA_R_16F, ld_weight,
                  x_ptr, CUDA_R_16F, ld_x,
                  beta.ctypes.data, y_ptr, CUDA_R_32F, ld_y,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


# ----------------------------------------------------------------------------------- references

def dequant_reference(tensor) -> np.ndarray:
    """fp16 [rows, cols_pad] of a Tensor: to_float32() rounded once to fp16, padding columns zero."""
    from tinyinfer.formats.quant import padded_cols

    cols_pad = padded_cols(tensor.encoding, tensor.cols, tensor.group)
    out = np.zeros((tensor.rows, cols_pad), dtype=np.float16)
    out[:, : tensor.cols] = tensor.to_float32().reshape(tensor.rows, tensor.cols)
    return out


def rmsnorm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    from tinyinfer.runtime import reference as ref

    return ref.rms_norm(x, weight, eps).astype(np.float16)


def swiglu_reference(gate_up: np.ndarray) -> np.ndarray:
    from tinyinfer.runtime import reference as ref

    return ref.swiglu(gate_up).astype(np.float16)


def rope_store_reference(qkv: np.ndarray, start: int, n_heads: int, n_kv: int, head_dim: int, cos, sin,
                         bias: np.ndarray | None = None):
    """(q fp16 [n_heads, T, hd] pre-scaled, k fp16 [T, n_kv, hd] rotated, v fp16 [T, n_kv, hd])."""
    from tinyinfer.runtime import reference as ref

    if bias is not None:
        qkv = qkv + bias.astype(np.float32)
    n_tokens = qkv.shape[0]
    positions = np.arange(start, start + n_tokens)
    q_size, kv_size = n_heads * head_dim, n_kv * head_dim
    q = ref.apply_rope(qkv[:, :q_size].reshape(n_tokens, n_heads, head_dim), positions, cos, sin)
    k = ref.apply_rope(qkv[:, q_size: q_size + kv_size].reshape(n_tokens, n_kv, head_dim), positions, cos, sin)
    v = qkv[:, q_size + kv_size: q_size + 2 * kv_size].reshape(n_tokens, n_kv, head_dim)
    q = (q * np.float32(LOG2E / math.sqrt(head_dim))).astype(np.float16).transpose(1, 0, 2)
    return np.ascontiguousarray(q), k.astype(np.float16), v.astype(np.float16)


def attention_reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                        window: int | None = None) -> np.ndarray:
    """The kernel's algorithm in NumPy: fp16 [T, n_heads * hd] from q fp16 [n_heads, T, hd] (pre-scaled)
    and the fp16 cache [>= start + T, n_kv, hd], walking query tiles and key tiles as the kernel does
    (running max and sum in base 2, P rounded to fp16, keys beyond the tile's last query zeroed; with
    a window, from the tile of the first query's first key, keys before a row's window masked)."""
    n_heads, n_tokens, head_dim = q.shape
    group = n_heads // k_cache.shape[1]
    out = np.zeros((n_tokens, n_heads, head_dim), dtype=np.float32)
    for q0 in range(0, n_tokens, TILE_Q):
        rows = np.arange(q0, min(q0 + TILE_Q, n_tokens))
        positions = start + rows
        key_end = positions[-1] + 1
        key_begin = max(0, positions[0] - window + 1) if window else 0
        for head in range(n_heads):
            qh = q[head, rows].astype(np.float32)
            m = np.full(rows.size, -np.inf, dtype=np.float32)
            l = np.zeros(rows.size, dtype=np.float32)
            o = np.zeros((rows.size, head_dim), dtype=np.float32)
            for k0 in range(key_begin // TILE_K * TILE_K, key_end, TILE_K):
                keys = np.arange(k0, min(k0 + TILE_K, key_end))
                kt = k_cache[keys, head // group].astype(np.float32)
                vt = v_cache[keys, head // group].astype(np.float32)
                s = qh @ kt.T
                s[keys[None, :] > positions[:, None]] = -np.inf
                if window:
                    s[keys[None, :] <= positions[:, None] - window] = -np.inf
                new_m = np.maximum(m, s.max(axis=1))
                base = np.where(np.isneginf(new_m), 0, new_m)
                corr = np.exp2(m - base)
                p = np.exp2(s - base[:, None])
                l = l * corr + p.sum(axis=1)
                o = o * corr[:, None] + p.astype(np.float16).astype(np.float32) @ vt
                m = new_m
            out[rows, head] = o / l[:, None]
    return out.reshape(n_tokens, n_heads * head_dim).astype(np.float16)


def causal_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
                     window: int | None = None, block: int = 256) -> np.ndarray:
    """runtime.reference.attention computed with matrix products, `block` queries at a time (the same
    function, fast enough to be the oracle for 2048-token prompts). q [T, heads, hd] float32."""
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k_cache.shape[1]
    last = int(positions.max()) + 1
    keys = np.repeat(np.asarray(k_cache[:last], np.float32), group, axis=1).transpose(1, 2, 0)   # [h, hd, S]
    values = np.repeat(np.asarray(v_cache[:last], np.float32), group, axis=1).transpose(1, 0, 2)  # [h, S, hd]
    out = np.empty((n_tokens, n_heads, head_dim), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for b in range(0, n_tokens, block):
        qb = q[b: b + block].transpose(1, 0, 2)                          # [h, tb, hd]
        scores = (qb @ keys) * scale                                       # [h, tb, S]
        masked = np.arange(last)[None, :] > positions[b: b + block, None]  # [tb, S]
        if window:
            masked |= np.arange(last)[None, :] <= positions[b: b + block, None] - window
        scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[b: b + block] = (weights @ values).transpose(1, 0, 2)
    return out.reshape(n_tokens, n_heads * head_dim)


NEAR_TIE = 5e-3   # top-two logit gap, in units of the logits' rms, below which fp16 rounding may pick either


def logit_rms(logits: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.square(logits, dtype=np.float64), axis=-1))


def near_ties(logits: np.ndarray) -> np.ndarray:
    """Boolean mask of the positions whose top two logits are within NEAR_TIE of each other. With
    random weights and a 32000-word vocabulary that is ~2% of positions; fp16 rounding flips some of
    them (measured: even an exact computation over the fp16 KV cache flips one of 2048 positions of
    a 7B-shaped q8 model against the float32 reference), while NEAR_TIE is ~10x the prefill path's
    typical logit error."""
    top2 = np.sort(np.partition(logits, -2, axis=-1)[..., -2:], axis=-1)
    return (top2[..., 1] - top2[..., 0]) <= NEAR_TIE * logit_rms(logits)


def argmax_shortfall(reference: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """Per position, how far below its best logit the reference scores the token `picked` there, in
    units of the reference logits' rms: 0 where the pick is the reference's argmax, at most NEAR_TIE
    where it is the other side of a near tie, more for a wrong token."""
    chosen = np.take_along_axis(reference, np.asarray(picked)[..., None], axis=-1)[..., 0]
    return (reference.max(axis=-1) - chosen) / logit_rms(reference)
