"""Offline demo: build a tiny random Llama checkpoint, convert it to .tinf, and run tinyrun on it.

    python examples/demo_offline.py [--keep DIR]

Everything is made on the spot (no download): random weights in the Hugging Face layout, and a
small byte-level BPE tokenizer trained in memory with the `tokenizers` library. A random model
writes gibberish, but the whole path runs: checkpoint -> tinyconvert -> .tinf -> tinyrun.
When the stories260K test model sits in ../shared/assets (a checkout of the project's test assets),
it is converted and run too, and that one writes a real (tiny) story.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The project's test assets live beside the checkout (or where TINYINFER_SHARED points); optional.
SHARED = Path(os.environ.get("TINYINFER_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "assets" / "llama2c-stories260K"

CORPUS = [
    "Once upon a time, there was a little robot who loved to read books.",
    "Every morning the robot walked to the library and said hello to the cat.",
    "The cat was old and wise, and it knew the names of all the stars.",
    "One day the robot asked the cat: why do the stars shine at night?",
    "Because they are far away suns, said the cat, and the robot smiled.",
    "Tiny models write tiny stories; big models write long ones.",
    "Numbers like 1, 2, 3 and 42 appear in text too, as do questions?",
]
# A minimal template in the usual style: special tokens come in as variables, as transformers passes them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_random_checkpoint(folder: Path, seed: int = 0, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                            n_kv_heads: int = 2, ffn_dim: int = 160, max_context: int = 256) -> Path:
    """A random LlamaForCausalLM checkpoint folder: config.json, model.safetensors, tokenizer files."""
    from safetensors.numpy import save_file

    from tinyinfer.runtime.bench import byte_level_tokenizer_json

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = byte_level_tokenizer_json(384, CORPUS)
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    vocab_size = len(vocab)
    head_dim = dim // n_heads
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(vocab_size, dim), "lm_head.weight": matrix(vocab_size, dim),
               "model.norm.weight": np.ones(dim, np.float32)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": np.ones(dim, np.float32),
            p + "post_attention_layernorm.weight": np.ones(dim, np.float32),
            p + "self_attn.q_proj.weight": matrix(n_heads * head_dim, dim),
            p + "self_attn.k_proj.weight": matrix(n_kv_heads * head_dim, dim),
            p + "self_attn.v_proj.weight": matrix(n_kv_heads * head_dim, dim),
            p + "self_attn.o_proj.weight": matrix(dim, n_heads * head_dim),
            p + "mlp.gate_proj.weight": matrix(ffn_dim, dim),
            p + "mlp.up_proj.weight": matrix(ffn_dim, dim),
            p + "mlp.down_proj.weight": matrix(dim, ffn_dim),
        })
    save_file(weights, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
        "intermediate_size": ffn_dim, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads, "vocab_size": vocab_size, "max_position_embeddings": max_context,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}, indent=2))
    return folder


def tinyrun(*args: str) -> None:
    """Run the tinyrun CLI in a child process, as a user would."""
    command = [sys.executable, "-m", "tinyinfer.runtime.cli", *args]
    print("$ " + shlex.join(["tinyrun", *args]), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the files here instead of a temporary folder")
    args = parser.parse_args()
    from tinyinfer.convert import convert_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        checkpoint = write_random_checkpoint(work / "random-llama")
        print(f"wrote a random checkpoint to {checkpoint}")
        model = convert_checkpoint(checkpoint, out=work / "random-llama-q4.tinf", quant="q4", progress=False)
        print(f"converted it to {model}")
        tinyrun("info", str(model))
        print("\nThe weights are random, so the text is gibberish (bytes that are not even valid UTF-8 show as �):")
        tinyrun(str(model), "--prompt", "Once upon a time", "--max-tokens", "24", "--device", "cpu")
        tinyrun(str(model), "--chat", "--prompt", "Hello!", "--max-tokens", "16", "--temperature", "0.8",
                "--seed", "1", "--device", "cpu")
        if (STORIES / "stories260K.bin").is_file():
            stories = convert_checkpoint(STORIES / "stories260K.bin", out=work / "stories260K-q8.tinf", quant="q8",
                                         tokenizer=STORIES / "tok512.model", progress=False)
            print(f"\nconverted the trained stories260K model to {stories}")
            tinyrun(str(stories), "--prompt", "Once upon a time", "--max-tokens", "120", "--device", "cpu")


if __name__ == "__main__":
    main()
