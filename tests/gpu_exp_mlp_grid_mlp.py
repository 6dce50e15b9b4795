"""s17: is the fused MLP's phase 1 slow because 176 blocks (22 clusters of 8) share 132 SMs unevenly?
Alone (after an L2 flush, PDL, 22 launches over 4 weight copies), dim 2048: FFN 5632 (176 blocks) and
8448 (33 clusters: 264 blocks, two on every SM): gate/up and down GEMVs, fused, fused phase 1 only."""
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

MARK = "    // Phase 2: each tile's rows"
cc = int(cp.cuda.Device().compute_capability)
misc = misc_k.compile_misc(cc)
stream = cp.cuda.Stream(non_blocking=True)
flush_buf = cp.ones(100 << 20, dtype=cp.uint8)
sink = cp.zeros(1, dtype=cp.uint32)
flush = misc_k.make_read_bandwidth(misc, flush_buf, sink, 132)
wait = lambda ns: misc_k.make_wait(misc, ns)


def phase1(launch, shape, config):
    expr = mlp_k.name_expression(shape, config)
    src = expanded_source("mlp.cu").replace(MARK, "    return;\n" + MARK)
    mod = cp.RawModule(code=src, options=compile_options(cc), name_expressions=[expr])
    out = copy.copy(launch)
    out.kernel = mod.get_function(expr)
    out._driver_launches = {}
    return out


def alone(launches):
    with stream:
        return autotune.time_launches(launches * (22 // len(launches)) + launches[: 22 % len(launches)], stream, wait,
                                      flush, repeats=5, early=True)


for enc, gu_cfg in (("f16", gemv_k.GemvConfig(2, 16, depth=2)), ("q4", gemv_k.GemvConfig(2, 8, depth=1))):
    for ffn in (5632, 8448):
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
        y = cp.zeros(2048, dtype=cp.float32)
        pending = cp.zeros(2048, dtype=cp.int64)
        dn_cfg = gemv_k.GemvConfig(1, 16, depth=2)
        mods = gemv_k.compile_gemvs([(s_gu, gu_cfg), (s_dn, dn_cfg)], cc)
        g_l = [gemv_k.make_gemv(mods, s_gu, gu_cfg, w, x, h, norm, 1e-5) for w in w_gu]
        d_l = [gemv_k.make_gemv(mods, s_dn, dn_cfg, w, h, y) for w in w_dn]
        t_gu, t_dn = alone(g_l), alone(d_l)
        both = alone([z for pair in zip(g_l, d_l) for z in pair]) * 2
        line = f"{enc} ffn {ffn}: gate/up {t_gu:.2f}, down {t_dn:.2f}, in turn {both:.2f} us per layer"
        for config in (mlp_k.MlpConfig(8, 2), mlp_k.MlpConfig(8, 3)):
            m_l = [mlp_k.make_mlp(mlp_k.compile_mlp(shape, config, cc), shape, config, a, b, x, norm, 1e-5, pending)
                   for a, b in zip(w_gu, w_dn)]
            p_l = [phase1(m, shape, config) for m in m_l]
            line += f"; {config.label} ({m_l[0].grid[0]} blocks) fused {alone(m_l):.2f}, phase 1 {alone(p_l):.2f}"
        gb = (s_gu.weight_bytes) / 1e3
        print(line + f"; gate/up bytes {gb / 1e3:.1f} MB", flush=True)
