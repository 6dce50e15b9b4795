"""tinyrun MODEL --bench N: decode speed, bytes per token, bandwidth, and a per-kernel table.

Decode speed is measured the way a user gets tokens: generate_ids() after a short prompt, the host
reading every token back, tokens/s over the decode steps after the first graph launch's tokens
(which arrive together, after the prompt: steady_rate), median of several runs. Around it: the GPU
time of one graph replay, a read-bandwidth probe run in the same process (the ceiling), and each
kernel timed alone on the model's own weights (after an L2 flush, one launch per layer so no weight
is read from cache) with its GB/s and % of that ceiling.

Also here: write_random_model(), the random-weight .tinf writer behind examples/bench_random.py and
the GPU tests (random codes and scales written directly: the same bytes and speed as a converted
checkpoint, without quantizing billions of floats).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import numpy as np

from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.cuda_backend import launch_sizes

READ_PROBE_BYTES = 4 << 30


class BenchError(TinyInferError):
    """The benchmark cannot run with this model or backend."""


# ------------------------------------------------------------------------------------ random models

def random_encoded(encoding: str, shape, group: int | None, rng, std: float = 1.0):
    """A Tensor of the given encoding with random values of about `std` (random bit patterns: fast
    enough for 7B-sized tensors, no quantization search)."""
    from tinyinfer.formats import Tensor
    from tinyinfer.formats.quant import padded_cols, rows_cols

    rows, cols = rows_cols(shape)
    cols_pad = padded_cols(encoding, cols, group)
    if encoding in ("f16", "f32"):
        data = random_f16(rng, (rows, cols_pad), std)
        data[:, cols:] = 0
        return Tensor(encoding, tuple(shape), data if encoding == "f16" else data.astype(np.float32))
    if encoding == "q4":           # codes -8..7, std 4.61, under scales of either sign (Q4_0's rule)
        nibbles = rng.integers(0, 16, size=(rows, cols_pad), dtype=np.uint8)
        nibbles[:, cols:] = 8
        data = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        code_std = 4.61
    else:                          # codes -127..127, std 73.3
        data = rng.integers(-127, 128, size=(rows, cols_pad), dtype=np.int8)
        data[:, cols:] = 0
        code_std = 73.3
    scales = std / code_std * rng.uniform(0.5, 1.5, size=(rows, cols_pad // group))
    if encoding == "q4":
        scales *= rng.choice([-1.0, 1.0], size=scales.shape)
    scales = scales.astype(np.float16)
    return Tensor(encoding, tuple(shape), data, scales, group)


def random_f16(rng, shape, std: float) -> np.ndarray:
    """fp16 values with random sign and mantissa, magnitudes in [std/2, 2 std)."""
    exponent = int(np.floor(np.log2(std))) + 14          # fp16 biased exponent of std / 2
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    np.bitwise_and(bits, 0x87FF, out=bits)                # sign, 1 exponent bit, 10 mantissa bits
    np.add(bits, np.uint16(exponent << 10), out=bits)     # no carry into the sign: exponent + 1 < 31
    return bits.view(np.float16)


def synthetic_tokenizer(vocab_size: int) -> dict:
    """A word-level tokenizer with exactly vocab_size ids (w3, w4, ...), for models without one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return {"kind": "hf-json", "tokenizer_json": tokenizer.to_str(), "tokenizer_model": None, "bos_id": 1,
            "eos_ids": [2], "add_bos": True, "special_tokens": {"bos_token": "<s>", "eos_token": "</s>",
                                                                 "unk_token": "<unk>"}}


def byte_level_tokenizer_json(vocab_size: int, corpus: list[str]) -> str:
    """A byte-level BPE tokenizer.json trained in memory on `corpus`: any text round-trips through it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer.to_str()


def tinf_config(hf: dict, n_layers: int | None = None) -> dict:
    """.tinf config from a Hugging Face config.json dict (optionally with fewer layers); Qwen2's
    Q/K/V biases and a sliding window as the converter reads them (convert.hf)."""
    from tinyinfer.convert.hf import sliding_window

    n_heads = hf["num_attention_heads"]
    max_context = hf.get("max_position_embeddings", 2048)
    return {"architecture": "llama", "dim": hf["hidden_size"], "n_layers": n_layers or hf["num_hidden_layers"],
            "n_heads": n_heads, "n_kv_heads": hf.get("num_key_value_heads", n_heads),
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // n_heads, "ffn_dim": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(hf.get("rope_theta", 10000.0)), "rope_scaling": hf.get("rope_scaling"),
            "max_context": max_context, "tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": hf.get("model_type") == "qwen2", "sliding_window": sliding_window(hf, max_context)}


def write_random_model(path, config: dict, quant: str = "q4", group: int | None = None, seed: int = 0,
                       reuse_layers: bool = False, chat_template: str | None = None):
    """Write a .tinf with random weights in the encodings the converter would use for `quant`
    (and the word-level tokenizer of synthetic_tokenizer, and chat_template if given).

    reuse_layers=True writes the same random bytes for every layer (fast for 7B-sized benchmarks;
    each layer is still its own region of the file and of GPU memory)."""
    from tinyinfer.convert.pipeline import DEFAULT_GROUP, tensor_specs
    from tinyinfer.formats import Tensor, TinfWriter

    group = DEFAULT_GROUP[quant] if group is None else group
    rng = np.random.default_rng(seed)
    specs = tensor_specs(config, quant, group, None)
    metadata = {"config": config, "tokenizer": synthetic_tokenizer(config["vocab_size"]),
                "chat_template": chat_template, "generation": {},
                "provenance": {"source": "random", "quant": quant, "group_size": group}}
    made = {}
    with TinfWriter(path, metadata, specs) as writer:
        for spec in specs:
            role = spec.name.split(".")[-1]
            if reuse_layers and role in made:
                tensor = made[role]
            elif len(spec.shape) == 1:         # norm weights near 1, Q/K/V biases of about 1
                noise = rng.standard_normal(spec.shape[0])
                values = (noise if role == "bqkv" else 1.0 + 0.1 * noise).astype(np.float32)
                tensor = Tensor("f32", tuple(spec.shape), np.pad(values, (0, -len(values) % 4))[None, :])
            else:
                std = 1.0 if spec.name == "tok_embeddings" else 1.0 / np.sqrt(spec.shape[1])
                tensor = random_encoded(spec.encoding, spec.shape, spec.group, rng, std)
            if reuse_layers:
                made[role] = tensor
            writer.write(spec.name, tensor)
    return path


# ------------------------------------------------------------------------------------------ bench

BENCH_TEXT = "Once upon a time, in a small town by the sea, there lived an old clockmaker who " * 4


def bench_prompt(model, length: int) -> list[int]:
    """A fixed prompt of `length` ids: BOS (if any) then the tokenization of some text, cut or padded."""
    ids = list(model.tokenizer.encode(BENCH_TEXT))
    while len(ids) < length:
        ids += [i % model.config["vocab_size"] for i in range(3, 3 + length)]
    return ids[:length]


def steady_rate(stamps: list, first: int) -> float:
    """Tokens per second after the first launch's `first` tokens (which arrive together, after the
    prompt): from the arrival of its last token to that of the last token."""
    if len(stamps) <= first:
        return 0.0
    return (len(stamps) - first) / (stamps[-1] - stamps[first - 1])


def timed_generation(backend, prompt, n_tokens: int) -> tuple[list[int], list[float]]:
    from tinyinfer.runtime.sampling import SamplingParams

    tokens, stamps = [], []
    for token in backend.generate_ids(prompt, 0, SamplingParams(), n_tokens, np.random.default_rng(0)):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return tokens, stamps


def graph_step_us(backend, prompt, n_steps: int) -> float:
    """GPU time per decode step: back-to-back replays of the one-step graph of the prompt's end
    (the long-context step after a long prompt) timed with events."""
    backend.forward(np.asarray(prompt), 0)
    graph = backend.graph_at(len(prompt))
    with backend.stream:
        backend.set_state(len(prompt), int(prompt[-1]), 0)
        return backend.replay_us(n_steps, graph)


def read_bandwidth_gbs(backend) -> float:
    """Ceiling: one kernel reading a large buffer with 16-byte loads (median of 5)."""
    from tinyinfer.kernels import misc as misc_k
    from tinyinfer.runtime.autotune import time_launches

    cp = backend.cp
    size = min(READ_PROBE_BYTES, cp.cuda.Device().mem_info[0] // 3) // 16 * 16
    with backend.stream:
        data = cp.ones(size, dtype=cp.uint8)
        sink = cp.zeros(1, dtype=cp.uint32)
        probe = misc_k.make_read_bandwidth(backend.misc_module, data, sink, backend.n_sms)
        probe(backend.stream)
        us = time_launches([probe], backend.stream, backend.wait_launch, None, repeats=5)
    del data
    return size / us / 1e3


def kernel_table(backend, context: int, peak_gbs: float) -> list[dict]:
    """Each kernel of the step at position context - 1 (the long-context step there, if any) timed
    alone: us per launch, launches per token, GB/s, % of peak."""
    from tinyinfer.runtime.autotune import time_launches
    from tinyinfer.runtime.sampling import SamplingParams

    flush = backend.flush_l2()
    rows = []
    with backend.stream:
        backend.set_state(context - 1, 1, 0)
        long_context = backend.is_long_context(context - 1)
        groups = {}
        for launch in backend.build_step(backend.tuning, True) if long_context else backend.step:
            groups.setdefault(launch.name, []).append(launch)
        for name, launches in groups.items():
            if name.startswith("sample"):
                backend.set_sampling(SamplingParams())
            us = time_launches(launches, backend.stream, backend.wait_launch, flush)
            if name.startswith("attention"):
                launches[0].bytes_read = 2 * context * backend.n_kv * backend.head_dim * 2
            bytes_read = launches[0].bytes_read
            shape = ""
            if name.startswith("gemv"):
                s = backend.shapes[name.split()[1]]
                shape = f"{s.rows}x{s.cols} {s.encoding}" + (f" g{s.group}" if s.group else "")
            elif name.startswith("mlp"):
                gu, down = backend.shapes["w_gate_up"], backend.shapes["w_down"]
                shape = f"{gu.rows}x{gu.cols} + {down.rows}x{down.cols} {gu.encoding}" + (f" g{gu.group}" if gu.group else "")
            elif name.startswith("attention"):
                slices = backend.attn_plan.slices_at(long_context)
                shape = (f"{backend.n_heads}/{backend.n_kv} heads x {backend.head_dim}, ctx {context}"
                         + (f", {slices} blocks per KV head" if slices > 1 else ""))
            gbs = bytes_read / us / 1e3 if bytes_read else 0.0
            rows.append({"kernel": name, "shape": shape, "per_token": len(launches), "us": round(us, 2),
                         "us_per_token": round(us * len(launches), 1), "bytes": bytes_read,
                         "gbs": round(gbs, 1), "pct_peak": round(100 * gbs / peak_gbs, 1)})
        backend._flush = backend._flush_buffer = None
        backend.set_state(0, 1, 0)
    return rows


def weight_bytes_per_token(backend) -> int:
    linears = [launch for launch in backend.step if launch.name.startswith(("gemv", "mlp"))]
    return sum(launch.bytes_read for launch in linears) + backend.embed.bytes_read


def check_bench_room(backend, prompt_len: int, n_tokens: int) -> None:
    if prompt_len + n_tokens > backend.max_context:
        raise BenchError(f"A {prompt_len}-token prompt plus {n_tokens} new tokens exceeds the context of "
                         f"{backend.max_context}; ask for fewer tokens.")


def run_bench(model, n_tokens: int = 256, prompt_len: int = 16, reps: int = 3, json_path=None) -> dict:
    backend = model.backend
    if not hasattr(backend, "graph"):
        return run_cpu_bench(model, n_tokens, prompt_len, reps, json_path)
    check_bench_room(backend, prompt_len, n_tokens)
    prompt = bench_prompt(model, prompt_len)
    timed_generation(backend, prompt, min(n_tokens, 32))            # warm-up
    runs = []
    for _ in range(reps):
        tokens, stamps = timed_generation(backend, prompt, n_tokens)
        runs.append(steady_rate(stamps, launch_sizes(n_tokens)[0]))
    tok_s = statistics.median(runs)
    step_us = graph_step_us(backend, prompt, n_tokens)
    peak = read_bandwidth_gbs(backend)
    final_context = prompt_len + n_tokens
    kernels = kernel_table(backend, final_context, peak)
    weights = weight_bytes_per_token(backend)
    kv_per_position = 2 * backend.n_layers * backend.n_kv * backend.head_dim * 2
    kv_avg = kv_per_position * (prompt_len + n_tokens / 2)
    bytes_per_token = weights + kv_avg
    kernel_us = sum(row["us_per_token"] for row in kernels)
    cp = backend.cp
    from tinyinfer.runtime.cuda_prefill import prefill_report

    prefill = prefill_report(model)       # pp512 / pp2048 (prompt tok/s) and time to first token
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": backend.gpu_name, "compute_capability": backend.compute_capability,
        "driver": cp.cuda.runtime.driverGetVersion(), "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cupy": cp.__version__, "model": str(model.tinf.path),
        "config": {k: model.config[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")},
        "encodings": {role: f"{s.encoding}" + (f" g{s.group}" if s.group else "") for role, s in backend.shapes.items()},
        "n_tokens": n_tokens, "prompt_len": prompt_len, "reps": reps,
        "tok_s": round(tok_s, 1), "runs_tok_s": [round(r, 1) for r in runs],
        "graph_step_us": round(step_us, 1), "graph_tok_s": round(1e6 / step_us, 1),
        "kernels_per_token": len(backend.step), "kernel_sum_us": round(kernel_us, 1),
        "gap_us": round(step_us - kernel_us, 1),
        "weight_bytes_per_token": weights, "kv_bytes_per_token_avg": int(kv_avg),
        "bytes_per_token": int(bytes_per_token), "achieved_gbs": round(bytes_per_token * tok_s / 1e9, 1),
        "read_bandwidth_gbs": round(peak, 1),
        "pct_of_read_bandwidth": round(100 * bytes_per_token * tok_s / 1e9 / peak, 1),
        "roofline_tok_s": round(peak * 1e9 / bytes_per_token, 1),
        "load": {k: round(v, 3) for k, v in backend.timings.items()},
        "tuning": {role: c.as_dict() for role, c in backend.tuning.items()}, "tuning_source": backend.tuning_source,
        "kernels": kernels, "prefill": prefill,
    }
    print(format_report(result), file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_report(r: dict) -> str:
    from tinyinfer.runtime.cuda_prefill import format_prefill

    lines = [
        f"{r['gpu']} (sm_{r['compute_capability']}), driver {r['driver']}, {r['date']}",
        f"model {r['model']}: {r['config']} {r['encodings']}",
        f"decode {r['n_tokens']} tokens after a {r['prompt_len']}-token prompt, {r['reps']} runs: "
        f"{r['tok_s']:.1f} tok/s (runs {r['runs_tok_s']})",
        f"graph replay {r['graph_step_us']:.1f} us/token ({r['graph_tok_s']:.0f} tok/s), {r['kernels_per_token']} "
        f"kernels; kernels alone {r['kernel_sum_us']:.1f} us, launch gaps ~{r['gap_us']:.1f} us",
        f"bytes/token {r['bytes_per_token'] / 1e9:.3f} GB (weights {r['weight_bytes_per_token'] / 1e9:.3f} GB), "
        f"achieved {r['achieved_gbs']:.0f} GB/s = {r['pct_of_read_bandwidth']:.1f}% of the measured read bandwidth "
        f"{r['read_bandwidth_gbs']:.0f} GB/s (roofline {r['roofline_tok_s']:.0f} tok/s)",
        f"load {r['load'].get('load_s', 0):.2f} s {r['load']}, tuning {r['tuning_source']}",
        format_prefill(r["prefill"]) if "prefill" in r else "",
        "",
        "| kernel | shape | per token | us | us/token | GB/s | % of peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in r["kernels"]:
        lines.append(f"| {k['kernel']} | {k['shape']} | {k['per_token']} | {k['us']:.2f} | {k['us_per_token']:.1f} | "
                     f"{k['gbs']:.0f} | {k['pct_peak']:.1f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ CPU

def run_cpu_bench(model, n_tokens: int, prompt_len: int = 16, reps: int = 3, json_path=None) -> dict:
    """--bench on the NumPy backend: decode tokens/s after a short prompt (median of `reps` runs, the
    first token, which carries the prompt, left out), with the conditions the number depends on: the
    CPU, its load, the BLAS threads and how much of the model is cached as float32."""
    import os

    from tinyinfer.runtime.numpy_backend import available_memory_bytes, blas_threads

    backend = model.backend
    check_bench_room(backend, prompt_len, n_tokens)
    prompt = bench_prompt(model, prompt_len)
    timed_generation(backend, prompt, 2)                         # warm-up
    load_before = os.getloadavg()
    runs = [steady_rate(timed_generation(backend, prompt, n_tokens)[1], 1) for _ in range(reps)]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": "numpy", "cpu": cpu_name(), "cores": os.cpu_count(), "blas_threads": blas_threads(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "mem_available_gib": round((available_memory_bytes() or 0) / 2**30, 1),
        "model": str(model.tinf.path),
        "config": {k: model.config[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")},
        "float32_mib": round(backend.float32_bytes() / 2**20), "cached_mib": round(backend.cached_bytes() / 2**20),
        "n_tokens": n_tokens, "prompt_len": prompt_len, "reps": reps,
        "tok_s": round(statistics.median(runs), 2), "runs_tok_s": [round(r, 2) for r in runs],
    }
    print(f"{result['cpu']}, {result['cores']} cores, {result['blas_threads']} BLAS threads, load average "
          f"{result['load_average_before'][0]} -> {result['load_average_after'][0]}: decode {n_tokens} tokens after a "
          f"{prompt_len}-token prompt, {reps} runs: {result['tok_s']} tok/s (runs {result['runs_tok_s']}); "
          f"{result['cached_mib']} of {result['float32_mib']} MiB of float32 weights cached", file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"
