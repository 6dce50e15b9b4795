"""The batched decode step's graph on its own: GPU time per replay at each row count, and with --ncu
one replay per row count (and a few batch-1 steps) between cudaProfilerStart/Stop for Nsight Compute.
With --ablate, the step again without each kind of launch (its results wrong, its time what that kind
costs inside the graph, early launches and all).

    python3 tests/perf/batch_profile.py tinyllama 1 16
    python3 tests/perf/batch_profile.py --ablate tinyllama 1 16
    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 tests/perf/batch_profile.py --ncu tinyllama 1 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from bench_random import SHAPES  # noqa: E402

PROMPT = 128
REPLAYS = 50


def graph_ms(engine, n: int) -> float:
    """Median GPU ms of one replay of bucket n's graph over the rows already in the table."""
    cp = engine.cp
    times = []
    for _ in range(5):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(engine.stream)
        for _ in range(REPLAYS):
            engine.run_step(n)
        end.record(engine.stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / REPLAYS)
    return float(np.median(times))


ABLATIONS = ("gemv wqkv", "gemv wo", "gemv w_gate_up", "gemv w_down", "gemv output", "batch_rmsnorm",
             "batch_rope_store", "batch_attention", "batch_swiglu", "batch_logits", "embed_rows")


def ablate(engine, n: int) -> None:
    """Step time of bucket n without each kind of launch, beside the whole step's."""
    whole = graph_ms(engine, n)
    build = engine.build_step
    print(f"  rows {n}: whole step {whole:.3f} ms", flush=True)
    for kind in ABLATIONS:
        engine.build_step = lambda rows, prompt_rows=False, kind=kind: [
            l for l in build(rows, prompt_rows) if not l.name.startswith(kind)]
        engine.graphs.pop((n, False), None)
        engine.run_step(n)
        engine.stream.synchronize()
        without = graph_ms(engine, n)
        print(f"  rows {n}: without {kind:18s} {without:.3f} ms (it costs {whole - without:.3f})", flush=True)
    engine.build_step = build
    engine.graphs.pop((n, False), None)


def fill(engine, prompts) -> None:
    """Submit the prompts and step until every one decodes (its graph captured)."""
    for p in prompts:
        engine.submit(p, max_new_tokens=512)
    while any(s.slot in engine.waiting for s in engine.sequences.values()):
        engine.step()
    for _ in range(3):
        engine.step()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ncu", action="store_true", help="one replay per row count inside the profiler's range")
    parser.add_argument("--ablate", action="store_true", help="the step without each kind of launch")
    parser.add_argument("--quant", default="q4")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("rows", type=int, nargs="+")
    args = parser.parse_args(argv)

    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import tinf_config, timed_generation, write_random_model
    from tinyinfer.runtime.cuda_batch import BatchEngine, bucket_for

    config = tinf_config(SHAPES[args.shape])
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.tinf"
        write_random_model(path, config, args.quant, reuse_layers=True)
        with load(path, device="cuda", max_context=PROMPT + 1024) as model:
            cp = model.backend.cp
            timed_generation(model.backend, [5, 6, 7], 8)
            for n in args.rows:
                engine = BatchEngine(model.backend, slots=max(args.rows), max_context=PROMPT + 1024)
                fill(engine, [rng.integers(3, config["vocab_size"], PROMPT) for _ in range(n)])
                bucket = bucket_for(n)
                if args.ncu:
                    engine.stream.synchronize()
                    cp.cuda.runtime.profilerStart()
                    engine.run_step(bucket)
                    engine.stream.synchronize()
                    cp.cuda.runtime.profilerStop()
                elif args.ablate:
                    ablate(engine, bucket)
                else:
                    print(f"{args.shape} {args.quant} rows {n} (bucket {bucket}): graph {graph_ms(engine, bucket):.3f} ms "
                          f"per step", flush=True)
                engine.close()
            if args.ncu:
                cp.cuda.runtime.profilerStart()
                timed_generation(model.backend, [5, 6, 7], 2)
                cp.cuda.runtime.profilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
