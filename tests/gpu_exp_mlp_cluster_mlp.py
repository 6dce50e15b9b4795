"""s17: do clusters of 8 slow the streaming? Alone (after an L2 flush, PDL, 22 launches over 4 weight
copies), f16 and q4, dim 2048, FFN 5632: the gate/up GEMV (R2/w8/d2, 264 blocks) launched plainly and
in clusters of 8 (it uses no cluster feature); the fused MLP's phase 1 without the exchange, in
clusters of 8 and plainly; and with the weight ring deeper."""
import copy
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path.cwd() / "tests"))
from tinf_samples import device_bytes  # noqa: E402
from tinyinfer.kernels import gemv as gemv_k  # noqa: E402
from tinyinfer.kernels import misc as misc_k  # noqa: E402
from tinyinfer.kernels import mlp as mlp_k  # noqa: E402
from tinyinfer.kernels.build import compile_options, expanded_source  # noqa: E402
from tinyinfer.runtime import autotune  # noqa: E402
from tinyinfer.runtime.bench import random_encoded  # noqa: E402

CUT = "    cluster_wait();                    // every block of the cluster runs"
cc = int(cp.cuda.Device().compute_capability)
misc = misc_k.compile_misc(cc)
stream = cp.cuda.Stream(non_blocking=True)
flush_buf = cp.ones(100 << 20, dtype=cp.uint8)
sink = cp.zeros(1, dtype=cp.uint32)
flush = misc_k.make_read_bandwidth(misc, flush_buf, sink, 132)
wait = lambda ns: misc_k.make_wait(misc, ns)
KERNELS = {}


def variant(launch, shape, config, cluster, edits=()):
    expr = mlp_k.name_expression(shape, config)
    key = (expr, cluster, edits)
    if key not in KERNELS:
        src = expanded_source("mlp.cu")
        assert CUT in src
        src = src.replace(CUT, "    return;\n" + CUT)
        if cluster == 1:
            src = src.replace("    cluster_arrive_relaxed();          // pairs", "    // pairs")
        for old, new in edits:
            assert old in src, old
            src = src.replace(old, new)
        KERNELS[key] = cp.RawModule(code=src, options=compile_options(cc), name_expressions=[expr]).get_function(expr)
    out = copy.copy(launch)
    out.kernel = KERNELS[key]
    out.cluster = cluster
    out._driver_launches = {}
    return out


def clustered(launch, cluster):
    out = copy.copy(launch)
    out.cluster = cluster
    out._driver_launches = {}
    return out


def alone(launches):
    with stream:
        return autotune.time_launches(launches * (22 // len(launches)) + launches[: 22 % len(launches)], stream, wait,
                                      flush, repeats=5, early=True)


for enc in ("f16", "q4"):
    ffn = 5632
    rng = np.random.default_rng(0)
    group = None if enc == "f16" else 64
    gu = random_encoded(enc, (2 * ffn, 2048), group, rng, 0.02)
    dn = random_encoded(enc, (2048, ffn), group, rng, 0.02)
    s_gu, s_dn = gemv_k.shape_of(gu, "rmsnorm", "swiglu"), gemv_k.shape_of(dn, "plain", "add")
    shape = mlp_k.MlpShape(s_gu, s_dn)
    w_gu = [cp.asarray(device_bytes(gu, s_gu)) for _ in range(4)]
    w_dn = [cp.asarray(device_bytes(dn, s_dn)) for _ in range(4)]
    x = cp.asarray(rng.standard_normal(2048).astype(np.float32))
    norm = cp.ones(2048, dtype=cp.float32)
    h = cp.zeros(ffn, dtype=cp.float32)
    pending = cp.zeros(2048, dtype=cp.int64)
    for gu_cfg in (gemv_k.GemvConfig(2, 8, depth=2), gemv_k.GemvConfig(1, 8, depth=2), gemv_k.GemvConfig(1, 8, depth=4)):
        mods = gemv_k.compile_gemvs([(s_gu, gu_cfg)], cc)
        g_l = [gemv_k.make_gemv(mods, s_gu, gu_cfg, w, x, h, norm, 1e-5) for w in w_gu]
        line = f"{enc} gate/up {gu_cfg.label} ({g_l[0].grid[0]} blocks): plain {alone(g_l):.2f}"
        if g_l[0].grid[0] % 8 == 0:
            line += f", in clusters of 8 {alone([clustered(z, 8) for z in g_l]):.2f}"
        print(line, flush=True)
    for config in (mlp_k.MlpConfig(8, 2), mlp_k.MlpConfig(8, 4)):
        m_l = [mlp_k.make_mlp(mlp_k.compile_mlp(shape, config, cc), shape, config, a, b, x, norm, 1e-5, pending)
               for a, b in zip(w_gu, w_dn)]
        line = f"{enc} {config.label}: phase 1 without the exchange, clusters of 8 {alone([variant(m, shape, config, 8) for m in m_l]):.2f}"
        line += f", plain {alone([variant(m, shape, config, 1) for m in m_l]):.2f}"
        print(line, flush=True)
