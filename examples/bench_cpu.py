"""Decode speed of the NumPy (CPU) backend on TinyLlama-1.1B's shapes, without downloading a model.

    python examples/bench_cpu.py                    # q4, BLAS threads 1 and all cores
    python examples/bench_cpu.py --threads 2 --tokens 64 --json cpu.json

Writes a .tinf with random weights and TinyLlama-1.1B-Chat-v1.0's configuration (its config.json
from the project's test assets when present, else the same numbers from bench_random.py), loads it
with device="cpu", and runs `tinyrun MODEL --bench N --device cpu` for each thread count. Random
weights cost exactly what trained ones do. Each line names the CPU, its load average and how much of
the model is cached as float32: on a machine shared with other work the numbers move with its load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("TINYINFER_SHARED", HERE.parent.parent / "shared"))
TINYLLAMA_CONFIG = SHARED / "assets" / "tinyllama-1.1b-chat-v1.0" / "config.json"


def tinyllama_config() -> dict:
    if TINYLLAMA_CONFIG.is_file():
        return json.loads(TINYLLAMA_CONFIG.read_text())
    sys.path.insert(0, str(HERE))
    from bench_random import SHAPES

    return SHAPES["tinyllama"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quant", choices=("q4", "q8", "f16"), default="q4")
    parser.add_argument("--threads", default=f"1,{os.cpu_count()}", help="BLAS thread counts to try, e.g. 1,2")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to decode per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)

    from threadpoolctl import threadpool_limits

    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import run_cpu_bench, tinf_config, write_random_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"random-tinyllama-{args.quant}.tinf"
        write_random_model(path, tinf_config(tinyllama_config()), args.quant)
        started = time.perf_counter()
        with load(path, device="cpu") as model:
            print(f"loaded {path.name} ({path.stat().st_size / 2**20:.0f} MiB) in "
                  f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
            for threads in sorted({int(t) for t in args.threads.split(",")}):
                with threadpool_limits(threads, user_api="blas"):
                    results.append(run_cpu_bench(model, args.tokens, reps=args.reps))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
