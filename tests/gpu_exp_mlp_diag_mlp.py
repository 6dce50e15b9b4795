"""s17: why the fused MLP loses. In the step (us per token): unfused as tuned, unfused without the down
projections, fused w8/d3, fused with phase 1 only (returns after the exchange: wrong results). Alone
(us per layer, after an L2 flush, with PDL): gate/up, down, both in turn, fused, fused phase 1 only.
  python3 tests/gpu_exp_mlp_diag_mlp.py SHAPE:QUANT ..."""
import copy
import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path.cwd() / "tests"))
import gpu_exp_chain as chain  # noqa: E402
from tinyinfer.kernels import mlp as mlp_k  # noqa: E402
from tinyinfer.kernels.build import compile_options, expanded_source  # noqa: E402
from tinyinfer.runtime import autotune  # noqa: E402

autotune.load_cached = lambda key: None
MARK = "    // Phase 2: each tile's rows"


KERNELS = {}


def variant(launch, shape, config, cc):
    expr = mlp_k.name_expression(shape, config)
    if expr not in KERNELS:
        src = expanded_source("mlp.cu")
        assert MARK in src
        mod = cp.RawModule(code=src.replace(MARK, "    return;\n" + MARK), options=compile_options(cc),
                           name_expressions=[expr])
        KERNELS[expr] = mod.get_function(expr)
    out = copy.copy(launch)
    out.kernel = KERNELS[expr]
    out._driver_launches = {}
    return out


for spec in sys.argv[1:]:
    shape, quant = spec.split(":")
    with chain.random_backend(shape, quant) as (b, prompt):
        t = {r: c for r, c in b.tuning.items() if r != "mlp"}
        cc, L = b.compute_capability, range(b.n_layers)
        for config in (mlp_k.MlpConfig(8, 4), mlp_k.MlpConfig(8, 2)):
            fused = {**t, "mlp": config}
            step_u = b.build_step(t)
            step_f = b.build_step(fused)
            p1 = {id(x): variant(x, b.mlp_shape(), config, cc) for x in step_f if x.name == "mlp"}
            step_p1 = [p1.get(id(x), x) for x in step_f]
            fused_no_mlp = [x for x in step_f if x.name != "mlp"]
            step_pr = []              # unfused with the readers of the pending sums (which stay zero)
            for x in fused_no_mlp:
                step_pr.append(x)
                if x.name == "gemv wo":
                    layer = sum(1 for y in step_pr if y.name == "gemv wo") - 1
                    step_pr += [b.gemv_launch("w_gate_up", layer, t["w_gate_up"]), b.gemv_launch("w_down", layer, t["w_down"])]
            sides = {"unfused": step_u, "unfused, pending readers": step_pr,
                     "unfused without down": [x for x in step_u if x.name != "gemv w_down"],
                     f"fused {config.label}": step_f, f"fused {config.label} phase 1 only": step_p1}
            res = {k: [] for k in sides}
            for rnd in range(3):
                for k, s in sides.items():
                    res[k].append(round(chain.time_step(b, prompt, s), 1))
            for k, v in res.items():
                print(f"{spec} step {k}: {v}", flush=True)
            flush = b.flush_l2()
            gu = [b.gemv_launch("w_gate_up", layer, t["w_gate_up"]) for layer in L]
            dn = [b.gemv_launch("w_down", layer, t["w_down"]) for layer in L]
            ml = [b.mlp_launch(layer, config) for layer in L]
            alone = {"gate/up": gu, "down": dn, "gate/up + down": [x for pair in zip(gu, dn) for x in pair],
                     "fused": ml, "fused phase 1": [p1_ for p1_ in (variant(x, b.mlp_shape(), config, cc) for x in ml)]}
            with b.stream:
                b.set_state(100, 1, 0)
                for k, launches in alone.items():
                    us = autotune.time_launches(launches, b.stream, b.wait_launch, flush, repeats=5, early=True)
                    print(f"{spec} alone {config.label} {k}: {us * len(launches) / b.n_layers:.2f} us per layer", flush=True)
            b._flush = b._flush_buffer = None
        b.use_tuning(b.tuning)
