"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_attention.py`; not part of the test suite):
decode attention at context 272 for TinyLlama and 7B shapes over
kernel constants (granule, rows in flight) and the slice count S. Times a CUDA graph of one launch per
layer (22 / 32 layers, each its own cache), us per launch."""
import numpy as np
import cupy as cp
from tinyinfer.kernels import attention as attn_k
from tinyinfer.kernels.build import expanded_source
from tinyinfer.runtime import reference as ref

from gpu_timing import graph_us_per_launch

SRC = expanded_source("attention.cu")

def compiled(granule, rows_tile, rows_split, warps=4):
    src = SRC.replace("#define ATT_GRANULE 16", f"#define ATT_GRANULE {granule}")
    src = src.replace("#define ATT_WARPS 4", f"#define ATT_WARPS {warps}").replace(
        "__launch_bounds__(32 * ATT_WARPS, 4)", f"__launch_bounds__(32 * ATT_WARPS, {16 // warps})")
    src = src.replace("static constexpr int ROWS = TILE ? 2 : 4;", f"static constexpr int ROWS = TILE ? {rows_tile} : {rows_split};")
    assert "#define ATT_GRANULE 16" in SRC and "ROWS = TILE ? 2 : 4;" in SRC, "attention.cu changed: update the sweep"
    return cp.RawModule(code=src, options=("--std=c++17", "-arch=sm_90a"), name_expressions=["attention<true>", "attention<false>"])

rng = np.random.default_rng(0)
for name, n_heads, n_kv, hd, layers in [("tinyllama", 32, 4, 64, 22), ("7b", 32, 32, 128, 32)]:
    ctx, pos = 2048, 271
    cos, sin = ref.rope_tables(hd, ctx, 10000.0, None)
    caches = [(cp.asarray(rng.standard_normal((ctx, n_kv, hd)).astype(np.float16)),
               cp.asarray(rng.standard_normal((ctx, n_kv, hd)).astype(np.float16))) for _ in range(layers)]
    qkv = cp.asarray(rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32))
    state = cp.asarray(np.array([pos, 0, 0, 0], np.int32))
    dcos, dsin = cp.asarray(cos), cp.asarray(sin)
    default_s = attn_k.n_slices(n_kv, ctx, 132)
    for granule, warps in ((16, 4), (16, 8), (16, 16), (32, 16)):
        for rows in ((2, 4),):
            mod = compiled(granule, *rows, warps)
            attn_k.WARPS = warps
            for S in sorted({1, 2, default_s, max(1, default_s // 4)}):
                part_o = cp.zeros(n_heads * S * hd, cp.float32); part_ml = cp.zeros(n_heads * S * 2, cp.float32)
                counters = cp.zeros(n_kv, cp.uint32); out = cp.zeros(n_heads * hd, cp.float32)
                launches = [attn_k.make_attention(mod, n_heads, n_kv, hd, S, qkv, k, v, state, dcos, dsin, part_o,
                                                  part_ml, counters, out) for k, v in caches]
                us = graph_us_per_launch(launches, 5)
                print(f"{name:10s} granule {granule:3d} warps {warps:2d} S {S:3d}: {us:6.2f} us", flush=True)
