"""Benchmark tinyinfer on any NVIDIA GPU without downloading a model.

    python examples/bench_random.py --shape tinyllama --quant q4
    python examples/bench_random.py --shape llama2-7b --quant f16 --tokens 256 --json out.json

Writes a .tinf with random weights and the real configuration (TinyLlama-1.1B or Llama-2-7B),
then runs the same benchmark as `tinyrun MODEL --bench N`. Random weights are read exactly as fast
as trained ones: the kernels' work depends only on the shapes and encodings.

By default the random tensors are written already encoded (random q4/q8 codes with fp16 scales of
realistic size, or random f16 values): seconds for TinyLlama, under a minute for 7B. With
--via-checkpoint a real Hugging Face checkpoint (bf16 safetensors) is written and converted with
tinyinfer's converter instead, exercising the full pipeline; that takes minutes for TinyLlama and,
for 7B, tens of minutes and ~40 GB of temporary disk for quantizing 6.7 billion floats.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    # TinyLlama-1.1B-Chat-v1.0's config.json (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads)
    "tinyllama": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    # Llama-2-7B (hidden 4096, intermediate 11008, 32 layers, 32 heads, 32 KV heads, vocab 32000)
    "llama2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--quant", choices=("q4", "q8", "f16"), default="q4")
    parser.add_argument("--group", type=int, choices=(32, 64, 128), default=None,
                        help="columns per scale (default: the converter's, 32 for q4 and 64 for q8)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens to decode per run")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--out", help="keep the model file here (default: a temporary file)")
    parser.add_argument("--via-checkpoint", action="store_true",
                        help="write a Hugging Face checkpoint and convert it (slow, see above)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    from tinyinfer.convert.pipeline import DEFAULT_GROUP

    args.group = args.group or DEFAULT_GROUP[args.quant]

    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import run_bench

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.out) if args.out else Path(tmp) / f"random-{args.shape}-{args.quant}.tinf"
        started = time.perf_counter()
        if args.via_checkpoint:
            write_via_checkpoint(path, SHAPES[args.shape], args.quant, args.group, Path(tmp))
        else:
            from tinyinfer.runtime.bench import tinf_config, write_random_model

            write_random_model(path, tinf_config(SHAPES[args.shape]), args.quant, args.group, reuse_layers=True)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
        with load(path, device="cuda", verbose=args.verbose) as model:
            result = run_bench(model, args.tokens, args.prompt_len, args.reps, args.json)
        # A second load of the same file: page cache warm, kernels and tuning cached (the load target).
        with load(path, device="cuda", verbose=args.verbose) as model:
            result["second_load"] = {k: round(v, 3) for k, v in model.backend.timings.items()}
            result["second_load"]["tuning_source"] = model.backend.tuning_source
        print(f"second load: {result['second_load']}", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}, indent=1))
    return 0


def write_via_checkpoint(path: Path, hf_config: dict, quant: str, group: int, tmp: Path) -> None:
    """Random bf16 safetensors + config + tokenizer in HF layout, then tinyinfer's converter."""
    from tinyinfer.convert.pipeline import convert_checkpoint

    folder = tmp / "checkpoint"
    write_random_checkpoint(folder, hf_config)
    convert_checkpoint(str(folder), path, quant=quant, group_size=group, progress=True)


def write_random_checkpoint(folder: Path, hf_config: dict, tokenizer_from: Path | None = None) -> None:
    """A Llama checkpoint in Hugging Face's layout with random bf16 weights of hf_config's shapes: its
    config.json, the tokenizer files of tokenizer_from (else a synthetic tokenizer), model.safetensors."""
    import shutil

    import numpy as np

    from tinyinfer.runtime.bench import synthetic_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
              **hf_config}
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(tokenizer_from / name, folder / name)
    else:
        (folder / "tokenizer.json").write_text(synthetic_tokenizer(config["vocab_size"])["tokenizer_json"])
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                  "unk_token": "<unk>"}))
    dim, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = dim // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
                       p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (kv, dim),
                       p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, dim),
                       p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
                       p + "mlp.down_proj.weight": (dim, ffn)})
    write_bf16_safetensors(folder / "model.safetensors", shapes, np.random.default_rng(0))


def write_bf16_safetensors(path: Path, shapes: dict, rng) -> None:
    """Stream random bf16 tensors into one safetensors file (one tensor in memory at a time)."""
    import struct

    import numpy as np

    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in shapes.items():
            if len(shape) == 1:
                values = np.ones(shape, dtype=np.float32)
            else:
                values = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
            f.write((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())


if __name__ == "__main__":
    sys.exit(main())
