"""How much quality each encoding costs a trained model: perplexity and KL divergence against f16.

    python examples/quality.py ../shared/assets/derived/stories260K-hf --text ../shared/assets/text/tinystories_sample.txt --window 256
    python examples/quality.py SmolLM2-135M-Instruct.Q4_1.gguf --tokens 8192 --window 512 --json smollm2.json

The model is converted with tinyconvert at f16 (the reference) and at each tinyinfer encoding and
option, and every file runs through tinyinfer's NumPy backend, the same forward pass the CUDA
kernels are tested against. Beside them, llama.cpp's formats (Q4_0, Q4_1, Q4_K, Q8_0) are applied to
the same float weights, to the matrices tinyinfer quantizes (Q/K/V, O, gate/up, down and the output
head), and run through the same backend (examples/llama_cpp_formats.py), as is plain round-to-nearest
int4 (group 32, scale max|w| / 7), the baseline.

The text (CRLF normalised; documents separated by <|endoftext|> apart) is tokenized with the model's
tokenizer (BOS first, if it has one) and cut into windows of --window tokens; every token of a window
but its first is predicted from the ones before it. Reported per method: bits per weight of the quantized matrices (scales and padding
included) and of the whole model (embeddings and norms included), perplexity, its ratio to f16's, and
the mean KL(f16 || method) per predicted token.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

from llama_cpp_formats import quantize_dequantize

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
# tinyinfer's encodings and options: label -> tinyconvert options
TINYINFER = {
    "tinyinfer q4 (default)": {},
    "tinyinfer q4 --no-calibrate": {"calibrate": False},
    "tinyinfer q4 --group-size 64": {"group_size": 64},
    "tinyinfer q4 --no-scale-search": {"scale_search": False},
    "tinyinfer q4 --head f16": {"head": "f16"},
    "tinyinfer q8": {"quant": "q8"},
}
LLAMA_CPP = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


def quantized_names(config: dict) -> list[str]:
    return [f"layers.{i}.{m}" for i in range(config["n_layers"]) for m in MATRICES] + ["output"]


def text_windows(model, text: str, n_tokens: int, window: int) -> list[np.ndarray]:
    """Windows of at most `window` tokens, n_tokens in all. Documents separated by <|endoftext|> (as in
    TinyStories) are tokenized apart, each from its own BOS, and windows never cross them."""
    windows, total = [], 0
    for document in text.replace("\r\n", "\n").split("<|endoftext|>"):
        ids = model.tokenizer.encode(document.strip())
        for i in range(0, len(ids) - 1, window):
            piece = ids[i: i + window][: n_tokens - total]
            if len(piece) > 1:
                windows.append(np.asarray(piece))
                total += len(piece)
        if total >= n_tokens:
            break
    return windows


def log_probs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


class Scorer:
    """Perplexity and KL against the f16 reference's log-probabilities (kept on disk: 8K tokens of a
    49K vocabulary are 1.6 GB)."""

    def __init__(self, reference, windows, folder: Path):
        self.windows = windows
        self.n = sum(len(w) - 1 for w in windows)
        vocab = reference.config["vocab_size"]
        self.reference = np.lib.format.open_memmap(folder / "reference.npy", mode="w+", dtype=np.float32,
                                                   shape=(self.n, vocab))
        row = 0
        for ids in windows:
            self.reference[row: row + len(ids) - 1] = log_probs(reference.logits(ids)[:-1])
            row += len(ids) - 1

    def score(self, model) -> tuple[float, float]:
        nll = kl = 0.0
        row = 0
        for ids in self.windows:
            lp = log_probs(model.logits(ids)[:-1])
            ref = self.reference[row: row + len(ids) - 1]
            nll -= float(lp[np.arange(len(ids) - 1), ids[1:]].astype(np.float64).sum())
            kl += float((np.exp(ref.astype(np.float64)) * (ref - lp)).sum())
            row += len(ids) - 1
        return math.exp(nll / self.n), kl / self.n


def substituted_model(reference_path: Path, weights: dict):
    """The f16 reference file run with some matrices replaced by the given float32 weights."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime.model import Model
    from tinyinfer.runtime.numpy_backend import NumpyBackend
    from tinyinfer.runtime.tokenizer import Tokenizer

    class Substituted(NumpyBackend):
        def weight(self, name):
            return weights[name] if name in weights else super().weight(name)

    tinf = open_tinf(reference_path)
    backend = Substituted(tinf, weight_cache_bytes=0)
    return Model(tinf, backend, Tokenizer.from_metadata(tinf.metadata["tokenizer"]))


def round_to_nearest_q4(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, int]:
    """Plain RTN int4, the baseline every method must beat: scale = max|w| / 7 per group of 32, codes
    rounded and clipped to [-8, 7]; (reconstructed weights, bytes: 4 bits a weight, an fp16 per group)."""
    rows, cols = w.shape
    groups = np.pad(w.astype(np.float32), ((0, 0), (0, -cols % group))).reshape(rows, -1, group)
    scale = (np.abs(groups).max(axis=-1, keepdims=True) / 7).astype(np.float16).astype(np.float32)
    codes = np.clip(np.rint(np.divide(groups, scale, out=np.zeros_like(groups), where=scale > 0)), -8, 7)
    return (codes * scale).reshape(rows, -1)[:, :cols], groups.size // 2 + scale.size * 2


def reference_weights(checkpoint, names, fmt: str) -> tuple[dict, int]:
    """({name: reconstructed float32 weights}, bytes the format stores for them) for a llama.cpp
    format or RTN."""
    weights, n_bytes = {}, 0
    for name in names:
        w = checkpoint.load(name)
        weights[name], stored = round_to_nearest_q4(w) if fmt == "RTN" else quantize_dequantize(w, fmt)
        n_bytes += stored
    return weights, n_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="what tinyconvert reads: a Hugging Face folder, a .gguf or a llama2.c .bin")
    parser.add_argument("--tokenizer", help="SentencePiece .model for a llama2.c .bin")
    parser.add_argument("--text", default=str(ASSETS / "text" / "wikitext-2-raw-wiki.test.raw"))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the text to score")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--only", nargs="*", help="labels (or label prefixes) of the methods to run")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)

    from tinyinfer.convert.pipeline import convert_checkpoint, open_source
    from tinyinfer.formats import open_tinf
    from tinyinfer.formats.stats import file_weight_stats
    from tinyinfer.runtime import load

    wanted = lambda label: not args.only or any(label.startswith(o) for o in args.only)   # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        convert = lambda out, **kw: convert_checkpoint(args.source, tmp / out, tokenizer=args.tokenizer,  # noqa: E731
                                                       progress=False, **{"quant": "q4", **kw})
        reference_path = convert("f16.tinf", quant="f16")
        reference = load(reference_path, device="cpu")
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")[: 40 * args.tokens]
        windows = text_windows(reference, text, args.tokens, min(args.window, reference.max_context))
        scorer = Scorer(reference, windows, tmp)
        base_ppl, _ = scorer.score(reference)
        total = file_weight_stats(reference.tinf)
        rows.append({"method": "f16", "bits_quantized": None, "bits_all": total.bits_per_weight,
                     "ppl": base_ppl, "ratio": 1.0, "kl": 0.0})
        print(f"{scorer.n} tokens in {len(windows)} windows; f16 ppl {base_ppl:.4f}", file=sys.stderr)
        for label, options in TINYINFER.items():
            if not wanted(label):
                continue
            path = convert(label.replace(" ", "_").replace("-", "") + ".tinf", **options)
            with load(path, device="cpu") as model:
                ppl, kl = scorer.score(model)
                stats = file_weight_stats(model.tinf)
            rows.append({"method": label, "bits_quantized": stats.quantized_bits_per_weight,
                         "bits_all": stats.bits_per_weight, "ppl": ppl, "ratio": ppl / base_ppl, "kl": kl})
            print(table_row(rows[-1]), file=sys.stderr)
            path.unlink()
        checkpoint = open_source(args.source, None, None, args.tokenizer, False).checkpoint
        names = quantized_names(reference.config)
        with open_tinf(reference_path) as f:
            matrix_bytes = sum(f.info(n).nbytes for n in names)
            n_matrix = sum(math.prod(f.info(n).shape) for n in names)
        for fmt in ("RTN", *LLAMA_CPP):
            label = "RTN int4 g32 (max-abs / 7)" if fmt == "RTN" else f"llama.cpp {fmt}"
            if not wanted(label):
                continue
            weights, n_bytes = reference_weights(checkpoint, names, fmt)
            model = substituted_model(reference_path, weights)
            ppl, kl = scorer.score(model)
            model.close()
            rows.append({"method": label, "bits_quantized": 8 * n_bytes / n_matrix,
                         "bits_all": 8 * (total.n_bytes - matrix_bytes + n_bytes) / total.n_weights,
                         "ppl": ppl, "ratio": ppl / base_ppl, "kl": kl})
            print(table_row(rows[-1]), file=sys.stderr)
        reference.close()
    print("| method | bits/weight (quantized matrices) | bits/weight (all) | perplexity | ratio to f16 | KL vs f16 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(table_row(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.source, "text": args.text, "tokens": scorer.n,
                                               "window": args.window, "rows": rows}, indent=2))
    return 0


def table_row(row: dict) -> str:
    bits = "-" if row["bits_quantized"] is None else f"{row['bits_quantized']:.2f}"
    return (f"| {row['method']} | {bits} | {row['bits_all']:.2f} | {row['ppl']:.4f} | {row['ratio']:.4f} | "
            f"{row['kl']:.5f} |")


if __name__ == "__main__":
    sys.exit(main())
