"""Batched decoding on the GPU without HTTP: aggregate tokens/s at 1, 4, 8, 16, 32 streams.

    python examples/bench_batch.py                          # TinyLlama and Llama-2-7B shapes, q4
    python examples/bench_batch.py --shapes tinyllama --streams 1,16 --new-tokens 64 --json out.json

Random weights of the real shapes (examples/bench_random.py), prompts of --prompt tokens (different
per stream), --new-tokens greedy tokens per stream, all streams submitted at once
(runtime/cuda_batch.py). Per stream count: the aggregate generation rate over the steps where every
stream decodes (prefill excluded, as llama-batched-bench's S_TG), the per-stream inter-token latency
p50 (one token per stream per step), the rate end to end (prefill included), the batch-1 rate of the
same model in the same process (the batch-1 backend's generation loop), and what one step costs per
kernel kind (events around each launch) beside what its bytes would take at the measured read
bandwidth: weights (read once per step), KV-cache rows (each row's own positions) and the linears'
partial sums (written and read back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_random import SHAPES  # noqa: E402


def batch_one_rate(model, prompt, n_tokens: int) -> float:
    from tinyinfer.runtime.bench import steady_rate, timed_generation
    from tinyinfer.runtime.cuda_backend import launch_sizes

    timed_generation(model.backend, prompt, min(32, n_tokens))         # warm-up
    rates = [steady_rate(timed_generation(model.backend, prompt, n_tokens)[1], launch_sizes(n_tokens)[0])
             for _ in range(3)]
    return statistics.median(rates)


def run_streams(engine, prompts, n_tokens: int) -> dict:
    """All prompts at once, greedy, until every stream has n_tokens: the times of the steps where
    every stream decodes, the whole run's, and one such step's kernels."""
    from tinyinfer.runtime.cuda_batch import bucket_for

    started = time.perf_counter()
    slots = [engine.submit(p, max_new_tokens=n_tokens) for p in prompts]
    engine.step_times.clear()
    full_steps, profile = [], None
    while engine.has_work():
        joined = sum(1 for s in slots if s in engine.sequences and s not in engine.waiting)
        events = engine.step()
        if joined == len(prompts) and len(events) == len(prompts):
            full_steps.append(engine.step_times[-1])
            if profile is None and len(full_steps) == 8:
                profile = engine.profile_step(bucket_for(len(prompts)))
    total = time.perf_counter() - started
    return {"full_steps": full_steps, "total_s": total, "profile_ms": profile or {}}


def prompt_intake(engine, prompt, beside: list, step_prefill: int) -> dict:
    """One prompt's time to first token and the longest step meanwhile, with the engine's prompts of
    more than step_prefill positions left prefilled by GEMM (else in the steps' rows), beside the
    `beside` prompts already decoding (their budgets outlast the intake)."""
    engine.step_prefill = step_prefill
    running = [engine.submit(p, max_new_tokens=engine.max_context - p.size) for p in beside]
    while any(s in engine.waiting for s in running):
        engine.step()
    started = time.perf_counter()
    slot, longest, events = engine.submit(prompt, max_new_tokens=1), 0.0, {}
    while slot not in events:
        tick = time.perf_counter()
        events = engine.step()                   # (a GEMM prefill included)
        longest = max(longest, time.perf_counter() - tick)
    ttft = time.perf_counter() - started
    for s in running:
        engine.cancel(s)
    return {"ttft_ms": round(1e3 * ttft, 2), "longest_step_ms": round(1e3 * longest, 2)}


def intake_table(engine, config: dict, lengths: list[int], beside: int) -> list[dict]:
    """prompt_intake by GEMM (step_prefill 0) and in the steps' rows, idle and beside `beside` streams."""
    rng, step_prefill_before = np.random.default_rng(1), engine.step_prefill
    others = [rng.integers(3, config["vocab_size"], 16) for _ in range(beside)]
    rows = []
    for n in lengths:
        prompt = rng.integers(3, config["vocab_size"], n)
        row = {"prompt": n}
        for how, step_prefill in (("gemm", 0), ("rows", engine.max_context)):
            for where, running in (("idle", []), (f"beside {beside}", others)):
                prompt_intake(engine, prompt, running, step_prefill)          # warm-up (graphs, cuBLAS)
                row[f"{how} {where}"] = prompt_intake(engine, prompt, running, step_prefill)
        rows.append(row)
        print(f"prompt intake {n}: {row}", file=sys.stderr)
    engine.step_prefill = step_prefill_before
    return rows


def step_bytes(engine, n_streams: int, mean_position: float) -> dict:
    """Bytes one step moves: weights once, each stream's KV rows, the partial sums twice."""
    from tinyinfer.kernels import batch as batch_k

    tinf = engine.tinf
    roles = ("wqkv", "wo", "w_gate_up", "w_down")
    names = ["output"] + [f"layers.{i}.{r}" for i in range(engine.n_layers) for r in roles]
    weights = sum(tinf.info(n).nbytes for n in names)
    kv = n_streams * (mean_position + 1) * 2 * engine.n_layers * engine.n_kv * engine.hd * 2
    padded = batch_k.padded_rows(n_streams)
    parts = 2 * 4 * sum(engine.plan_for(name, padded).parts_floats for name in names)
    return {"weights": weights, "kv": int(kv), "parts": parts}


def bench_shape(shape: str, streams: list[int], prompt_len: int, n_tokens: int, intake: list[int],
                tmp: Path) -> dict:
    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import read_bandwidth_gbs, tinf_config, write_random_model
    from tinyinfer.runtime.cuda_batch import BUCKETS, BatchEngine

    path = tmp / f"random-{shape}-q4.tinf"
    tick = time.perf_counter()
    config = tinf_config(SHAPES[shape])
    write_random_model(path, config, "q4", reuse_layers=True)
    print(f"{shape}: wrote {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - tick:.1f} s",
          file=sys.stderr)
    context = max([prompt_len + n_tokens, *(n + 64 for n in intake)])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], prompt_len) for _ in range(max(streams))]
    with load(path, device="cuda", max_context=context) as model:
        backend = model.backend
        single = batch_one_rate(model, list(prompts[0]), n_tokens)
        peak = read_bandwidth_gbs(backend)
        engine = BatchEngine(backend, slots=max(streams) + (1 if intake else 0), max_context=context)
        for b in sorted({min(k for k in BUCKETS if k >= n) for n in streams}):   # graphs captured before timing:
            run_streams(engine, prompts[:b], min(n_tokens, 32))       # steps with prompt rows,
            run_streams(engine, [p[-1:] for p in prompts[:b]], 4)     # and b sequences decoding alone
        rows = []
        for n in streams:
            run = run_streams(engine, prompts[:n], n_tokens)
            steps = run["full_steps"]
            if not steps:
                raise SystemExit(f"no step had all {n} streams decoding: ask for more --new-tokens")
            step_ms = 1e3 * statistics.median(steps)
            moved = step_bytes(engine, n, prompt_len + n_tokens / 2)
            est_ms = {k: round(v / (peak * 1e9) * 1e3, 3) for k, v in moved.items()}
            profile = {k: round(v, 3) for k, v in sorted(run["profile_ms"].items(), key=lambda kv: -kv[1])}
            kinds = {"GEMVs (weights)": sum(v for k, v in profile.items() if k.startswith("gemv")),
                     "attention (KV rows)": sum(v for k, v in profile.items() if k.startswith("batch_attention"))}
            kinds["other kernels"] = sum(profile.values()) - sum(kinds.values())
            kinds["host and launch gaps"] = max(0.0, step_ms - sum(profile.values()))
            row = {"streams": n, "aggregate_tok_s": round(n * len(steps) / sum(steps), 1),
                   "speedup_vs_batch1": round(n * len(steps) / sum(steps) / single, 2),
                   "itl_p50_ms": round(step_ms, 3), "itl_p50_vs_batch1_step": round(step_ms / (1e3 / single), 2),
                   "end_to_end_tok_s": round(n * n_tokens / run["total_s"], 1),
                   "bytes_ms_at_peak": est_ms, "kernels_ms": profile,
                   "step_ms_by_kind": {k: round(v, 3) for k, v in kinds.items()}, "bound": max(kinds, key=kinds.get)}
            rows.append(row)
            print(f"{shape} B={n:2d}: {row['aggregate_tok_s']:9.1f} tok/s ({row['speedup_vs_batch1']:.2f}x batch-1), "
                  f"ITL p50 {step_ms:.2f} ms, by kind {row['step_ms_by_kind']}, bytes at {peak:.0f} GB/s: {est_ms}, "
                  f"kernels: {profile}", file=sys.stderr)
        intake_rows = intake_table(engine, config, intake, 16) if intake else []
        engine.close()
        return {"shape": shape, "gpu": backend.gpu_name, "read_gbs": round(peak, 1), "batch1_tok_s": round(single, 1),
                "batch1_step_ms": round(1e3 / single, 3), "prompt": prompt_len, "new_tokens": n_tokens, "rows": rows,
                "intake": intake_rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tinyllama,llama2-7b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--streams", default="1,4,8,16,32")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--new-tokens", type=int, default=256, help="generated tokens per stream")
    parser.add_argument("--intake", default="",
                        help="prompt lengths whose time to first token to measure by GEMM and in the steps' rows, "
                             "e.g. 16,64,256,1024")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    intake = [int(n) for n in args.intake.split(",") if n]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            results.append(bench_shape(shape, streams, args.prompt, args.new_tokens, intake, Path(tmp)))
            (Path(tmp) / f"random-{shape}-q4.tinf").unlink()
    for result in results:
        print(f"\n{result['shape']} q4 on {result['gpu']}: batch-1 {result['batch1_tok_s']} tok/s "
              f"({result['batch1_step_ms']} ms per token), read bandwidth {result['read_gbs']} GB/s")
        print("| streams | aggregate tok/s | x batch-1 | ITL p50 ms | x batch-1 step | end to end tok/s | "
              "weights / KV / parts at peak, ms | largest share of the step |")
        print("|---|---|---|---|---|---|---|---|")
        for row in result["rows"]:
            b = row["bytes_ms_at_peak"]
            share = f"{row['bound']} {row['step_ms_by_kind'][row['bound']]:.2f} ms"
            print(f"| {row['streams']} | {row['aggregate_tok_s']:,.0f} | {row['speedup_vs_batch1']} | "
                  f"{row['itl_p50_ms']} | {row['itl_p50_vs_batch1_step']} | {row['end_to_end_tok_s']:,.0f} | "
                  f"{b['weights']} / {b['kv']} / {b['parts']} | {share} |")
        if result["intake"]:
            modes = [k for k in result["intake"][0] if k != "prompt"]
            print("\n| prompt | " + " | ".join(f"{m}: TTFT / longest step ms" for m in modes) + " |")
            print("|---" * (len(modes) + 1) + "|")
            for row in result["intake"]:
                print(f"| {row['prompt']} | " + " | ".join(f"{row[m]['ttft_ms']} / {row[m]['longest_step_ms']}"
                                                      for m in modes) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
