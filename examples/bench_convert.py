"""Time tinyconvert on a TinyLlama-shaped checkpoint and report its peak memory.

    python examples/bench_convert.py                       # q4 (calibrated), TinyLlama's shapes
    python examples/bench_convert.py --quant q4 --no-calibrate --keep /tmp/tl-checkpoint

Writes a random bf16 Hugging Face checkpoint with the real configuration (and TinyLlama's real
tokenizer when ../shared/assets is present, else a synthetic one), then runs `tinyconvert` on it in a
child process, so the peak resident memory measured is the converter's alone. Random weights cost
the converter exactly what trained ones do: the work depends only on shapes and encodings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_random import SHAPES, write_bf16_safetensors

ASSETS = Path(os.environ.get("TINYINFER_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "assets"


def write_checkpoint(folder: Path, shape: str) -> None:
    import numpy as np

    from tinyinfer.runtime.bench import synthetic_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    hf = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **hf}
    (folder / "config.json").write_text(json.dumps(config))
    real = ASSETS / "tinyllama-1.1b-chat-v1.0"
    if real.is_dir() and hf["vocab_size"] == 32000:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(real / name, folder / name)
    else:
        (folder / "tokenizer.json").write_text(synthetic_tokenizer(hf["vocab_size"])["tokenizer_json"])
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    dim, ffn, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    kv = hf["num_key_value_heads"] * dim // hf["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
                       p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (kv, dim),
                       p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, dim),
                       p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
                       p + "mlp.down_proj.weight": (dim, ffn)})
    write_bf16_safetensors(folder / "model.safetensors", shapes, np.random.default_rng(0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--quant", choices=("q4", "q8", "f16"), default="q4")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--keep", help="write (or reuse) the checkpoint in this folder")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp) / "checkpoint"
        if not (folder / "model.safetensors").is_file():
            started = time.perf_counter()
            write_checkpoint(folder, args.shape)
            print(f"wrote the checkpoint in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        out = Path(tmp) / "model.tinf"
        command = [sys.executable, "-m", "tinyinfer.convert.cli", str(folder), "-o", str(out), "--quant", args.quant]
        if args.no_calibrate:
            command.append("--no-calibrate")
        started = time.perf_counter()
        subprocess.run(command, check=True)
        seconds = time.perf_counter() - started
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {"shape": args.shape, "quant": args.quant, "calibrated": not args.no_calibrate,
              "seconds": round(seconds, 1), "peak_rss_mib": round(peak_mib), "cpus": os.cpu_count()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
