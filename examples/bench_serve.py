"""Benchmark `tinyrun serve`: N concurrent streams through the official openai client.

    python examples/bench_serve.py MODEL.tinf --streams 1 4 --tokens 256          # starts the server itself
    python examples/bench_serve.py MODEL.tinf --streams 1 8 32 --parallel 1       # ... one request at a time
    python examples/bench_serve.py --url http://127.0.0.1:8080 --streams 1 4      # a server already running

For each stream count it reports the aggregate decode tok/s (completion tokens of all streams over the
wall time), the time to first token (p50/p99) and the inter-token latency (p50/p99, the gaps between
streamed chunks; a chunk holds several tokens where the server's reader fell behind, counted in
tokens per chunk). Given MODEL, it first runs `tinyrun MODEL --bench TOKENS` (the engine alone, same
prompt length) and prints the server's single-stream decode rate beside it, with the overhead.
The prompt is the --bench prompt: the same text, tokenized by the server, cut to --prompt-len ids.
--parallel N is passed to `tinyrun serve` (its default: batched decoding with as many sequences as
fit on the GPU; 1: the serial engine). Streams beyond the server's parallel sequences wait in its
queue, so their time to first token includes that wait.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tinyinfer.runtime.bench import BENCH_TEXT, steady_rate
from tinyinfer.runtime.cuda_backend import launch_sizes


def tinyrun() -> str:
    beside = Path(sys.executable).parent / "tinyrun"
    return str(beside) if beside.is_file() else (shutil.which("tinyrun") or "tinyrun")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_bench(model: str, tokens: int, device: str) -> float:
    """tok/s of `tinyrun MODEL --bench TOKENS` (the median of its runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([tinyrun(), model, "--bench", str(tokens), "--device", device, "--json", str(out), "-q"],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["tok_s"]


def start_server(model: str, device: str, ctx_size: int | None, parallel: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [tinyrun(), "serve", model, "--port", str(port), "--device", device]
    if ctx_size:
        command += ["--ctx-size", str(ctx_size)]
    if parallel is not None:
        command += ["--parallel", str(parallel)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"tinyrun serve {model} did not become ready (exit code {process.poll()}).")


def bench_prompt(url: str, length: int) -> list[int]:
    """bench.bench_prompt's ids, from the server's tokenizer (padded as it pads: ids 3.., below any
    real vocabulary's size at these lengths)."""
    request = urllib.request.Request(url + "/tokenize", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"content": BENCH_TEXT, "add_special": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        ids = json.loads(response.read())["tokens"]
    while len(ids) < length:
        ids += list(range(3, 3 + length))
    return ids[:length]


def one_stream(client, model_id: str, prompt: list[int], tokens: int) -> dict:
    """One streamed greedy completion: arrival times of its chunks and its token count."""
    sent = time.perf_counter()
    stamps, usage = [], None
    stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        usage = chunk.usage or usage
    return {"sent": sent, "stamps": stamps, "tokens": usage.completion_tokens if usage else len(stamps)}


def stream_rate(result: dict, first: int) -> float:
    """A stream's decode rate. With one chunk per token, as --bench counts it (bench.steady_rate): from
    the last token of the first graph launch, whose tokens arrive together after the prompt, to the
    last token. Where the server joined tokens into one chunk (its reader was behind), the tokens after
    the first chunk over the time from it to the last (vLLM's TPOT)."""
    stamps, tokens = result["stamps"], result["tokens"]
    if len(stamps) == tokens:
        return steady_rate(stamps, first)
    return (tokens - 1) / (stamps[-1] - stamps[0])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)]


def stream_worker(barrier, out, url: str, model_id: str, prompt: list[int], tokens: int, requests: int) -> None:
    """One client process: `requests` streamed completions one after another, once every client is ready."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    barrier.wait()
    try:
        out.put([one_stream(client, model_id, prompt, tokens) for _ in range(requests)])
    except Exception as e:          # reported by the parent, which would otherwise wait for the results
        out.put(f"a client failed: {e}")


def run_streams(url: str, model_id: str, prompt: list[int], tokens: int, streams: int, requests: int) -> dict:
    """`streams` clients at once, each in its own process (parsing the chunks of several streams in
    one interpreter would make the client the bottleneck)."""
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(streams), context.Queue()
    workers = [context.Process(target=stream_worker, args=(barrier, out, url, model_id, prompt, tokens, requests))
               for _ in range(streams)]
    for worker in workers:
        worker.start()
    replies = [out.get(timeout=3600) for _ in workers]
    for worker in workers:
        worker.join(60)
    failed = next((r for r in replies if isinstance(r, str)), None)
    if failed:
        raise SystemExit(failed)
    results = [r for reply in replies for r in reply]
    # perf_counter is the system's monotonic clock, so the processes' stamps compare.
    wall = max(r["stamps"][-1] for r in results if r["stamps"]) - min(r["sent"] for r in results)
    ttft = [r["stamps"][0] - r["sent"] for r in results if r["stamps"]]
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    first = launch_sizes(tokens)[0]
    decode = [stream_rate(r, first) for r in results if len(r["stamps"]) > first]
    total = sum(r["tokens"] for r in results)
    return {"streams": streams, "requests": len(results), "completion_tokens": total,
            "aggregate_tok_s": round(total / wall, 1), "per_stream_decode_tok_s": round(statistics.median(decode), 1),
            "tokens_per_chunk": round(total / sum(len(r["stamps"]) for r in results), 2),
            "ttft_ms_p50": round(1e3 * percentile(ttft, 50), 2), "ttft_ms_p99": round(1e3 * percentile(ttft, 99), 2),
            "itl_ms_p50": round(1e3 * percentile(gaps, 50), 3), "itl_ms_p99": round(1e3 * percentile(gaps, 99), 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a .tinf file: start `tinyrun serve` on it (else --url)")
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4], help="concurrent streams to measure")
    parser.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3, help="requests per stream, one after another")
    parser.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--ctx-size", type=int, help="passed to tinyrun serve")
    parser.add_argument("--parallel", type=int, metavar="N",
                        help="passed to tinyrun serve: sequences decoded together (default: the server's)")
    parser.add_argument("--no-engine-bench", action="store_true", help="skip the `tinyrun --bench` comparison")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if bool(args.model) == bool(args.url):
        parser.error("give a MODEL file or --url, not both")
    if args.parallel is not None and not args.model:
        parser.error("--parallel is passed to the server this script starts; with --url, set it on that server")
    import openai

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    result = {"model": args.model or args.url, "tokens": args.tokens, "prompt_len": args.prompt_len,
              "parallel": args.parallel}
    if args.model and not args.no_engine_bench:
        result["engine_bench_tok_s"] = engine_bench(args.model, args.tokens, args.device)
        print(f"tinyrun --bench {args.tokens}: {result['engine_bench_tok_s']} tok/s", file=sys.stderr)
    process, url = (start_server(args.model, args.device, args.ctx_size, args.parallel) if args.model
                    else (None, args.url))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model_id = client.models.list().data[0].id
        prompt = bench_prompt(url, args.prompt_len)
        one_stream(client, model_id, prompt, min(args.tokens, 32))          # warm-up
        result["runs"] = []
        for streams in args.streams:
            run = run_streams(url, model_id, prompt, args.tokens, streams, args.requests)
            result["runs"].append(run)
            print(json.dumps(run), file=sys.stderr)
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def print_table(result: dict) -> None:
    print("| streams | aggregate tok/s | per-stream decode tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens per chunk |")
    print("|---|---|---|---|---|---|")
    for r in result["runs"]:
        print(f"| {r['streams']} | {r['aggregate_tok_s']:,} | {r['per_stream_decode_tok_s']:,} | "
              f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | "
              f"{r['tokens_per_chunk']} |")
    bench = result.get("engine_bench_tok_s")
    single = next((r for r in result["runs"] if r["streams"] == 1), None)
    if bench and single:
        overhead = 100 * (1 - single["per_stream_decode_tok_s"] / bench)
        print(f"\nsingle stream through the server: {single['per_stream_decode_tok_s']:,} tok/s; "
              f"tinyrun --bench {result['tokens']}: {bench:,} tok/s; server overhead {overhead:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
