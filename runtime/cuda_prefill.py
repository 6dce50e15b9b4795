"""Prefill: the prompt through the model in chunks of matrix-matrix work, for the CUDA backend.

Decoding runs one token per step and is bound by reading the weights. A prompt's tokens are all
known, so each chunk of up to `chunk` tokens goes through every layer at once:

    x = embed(ids)                                        float32 [T, dim], the residual stream
    per layer:  qkv  = rmsnorm(x) @ wqkv^T                cuBLAS fp16 GEMM, fp32 out
                q    = rope_store(qkv + bqkv)             k and v (rotated k) appended to the KV cache
                x   += attention(q, cache) @ wo^T         flash attention (in the window), then GEMM adding into x
                gu   = rmsnorm(x) @ w_gate_up^T
                x   += swiglu(gu) @ w_down^T
    logits = rmsnorm(x) @ output^T                        for every position, the last, or none

q4/q8 weights are dequantized to fp16 into one scratch matrix right before their GEMM (once per
chunk); f16 weights are used in place where the backend holds them row-major, and copied there
row-major where it holds them in 8-row blocks (kernels/layout.py: all but odd sizes). The KV cache
and rope tables are the decode engine's, so decoding continues from where the prefill stopped, and
a prefill can start at any position (a later chunk, or a new chat turn over a cache that already
holds the earlier ones).

The step list is written once, in run_prefill(), against an `ops` object: CudaOps runs it on the
GPU, NumpyOps runs the same steps with the kernels' NumPy references (the CPU tests use it).
"""

from __future__ import annotations

import numpy as np

from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.kernels import prefill as prefill_k
from tinyinfer.runtime import reference as ref

PREFILL_MIN_TOKENS = 16     # shorter prompts go through the decode graph, token by token
MAX_CHUNK = 2048            # tokens per chunk (runtime/README.md, "Prefill")
CHUNK_ALIGN = 64            # the attention kernel's query tile
BUFFER_FRACTION = 0.25      # share of the free GPU memory the chunk buffers may take


def chunk_spans(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[begin, end) ranges of at most `chunk` tokens covering 0..n_tokens."""
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    return [(begin, min(begin + chunk, n_tokens)) for begin in range(0, n_tokens, chunk)]


def linear_names(config: dict) -> list[str]:
    return ["output"] + [f"layers.{i}.{n}" for i in range(config["n_layers"])
                         for n in ("wqkv", "wo", "w_gate_up", "w_down")]


def bytes_per_token(config: dict) -> int:
    """Device bytes of the chunk buffers per token of chunk size."""
    c = config
    attn = c["n_heads"] * c["head_dim"]
    qkv = (c["n_heads"] + 2 * c["n_kv_heads"]) * c["head_dim"]
    return 4 * c["dim"] + 2 * max(c["dim"], c["ffn_dim"]) + 4 * qkv + 2 * attn + 2 * attn + 8 * c["ffn_dim"] + 4


def choose_chunk(config: dict, free_bytes: int, scratch_bytes: int, max_chunk: int = MAX_CHUNK) -> int:
    """The largest chunk (a multiple of 64, at most max_chunk) whose buffers fit the memory share; 0 if none."""
    budget = int(free_bytes * BUFFER_FRACTION) - scratch_bytes
    fit = budget // bytes_per_token(config) if budget > 0 else 0
    chunk = min(max_chunk, fit)
    return chunk // CHUNK_ALIGN * CHUNK_ALIGN if chunk >= CHUNK_ALIGN else 0


def supported(config: dict) -> bool:
    return prefill_k.supports_head_dim(config["head_dim"]) and config["n_heads"] % config["n_kv_heads"] == 0


# ------------------------------------------------------------------------------------ the steps

def layers_forward(ops, config: dict, ids: np.ndarray, start: int):
    """The residual stream after every layer, for tokens `ids` at positions start.. (K/V appended)."""
    x = ops.embed(ids)
    for i in range(config["n_layers"]):
        p = f"layers.{i}."
        qkv = ops.linear(p + "wqkv", ops.rmsnorm(x, p + "attn_norm"))
        q = ops.rope_store(qkv, i, start)
        ops.linear(p + "wo", ops.attention(q, i, start), add_to=x)
        gate_up = ops.linear(p + "w_gate_up", ops.rmsnorm(x, p + "ffn_norm"))
        ops.linear(p + "w_down", ops.swiglu(gate_up), add_to=x)
    return x


def run_prefill(ops, config: dict, token_ids: np.ndarray, start_pos: int, chunk: int, logits: str | None = "all"):
    """Process token_ids at positions start_pos.. chunk by chunk; logits "all" [n, vocab], "last" [1, vocab] or None."""
    token_ids = np.asarray(token_ids, dtype=np.int32).ravel()
    n = token_ids.size
    out = ops.empty_logits(n if logits == "all" else 1) if logits else None
    for begin, end in chunk_spans(n, chunk):
        x = layers_forward(ops, config, token_ids[begin:end], start_pos + begin)
        if logits == "all":
            ops.logits(x, 0, end - begin, out[begin:end])
        elif logits == "last" and end == n:
            ops.logits(x, end - begin - 1, 1, out)
    return out


# --------------------------------------------------------------------------------- GPU and NumPy

class CudaOps:
    """The steps on the GPU: prefill.cu kernels and cuBLAS, over buffers sized for `chunk` tokens."""

    def __init__(self, backend, chunk: int):
        cp = self.cp = backend.cp
        self.backend = backend
        self.tinf = backend.tinf
        c = self.config = backend.config
        self.chunk = chunk
        self.dim, self.ffn, self.hd = c["dim"], c["ffn_dim"], c["head_dim"]
        self.n_heads, self.n_kv, self.vocab = c["n_heads"], c["n_kv_heads"], c["vocab_size"]
        self.mod = prefill_k.compile_prefill(backend.compute_capability, self.hd)
        attn = self.n_heads * self.hd
        self.x = cp.empty((chunk, self.dim), dtype=cp.float32)
        self.h16 = cp.empty(chunk * max(self.dim, self.ffn), dtype=cp.float16)
        self.qkv = cp.empty(chunk * (self.n_heads + 2 * self.n_kv) * self.hd, dtype=cp.float32)
        self.q16 = cp.empty(chunk * attn, dtype=cp.float16)
        self.attn16 = cp.empty(chunk * attn, dtype=cp.float16)
        self.gate_up = cp.empty(chunk * 2 * self.ffn, dtype=cp.float32)
        self.ids = cp.empty(chunk, dtype=cp.int32)
        self.scratch = cp.empty(max(scratch_halves(self.tinf), 8), dtype=cp.float16)
        from tinyinfer.formats.quant import padded_cols
        from tinyinfer.kernels.misc import EMBEDDING_ID

        emb = self.tinf.info("tok_embeddings").encoding
        self.embedding = (EMBEDDING_ID[emb], padded_cols(emb, self.dim, None))

    def embed(self, ids: np.ndarray):
        n = ids.size
        self.backend.upload(self.ids, ids.astype(np.int32))
        x = self.x[:n]
        prefill_k.embed_rows(self.mod, self.backend.view("tok_embeddings"), self.embedding[0], self.embedding[1],
                             self.dim, self.ids[:n], x)
        return x

    def rmsnorm(self, x, name: str):
        rows = x.shape[0]
        out = self.h16[: rows * self.dim].reshape(rows, self.dim)
        prefill_k.rmsnorm_rows(self.mod, x, self.backend.f32_view(name), rows, self.dim,
                               float(self.config["norm_eps"]), out)
        return out

    def weight(self, name: str) -> tuple[int, int, int, int]:
        """(fp16 pointer, rows, cols, row stride) of a linear weight, as fp16 row-major in scratch if
        it is quantized or held in 8-row blocks."""
        from tinyinfer.formats.quant import scale_offset

        info = self.tinf.info(name)
        shape, view = gemv_k.shape_of(info), self.backend.view(name)
        if info.encoding == "f16" and not shape.blocked:
            return view.data.ptr, shape.rows, shape.cols, shape.cols_pad
        if info.encoding == "f16":
            layout.unblock_values(view, shape, self.scratch, self.cp)
        else:
            scales = view.data.ptr + scale_offset(info.encoding, info.shape, info.group)
            prefill_k.dequant(self.mod, info.encoding, view.data.ptr, scales, shape.rows, shape.cols_pad, info.group,
                              shape.blocked, self.scratch)
        return self.scratch.data.ptr, shape.rows, shape.cols, shape.cols_pad

    def linear(self, name: str, h, add_to=None):
        ptr, rows, cols, ld = self.weight(name)
        n = h.shape[0]
        if add_to is not None:
            y = add_to
        elif name.endswith("wqkv"):
            y = self.qkv[: n * rows].reshape(n, rows)
        else:
            y = self.gate_up[: n * rows].reshape(n, rows)
        prefill_k.gemm(ptr, rows, cols, ld, h.data.ptr, n, h.shape[1], y.data.ptr, y.shape[1],
                       add_to is not None, self.backend.stream)
        return y

    def rope_store(self, qkv, layer: int, start: int):
        n = qkv.shape[0]
        q = self.q16[: n * self.n_heads * self.hd].reshape(self.n_heads, n, self.hd)
        b = self.backend
        bias = b.f32_view(f"layers.{layer}.bqkv") if self.config.get("qkv_bias") else None
        prefill_k.rope_store(self.mod, qkv, n, start, self.n_heads, self.n_kv, self.hd, b.rope_cos, b.rope_sin, q,
                             b.k_cache[layer], b.v_cache[layer], bias)
        return q

    def attention(self, q, layer: int, start: int):
        n = q.shape[1]
        out = self.attn16[: n * self.n_heads * self.hd].reshape(n, self.n_heads * self.hd)
        b = self.backend
        prefill_k.attention(self.mod, q, b.k_cache[layer], b.v_cache[layer], n, start, self.n_heads, self.n_kv,
                            self.hd, out, self.config.get("sliding_window"))
        return out

    def swiglu(self, gate_up):
        n = gate_up.shape[0]
        out = self.h16[: n * self.ffn].reshape(n, self.ffn)
        prefill_k.swiglu_rows(self.mod, gate_up, n, self.ffn, out)
        return out

    def empty_logits(self, n: int):
        return self.cp.empty((n, self.vocab), dtype=self.cp.float32)

    def logits(self, x, row: int, n_rows: int, out) -> None:
        h = self.rmsnorm(x[row: row + n_rows], "norm")
        ptr, rows, cols, ld = self.weight("output")
        prefill_k.gemm(ptr, rows, cols, ld, h.data.ptr, n_rows, h.shape[1], out.data.ptr, self.vocab, False,
                       self.backend.stream)


def scratch_halves(tinf) -> int:
    """fp16 elements of the largest linear that goes through scratch (CudaOps.weight)."""
    sizes = [0]
    for name in linear_names(tinf.config):
        shape = gemv_k.shape_of(tinf.info(name))
        if shape.encoding != "f16" or shape.blocked:
            sizes.append(shape.rows * shape.cols_pad)
    return max(sizes)


class NumpyOps:
    """The same steps in NumPy with the kernels' references and rounding points, over an fp16 KV cache."""

    def __init__(self, tinf, max_context: int | None = None):
        c = self.config = tinf.config
        self.tinf = tinf
        ctx = max_context or c["max_context"]
        self.cos, self.sin = ref.rope_tables(c["head_dim"], ctx, c["rope_theta"], c.get("rope_scaling"))
        shape = (c["n_layers"], ctx, c["n_kv_heads"], c["head_dim"])
        self.k_cache, self.v_cache = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
        self.weights: dict[str, np.ndarray] = {}

    def weight(self, name: str) -> np.ndarray:
        if name not in self.weights:
            tensor = self.tinf.tensor(name)
            if len(tensor.shape) == 1 or name == "tok_embeddings":
                self.weights[name] = tensor.to_float32()
            else:
                w = prefill_k.dequant_reference(tensor) if tensor.encoding != "f16" else tensor.data
                self.weights[name] = np.asarray(w[:, : tensor.cols], np.float32)
        return self.weights[name]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.weight("tok_embeddings")[ids].astype(np.float32)

    def rmsnorm(self, x: np.ndarray, name: str) -> np.ndarray:
        return prefill_k.rmsnorm_reference(x, self.weight(name), self.config["norm_eps"])

    def linear(self, name: str, h: np.ndarray, add_to=None) -> np.ndarray:
        y = h.astype(np.float32) @ self.weight(name).T
        if add_to is None:
            return y
        add_to += y
        return add_to

    def rope_store(self, qkv: np.ndarray, layer: int, start: int) -> np.ndarray:
        c = self.config
        bias = self.weight(f"layers.{layer}.bqkv") if c.get("qkv_bias") else None
        q, k, v = prefill_k.rope_store_reference(qkv, start, c["n_heads"], c["n_kv_heads"], c["head_dim"],
                                                 self.cos, self.sin, bias)
        self.k_cache[layer, start: start + qkv.shape[0]] = k
        self.v_cache[layer, start: start + qkv.shape[0]] = v
        return q

    def attention(self, q: np.ndarray, layer: int, start: int) -> np.ndarray:
        return prefill_k.attention_reference(q, self.k_cache[layer], self.v_cache[layer], start,
                                             self.config.get("sliding_window"))

    def swiglu(self, gate_up: np.ndarray) -> np.ndarray:
        return prefill_k.swiglu_reference(gate_up)

    def empty_logits(self, n: int) -> np.ndarray:
        return np.empty((n, self.config["vocab_size"]), dtype=np.float32)

    def logits(self, x: np.ndarray, row: int, n_rows: int, out: np.ndarray) -> None:
        out[...] = self.linear("output", self.rmsnorm(x[row: row + n_rows], "norm"))


# ------------------------------------------------------------------------------- backend front

class Prefill:
    """The CUDA backend's prompt path: run(token_ids, start_pos, logits) over its weights and KV cache."""

    def __init__(self, backend, chunk: int | None = None):
        self.backend = backend
        self.config = backend.config
        if chunk is None:
            free = backend.cp.cuda.Device().mem_info[0] + backend.cp.get_default_memory_pool().free_bytes()
            chunk = choose_chunk(self.config, free, 2 * scratch_halves(backend.tinf))
        self.chunk = chunk
        self.ops = CudaOps(backend, chunk) if chunk else None

    def run(self, token_ids, start_pos: int, logits: str | None = "all"):
        """Logits as a CuPy array ("all": [n, vocab], "last": [1, vocab]) or None; K/V of every token cached."""
        token_ids = np.asarray(token_ids, dtype=np.int64).ravel()
        self.backend.check_room(start_pos + token_ids.size - 1)
        with self.backend.stream:
            return run_prefill(self.ops, self.config, token_ids, start_pos, self.chunk, logits)


def for_prompt(backend, n_tokens: int):
    """The backend's Prefill when n_tokens should be prefilled (long enough, supported model), else None."""
    if n_tokens < PREFILL_MIN_TOKENS or not supported(backend.config):
        return None
    prefill = getattr(backend, "_prefill", None)
    if prefill is None:
        prefill = backend._prefill = Prefill(backend)
    return prefill if prefill.chunk else None


# ----------------------------------------------------------------------------------- measuring

def median_wall_seconds(stream, run, reps: int) -> float:
    """Median wall-clock seconds of run() with the stream drained before and after, host time
    included, over `reps` runs after one warm-up run."""
    import time

    times = []
    for i in range(reps + 1):
        stream.synchronize()
        start = time.perf_counter()
        run()
        stream.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_prefill(prefill, token_ids, reps: int = 5) -> float:
    """Median seconds of prefilling token_ids from position 0 (last position's logits)."""
    return median_wall_seconds(prefill.backend.stream, lambda: prefill.run(token_ids, 0, "last"), reps)


def time_token_steps(backend, token_ids, reps: int = 3) -> float:
    """Median seconds of the decode graph over token_ids, one replay per token."""
    def run():
        with backend.stream:
            backend.run_steps(np.asarray(token_ids), 0)

    return median_wall_seconds(backend.stream, run, reps)


def time_to_first_token(backend, token_ids, reps: int = 3) -> float:
    """Median seconds from generate_ids() to its first (greedy) token, as a user waits for it."""
    from tinyinfer.runtime.sampling import SamplingParams

    def run():
        next(iter(backend.generate_ids(token_ids, 0, SamplingParams(), 1, np.random.default_rng(0))))

    return median_wall_seconds(backend.stream, run, reps)


def prefill_report(model, lengths=(512, 2048), crossover=(16, 32, 64), reps: int = 5) -> dict:
    """pp<N> (prompt tokens/s, like llama-bench), time to first token, and prefill vs decode graph at short lengths."""
    from tinyinfer.runtime.bench import bench_prompt

    backend = model.backend
    prefill = for_prompt(backend, max(lengths))
    if prefill is None:
        return {"available": False}
    report = {"available": True, "chunk": prefill.chunk, "min_tokens": PREFILL_MIN_TOKENS}
    for n in lengths:
        if n > backend.max_context:
            continue
        prompt = bench_prompt(model, n)
        seconds = time_prefill(prefill, prompt, reps)
        report[f"pp{n}"] = round(n / seconds, 1)
        report[f"pp{n}_ms"] = round(1e3 * seconds, 2)
        report[f"ttft{n}_ms"] = round(1e3 * time_to_first_token(backend, prompt), 2)
    report["short_prompts_ms"] = {}
    for n in crossover:
        prompt = bench_prompt(model, n)
        report["short_prompts_ms"][n] = {"prefill": round(1e3 * time_prefill(prefill, prompt, reps), 3),
                                         "decode_graph": round(1e3 * time_token_steps(backend, prompt), 3)}
    return report


def format_prefill(report: dict) -> str:
    if not report.get("available"):
        return "prefill: not available for this model (token-by-token prompt processing)"
    parts = [f"{k} {v:.0f} tok/s ({report[k + '_ms']:.1f} ms)" for k, v in report.items()
             if k.startswith("pp") and not k.endswith("_ms")]
    ttft = [f"{k[4:-3]}-token prompt {v:.1f} ms" for k, v in report.items() if k.startswith("ttft")]
    short = ", ".join(f"{n}: {t['prefill']:.2f} vs {t['decode_graph']:.2f} ms"
                      for n, t in report["short_prompts_ms"].items())
    return (f"prefill (chunk {report['chunk']}): {', '.join(parts)}; time to first token: {', '.join(ttft)}\n"
            f"short prompts, prefill vs decode graph: {short}")


def main(argv=None) -> int:
    """python -m tinyinfer.runtime.cuda_prefill (MODEL.tinf | --random CONFIG.json [--quant q4]) [--chunks 512,2048]:
    prefill speed (pp512, pp2048, time to first token, short prompts) and pp2048 per chunk size."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import bench_prompt, tinf_config, write_random_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", nargs="?", help="a .tinf file")
    parser.add_argument("--random", metavar="CONFIG_JSON",
                        help="a Hugging Face config.json: random weights of its shape")
    parser.add_argument("--quant", default="q4", choices=("q4", "q8", "f16"))
    parser.add_argument("--chunks", default="", help="comma-separated chunk sizes to time pp2048 with")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if args.random:
            config = tinf_config(json.loads(Path(args.random).read_text()))
            path = write_random_model(Path(tmp) / f"random-{args.quant}.tinf", config, args.quant, 64,
                                      reuse_layers=True)
        with load(path, device="cuda") as model:
            report = {"model": str(args.random or path), "quant": args.quant, "gpu": model.backend.gpu_name,
                      **prefill_report(model)}
            print(format_prefill(report))
            report["chunks"] = {}
            n = min(2048, model.backend.max_context)
            for chunk in [int(c) for c in args.chunks.split(",") if c]:
                seconds = time_prefill(Prefill(model.backend, chunk), bench_prompt(model, n))
                report["chunks"][chunk] = round(n / seconds, 1)
                print(f"pp{n} with chunk {chunk}: {n / seconds:.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
