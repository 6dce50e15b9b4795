"""Experiment on a GPU, run by hand (`python3 tests/gpu_exp_gemv_ab.py OTHER.cu [...]`; not part of
the test suite): the package's gemv.cu against other versions of it, every decode GEMV shape of
TinyLlama and Llama-2-7B (q4 g64 and f16), each launch alone in a CUDA graph over rotating weight
copies (no L2 reuse). Prints the best configuration's us per launch and GB/s per shape and file."""
import sys

import numpy as np
import cupy as cp

from tinyinfer.formats import tensor_nbytes
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import misc as misc_k
from tinyinfer.kernels.build import compile_options, device_compute_capability, expanded_source, source_text
from tinyinfer.runtime.bench import random_encoded

from gpu_timing import graph_us_per_launch

SHAPES = [("tl wqkv", 2560, 2048, "rmsnorm", "store"), ("tl wo", 2048, 2048, "plain", "add"),
          ("tl gate_up", 11264, 2048, "rmsnorm", "swiglu"), ("tl down", 2048, 5632, "plain", "add"),
          ("7b wqkv", 12288, 4096, "rmsnorm", "store"), ("7b wo", 4096, 4096, "plain", "add"),
          ("7b gate_up", 22016, 4096, "rmsnorm", "swiglu"), ("7b down", 4096, 11008, "plain", "add")]


def source_of(path: str) -> str:
    if path == "package":
        return expanded_source("gemv.cu")
    return open(path).read().replace('#include "common.cuh"', source_text("common.cuh").replace("#pragma once", ""))


def main(paths):
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal(2 * 11008).astype(np.float32))
    aux = cp.asarray(rng.uniform(0.5, 1.5, 11008).astype(np.float32))
    y = cp.zeros(32000, cp.float32)
    options = compile_options(device_compute_capability())
    for encoding in ("q4", "f16"):
        group = 64 if encoding == "q4" else None
        data = {}
        for label, rows, cols, inp, outp in SHAPES:
            t = random_encoded(encoding, (rows, cols), group, rng, 1 / np.sqrt(cols))
            raw = np.zeros(tensor_nbytes(encoding, (rows, cols), group), np.uint8)
            for off, arr in t.parts():
                b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                raw[off: off + b.size] = b
            copies = max(2, int(np.ceil(300e6 / raw.nbytes)))
            data[label] = (gemv_k.shape_of(t, inp, outp), [cp.asarray(raw) for _ in range(copies)], raw.nbytes)
        exprs = sorted({gemv_k.name_expression(s, gemv_k.GemvConfig(rt)) for s, _, _ in data.values()
                        for rt, _ in gemv_k.CANDIDATES})
        misc = misc_k.compile_misc(device_compute_capability())
        sink, out, total = cp.zeros(1, cp.uint32), [], 0.0
        for label, (shape, ws, nbytes) in data.items():      # the same bytes read linearly: the ceiling
            us = graph_us_per_launch([misc_k.make_read_bandwidth(misc, w, sink, 132) for w in ws], 3)
            total += us
            out.append(f"{label} {us:.2f}us {nbytes / us / 1e3:.0f}GB/s")
        print(f"{encoding} linear read: sum {total:.1f} us | " + " | ".join(out), flush=True)
        for path in paths:
            mod = cp.RawModule(code=source_of(path), options=options, name_expressions=exprs)
            out, total = [], 0.0
            for label, (shape, ws, nbytes) in data.items():
                times = {}
                for rt, warps in gemv_k.CANDIDATES:
                    launches = [gemv_k.make_gemv(mod, shape, gemv_k.GemvConfig(rt, warps), w, x, y, aux, 1e-5)
                                for w in ws]
                    times[f"R{rt}w{warps}"] = graph_us_per_launch(launches, 3)
                best = min(times, key=times.get)
                total += times[best]
                out.append(f"{label} {times[best]:.2f}us {nbytes / times[best] / 1e3:.0f}GB/s {best}")
            print(f"{encoding} {path}: sum {total:.1f} us | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["package"])
