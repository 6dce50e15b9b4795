"""Small .tinf files written directly with tinyinfer.formats (no converter), for Hub and integrity tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinyinfer.formats import TensorSpec, TinfWriter, encode

CONFIG = {"architecture": "llama", "dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
          "ffn_dim": 96, "vocab_size": 48, "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
          "max_context": 128, "tied_embeddings": False}
PROVENANCE = {"source": "example-org/tiny-llama", "revision": "0123456789abcdef0123456789abcdef01234567",
              "converter": "tinyinfer 0.1.0", "created": "2026-11-30T12:00:00Z", "quant": "q4",
              "group_size": 32, "scale_search": True, "license": "apache-2.0"}
# name -> (shape, encoding, group)
TENSORS = {
    "tok_embeddings": ((48, 64), "f16", None),
    "layers.0.wqkv": ((128, 64), "q4", 32),
    "layers.0.w_down": ((64, 96), "q4", 32),
    "norm": ((64,), "f32", None),
    "output": ((48, 64), "q4", 32),
}


def write_tiny_tinf(path, provenance=PROVENANCE, autotune=None, chat_template=None, seed=0) -> Path:
    """A five-tensor file (f16, f32 and q4 g32) with the given provenance and autotune section."""
    rng = np.random.default_rng(seed)
    metadata = {"config": dict(CONFIG), "tokenizer": {"kind": "hf-json"}, "chat_template": chat_template,
                "generation": {}, "autotune": dict(autotune or {})}
    if provenance is not None:
        metadata["provenance"] = dict(provenance)
    specs = [TensorSpec(name, enc, shape, group) for name, (shape, enc, group) in TENSORS.items()]
    with TinfWriter(path, metadata, specs) as writer:
        for name, (shape, enc, group) in TENSORS.items():
            w = rng.standard_normal(shape).astype(np.float32)
            writer.write(name, encode(w, enc, group or 64))
    return Path(path)


RUNNABLE_CONFIG = {"architecture": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                   "ffn_dim": 128, "vocab_size": 64, "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
                   "max_context": 64, "tied_embeddings": False}


def write_runnable_tinf(path, seed=0) -> Path:
    """A complete random-weight model with a word-level tokenizer (w3 w4 ...), small enough for the CPU."""
    from tinyinfer.runtime.bench import write_random_model

    write_random_model(path, RUNNABLE_CONFIG, quant="q4", group=32, seed=seed)
    return Path(path)


def stored_bytes(tensor) -> np.ndarray:
    """A formats.Tensor's bytes exactly as a .tinf file holds them."""
    from tinyinfer.formats import tensor_nbytes

    out = np.zeros(tensor_nbytes(tensor.encoding, tensor.shape, tensor.group), dtype=np.uint8)
    for offset, array in tensor.parts():
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        out[offset: offset + raw.size] = raw
    return out


def device_bytes(tensor, shape) -> np.ndarray:
    """The tensor's bytes as the CUDA backend holds them for the GEMV of `shape` (kernels/layout.py)."""
    from tinyinfer.kernels import layout

    raw = stored_bytes(tensor)
    if shape.blocked:
        layout.block_in_place(raw, shape)
    return raw


def flip_byte(path: Path, tensor: str, at: int) -> None:
    """Invert one byte `at` bytes into `tensor`'s data (negative: from its end)."""
    from tinyinfer.formats import open_tinf

    with open_tinf(path) as f:
        info = f.info(tensor)
        offset = f.data_offset + info.offset + (at % info.nbytes)
    with open(path, "r+b") as out:
        out.seek(offset)
        byte = out.read(1)[0]
        out.seek(offset)
        out.write(bytes([byte ^ 0xFF]))
