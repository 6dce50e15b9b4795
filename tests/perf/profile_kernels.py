"""Launch representative decode kernels twice each, for Nsight Compute (tests/gpu_run.sh ncu).

The 7B gate_up and down GEMVs (q4 g64) in two configurations, TinyLlama's wqkv, and attention for
both shapes at context 272; read the second launch of each (the first warms up).
"""
import numpy as np
import cupy as cp

from tinyinfer.formats import tensor_nbytes
from tinyinfer.kernels import attention as attn_k
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels.build import device_compute_capability
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import random_encoded

cc = device_compute_capability()
rng = np.random.default_rng(0)
cases = [((22016, 4096), "rmsnorm", "swiglu", (2, 4)), ((22016, 4096), "rmsnorm", "store", (1, 8)),
         ((4096, 11008), "plain", "add", (1, 8)), ((2560, 2048), "rmsnorm", "store", (2, 8))]
for (rows, cols), inp, outp, (rt, w) in cases:
    t = random_encoded("q4", (rows, cols), 64, rng, 1 / np.sqrt(cols))
    shape = gemv_k.shape_of(t, inp, outp)
    mod = gemv_k.compile_gemvs([(shape, gemv_k.GemvConfig(rt, w))], cc)
    raw = np.zeros(tensor_nbytes("q4", (rows, cols), 64), np.uint8)
    for off, arr in t.parts():
        b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        raw[off: off + b.size] = b
    x = cp.asarray(rng.standard_normal(2 * cols).astype(np.float32))
    aux = cp.ones(cols, cp.float32)
    y = cp.zeros(rows, cp.float32)
    launch = gemv_k.make_gemv(mod, shape, gemv_k.GemvConfig(rt, w), cp.asarray(raw), x, y, aux, 1e-5)
    flush = cp.ones(256 << 20, cp.uint8)
    for _ in range(2):
        flush.sum()
        launch()
    cp.cuda.Device().synchronize()

for n_heads, n_kv, hd in [(32, 4, 64), (32, 32, 128)]:
    cluster = attn_k.uses_cluster(cc)
    mod = attn_k.compile_attention(cc, cluster)
    ctx = 2048
    slices = attn_k.n_slices(n_kv, ctx, 132, cluster)
    cos, sin = ref.rope_tables(hd, ctx, 10000.0, None)
    kc = cp.asarray(rng.standard_normal((ctx, n_kv, hd)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((ctx, n_kv, hd)).astype(np.float16))
    launch = attn_k.make_attention(mod, n_heads, n_kv, hd, slices, attn_k.threads_for(n_heads, n_kv, hd, slices, 132), cp.asarray(rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)),
                                   kc, vc, cp.asarray(np.array([271, 0, 0, 0], np.int32)), cp.asarray(cos), cp.asarray(sin),
                                   cp.zeros(n_heads * slices * hd, cp.float32), cp.zeros(n_heads * slices * 2, cp.float32),
                                   cp.zeros(n_kv, cp.uint32), cp.zeros(n_heads * hd, cp.float32))
    for _ in range(2):
        launch()
    cp.cuda.Device().synchronize()
print("profile launches done")
