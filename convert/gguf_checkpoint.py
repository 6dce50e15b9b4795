"""GGUF checkpoints (llama.cpp's single-file format) of the llama and qwen2 architectures.

`open_gguf(path)` is the one entry point: it checks the file's layout, reads it with the gguf
package, maps its metadata to the tinf config, checks every tensor against that config and builds
the tokenizer, raising only ConvertError. The checkpoint then looks like the other sources:
`config` and `load(tinf_name)` -> float32; `exact(tinf_name, encoding, group)` gives the tinf tensor
copied bit for bit from GGML blocks where the encodings match (gguf_blocks).

llama.cpp's converter permutes the q/k projection rows of the `llama` architecture into
interleaved RoPE pairs; they are permuted back to the rotate-half order here (whole rows move, so
quantized blocks move intact). `qwen2` files keep the Hugging Face order.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from tinyinfer.convert import gguf_blocks
from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.convert.gguf_file import Metadata, read_gguf, refuse
from tinyinfer.formats.errors import shown
from tinyinfer.formats.tinf import MAX_CONTEXT

ARCHITECTURES = ("llama", "qwen2")
SUPPORTED = ("supported are GGUF files of the llama and qwen2 architectures (Llama 1/2/3, Mistral, "
             "TinyLlama, SmolLM, Qwen2/2.5)")
MAX_LAYERS = 1024
LAYER_PARTS = {  # tinf tensor kind -> the GGUF tensors concatenated (by rows) to make it
    "attn_norm": ("attn_norm.weight",),
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "bqkv": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "wo": ("attn_output.weight",),
    "ffn_norm": ("ffn_norm.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
}
# Tensors read for the config only: llama.cpp's per-frequency RoPE factors (Llama 3.1+).
CONFIG_TENSORS = {"rope_freqs.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16")
LLAMA3_CANDIDATES = [(low, high, context) for low in (1.0, 2.0) for high in (2.0, 4.0, 8.0)
                     for context in (2048, 4096, 8192, 16384, 32768)]


def open_gguf(path) -> "GgufCheckpoint":
    """Validate a .gguf file completely; the only exception it raises is ConvertError."""
    path = Path(path)
    try:
        return GgufCheckpoint(path)
    except ConvertError:
        raise
    except Exception as e:   # a value no check foresaw must still end in one sentence
        raise refuse(path, f"reading it failed ({type(e).__name__}: {brief(e)})") from e


def refuse_model(problem: str):
    raise ConvertError(f"this GGUF model cannot be converted because {problem}; {SUPPORTED}.")


class GgufCheckpoint:
    def __init__(self, path: Path):
        from tinyinfer.convert.gguf_tokenizer import gguf_tokenizer

        self.path = path
        reader = read_gguf(path)
        self.meta = Metadata(reader, path)
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch = self.meta.str("general.architecture")
        if self.arch not in ARCHITECTURES:
            refuse_model(f"its architecture is {shown(self.arch)}" if self.arch else "it has no general.architecture")
        self.config = gguf_config(self.meta, self.arch, self.tensors)
        self.sources = source_names(self.config, permute_qk=self.arch == "llama")
        self.check_tensors()
        self.check_memory()
        self.tokenizer, self.chat_template = gguf_tokenizer(self.meta, self.config["vocab_size"], path)
        self.license = self.meta.str("general.license")
        self.generation: dict = {}

    # ------------------------------------------------------------------------ validation

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> [rows, cols] (1-D: [n]) as the config implies."""
        c = self.config
        dim, hd, ffn = c["dim"], c["head_dim"], c["ffn_dim"]
        q, kv = c["n_heads"] * hd, c["n_kv_heads"] * hd
        shapes = {"token_embd.weight": (c["vocab_size"], dim), "output_norm.weight": (dim,)}
        if not c["tied_embeddings"]:
            shapes["output.weight"] = (c["vocab_size"], dim)
        per_layer = {"attn_norm.weight": (dim,), "attn_q.weight": (q, dim), "attn_k.weight": (kv, dim),
                     "attn_v.weight": (kv, dim), "attn_output.weight": (dim, q), "ffn_norm.weight": (dim,),
                     "ffn_gate.weight": (ffn, dim), "ffn_up.weight": (ffn, dim), "ffn_down.weight": (dim, ffn)}
        if c["qkv_bias"]:
            per_layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
        for i in range(c["n_layers"]):
            shapes.update({f"blk.{i}.{name}": shape for name, shape in per_layer.items()})
        return shapes

    def check_tensors(self) -> None:
        expected = self.expected_shapes()
        for name, shape in expected.items():
            if name not in self.tensors:
                refuse_model(f"tensor {name} is missing")
            found = tensor_shape(self.tensors[name])
            if found != shape:
                refuse_model(f"tensor {name} has shape {list(found)} where the metadata implies {list(shape)}")
            kind = self.type_name(name)
            if len(shape) == 1 and kind not in FLOAT_TYPES:
                refuse_model(f"the 1-D tensor {name} is stored as {kind} (norms and biases must be F32, F16 or BF16)")
            if kind not in FLOAT_TYPES and not dequantizable(self.tensors[name].tensor_type):
                refuse_model(f"tensor {name} is stored as {kind}, which the gguf package cannot dequantize")
        for name in self.tensors:
            if name not in expected and name not in CONFIG_TENSORS:
                refuse_model(f"it has the tensor {name}, which this architecture does not use")

    def check_memory(self) -> None:
        """The largest fused tensor is held as float32 plus the encoder's temporaries: refuse what cannot fit."""
        largest = max(math.prod(shape) for shape in self.tinf_shapes().values())
        needed, available = 3 * 4 * largest, available_memory()
        if available is not None and needed > available:
            raise ConvertError(f"converting {self.path} needs about {needed / 2**30:.1f} GiB of memory for its "
                               f"largest tensor but only {available / 2**30:.1f} GiB is available; free memory "
                               f"or convert on a larger machine.")

    def tinf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: (sum(tensor_shape(self.tensors[p])[0] for p in parts),
                       *tensor_shape(self.tensors[parts[0]])[1:])
                for name, (parts, _) in self.sources.items()}

    # ------------------------------------------------------------------------ reading

    def type_name(self, gguf_name: str) -> str:
        return self.tensors[gguf_name].tensor_type.name

    def source_types(self, tinf_name: str) -> set[str]:
        return {self.type_name(part) for part in self.sources[tinf_name][0]}

    def load(self, tinf_name: str) -> np.ndarray:
        """One tinf tensor as float32, dequantized with gguf.quants (the values llama.cpp computes with)."""
        from gguf.quants import dequantize

        parts, permuted = self.sources[tinf_name]
        arrays = []
        for part, heads in zip(parts, permuted):
            t = self.tensors[part]
            values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            arrays.append(rotate_half_rows(values, heads) if heads else values)
        return arrays[0].copy() if len(arrays) == 1 else np.concatenate(arrays, axis=0)

    def exact(self, tinf_name: str, encoding: str, group: int | None):
        """The tinf tensor in `encoding` (group 32) holding exactly the file's weights, or None."""
        parts, permuted = self.sources[tinf_name]
        if group != gguf_blocks.BLOCK:
            return None
        pieces = []
        for part, heads in zip(parts, permuted):
            t = self.tensors[part]
            shape = tensor_shape(t)
            if len(shape) != 2:
                return None
            piece = gguf_blocks.exact_tensor(np.asarray(t.data), t.tensor_type.name, encoding, shape)
            if piece is None:
                return None
            if heads:
                piece.data, piece.scales = rotate_half_rows(piece.data, heads), rotate_half_rows(piece.scales, heads)
            pieces.append(piece)
        first = pieces[0]
        rows = sum(p.shape[0] for p in pieces)
        return type(first)(first.encoding, (rows, first.shape[1]),
                           np.concatenate([p.data for p in pieces]), np.concatenate([p.scales for p in pieces]),
                           first.group)


    # ------------------------------------------------------------------------ encodings

    def own_encodings(self, specs, quantized: dict) -> list:
        """Specs where each quantized matrix role (wqkv, wo, ..., output) takes the encoding its GGUF
        tensors have, when all of them share one that tinyinfer holds exactly at the spec's group."""
        from tinyinfer.formats import TensorSpec

        roles: dict[str, set] = {}
        for spec in specs:
            if spec.encoding in quantized:
                own = {own_encoding(t, spec.group) for t in self.source_types(spec.name)}
                roles.setdefault(spec.name.split(".")[-1], set()).update(own)
        kept = {role: own.pop() for role, own in roles.items() if len(own) == 1 and None not in own}
        planned = []
        for spec in specs:
            role = spec.name.split(".")[-1]
            if spec.encoding in quantized and role in kept:
                spec = TensorSpec(spec.name, kept[role][0], spec.shape, kept[role][1])
            planned.append(spec)
        return planned

    def requantized_note(self, specs) -> str | None:
        """One line naming what is dequantized from GGML blocks and quantized again, or None."""
        types, targets, count = set(), set(), 0
        for spec in specs:
            if spec.encoding not in ("q4", "q8"):
                continue
            lossy = {t for t in self.source_types(spec.name)
                     if t not in FLOAT_TYPES and (spec.encoding, spec.group) not in gguf_blocks.exact_encodings(t)}
            if lossy:
                types |= lossy
                targets.add(f"{spec.encoding} (group {spec.group})")
                count += 1
        if not count:
            return None
        return (f"note: {count} tensors stored as {', '.join(sorted(types))} are dequantized and re-quantized "
                f"to {' and '.join(sorted(targets))}, which costs quality; --quant q8 keeps most of it.")


def tensor_shape(t) -> tuple[int, ...]:
    """GGUF dimensions are listed innermost first: [cols, rows] -> (rows, cols)."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def dequantizable(tensor_type) -> bool:
    import gguf.quants

    return tensor_type in gguf.quants._type_traits


def rotate_half_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's interleaved RoPE pairs back to rotate-half order: row 2i + c
    of a head moves to row c * head_dim/2 + i. Works on any per-row array (weights, scales, biases)."""
    rows = x.shape[0]
    return np.ascontiguousarray(x.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(x.shape))


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def own_encoding(type_name: str, group: int) -> tuple[str, int | None] | None:
    """The encoding a GGML type keeps when no --quant is given: its exact one, f16 for float types."""
    if type_name in FLOAT_TYPES:
        return ("f16", None)
    exact = [pair for pair in gguf_blocks.exact_encodings(type_name) if pair[1] == group]
    return exact[0] if exact else None


# ---------------------------------------------------------------------------- config


def gguf_config(meta: Metadata, arch: str, tensors: dict) -> dict:
    """The tinf config from `{arch}.*` keys and the tensor directory (vocabulary, tied head, biases)."""
    key = lambda name: f"{arch}.{name}"   # noqa: E731
    for moe_key in ("expert_count", "expert_used_count"):
        if meta.int(key(moe_key), 0):
            refuse_model("it is a mixture-of-experts model")
    dim = required(meta, key("embedding_length"))
    n_layers = required(meta, key("block_count"), high=MAX_LAYERS)
    if 9 * n_layers > len(tensors):   # bound every per-layer structure before building any
        refuse_model(f"its block_count {n_layers} needs {9 * n_layers} tensors but the file has {len(tensors)}")
    n_heads = required(meta, key("attention.head_count"))
    n_kv_heads = meta.int(key("attention.head_count_kv"), n_heads, low=1)
    if n_heads % n_kv_heads:
        refuse_model(f"attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    head_dim = meta.int(key("attention.key_length"), dim // n_heads, low=1)
    if key("attention.key_length") not in meta and dim % n_heads:
        refuse_model(f"embedding_length {dim} is not a multiple of attention.head_count {n_heads}")
    if meta.int(key("attention.value_length"), head_dim) != head_dim:
        refuse_model("attention.value_length differs from key_length")
    if head_dim % 2 or meta.int(key("rope.dimension_count"), head_dim) != head_dim:
        refuse_model(f"RoPE does not rotate the whole head of {head_dim} (partial or odd rotary dimensions)")
    if meta.int(key("attention.sliding_window"), 0):
        refuse_model("it uses sliding-window attention, which GGUF conversion does not map yet")
    if "token_embd.weight" not in tensors:
        refuse_model("tensor token_embd.weight is missing")
    vocab_size = tensor_shape(tensors["token_embd.weight"])[0]
    declared = meta.int(key("vocab_size"), vocab_size, low=1)
    if declared != vocab_size:
        refuse_model(f"vocab_size {declared} differs from the {vocab_size} rows of token_embd.weight")
    eps = meta.float(key("attention.layer_norm_rms_epsilon"))
    if eps is None or not 0 < eps < 1:
        refuse_model("attention.layer_norm_rms_epsilon is missing or not in (0, 1)")
    theta = meta.float(key("rope.freq_base"), 10000.0)
    if theta <= 1:
        refuse_model(f"rope.freq_base {theta} is not above 1")
    return {
        "architecture": "llama", "dim": dim, "n_layers": n_layers, "n_heads": n_heads,
        "n_kv_heads": n_kv_heads, "head_dim": head_dim, "ffn_dim": required(meta, key("feed_forward_length")),
        "vocab_size": vocab_size, "norm_eps": eps, "rope_theta": theta,
        "rope_scaling": rope_scaling(meta, arch, tensors, head_dim, theta),
        "max_context": required(meta, key("context_length"), high=MAX_CONTEXT),
        "tied_embeddings": "output.weight" not in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors, "sliding_window": None,
    }


def required(meta: Metadata, key: str, high: int = 2**31 - 1) -> int:
    value = meta.int(key, None, low=1, high=high)
    if value is None:
        refuse_model(f"its metadata lacks {key}")
    return value


def rope_scaling(meta: Metadata, arch: str, tensors: dict, head_dim: int, theta: float) -> dict | None:
    """Linear scaling from rope.scaling.*, Llama 3 scaling recognised from the rope_freqs tensor."""
    kind = meta.str(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        if kind != "none":
            refuse_model(f"it combines rope_freqs with rope.scaling.type {shown(kind)}")
        return llama3_scaling(tensors["rope_freqs.weight"], head_dim, theta)
    if kind == "none":
        return None
    factor = meta.float(f"{arch}.rope.scaling.factor")
    if kind != "linear" or factor is None or factor <= 0:
        refuse_model(f"rope.scaling.type {shown(kind)} is not supported (only linear is)")
    return {"rope_type": "linear", "factor": factor} if factor != 1.0 else None


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, context: int):
    """The per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp's converter writes them."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blended))


def llama3_scaling(tensor, head_dim: int, theta: float) -> dict:
    """rope_freqs holds the divisor of each frequency; find the llama3 parameters that produce it."""
    if tensor.tensor_type.name != "F32" or tensor_shape(tensor) != (head_dim // 2,):
        refuse_model(f"rope_freqs.weight is not F32 with {head_dim // 2} values")
    factors = np.asarray(tensor.data, dtype=np.float64)
    factor = float(factors.max())
    for low, high, context in LLAMA3_CANDIDATES:
        if np.allclose(llama3_factors(head_dim, theta, factor, low, high, context), factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": context}
    refuse_model("its rope_freqs tensor does not match Llama 3 RoPE scaling")


def source_names(config: dict, permute_qk: bool) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """tinf name -> (GGUF tensors, per tensor the head count to un-permute its rows with, or 0)."""
    heads = {"attn_q": config["n_heads"], "attn_k": config["n_kv_heads"]} if permute_qk else {}
    names = {"tok_embeddings": (("token_embd.weight",), (0,))}
    kinds = [k for k in LAYER_PARTS if k != "bqkv" or config["qkv_bias"]]
    for i in range(config["n_layers"]):
        for kind in kinds:
            parts = tuple(f"blk.{i}.{p}" for p in LAYER_PARTS[kind])
            names[f"layers.{i}.{kind}"] = (parts, tuple(heads.get(p.split(".")[0], 0) for p in LAYER_PARTS[kind]))
    names["norm"] = (("output_norm.weight",), (0,))
    names["output"] = (("token_embd.weight" if config["tied_embeddings"] else "output.weight",), (0,))
    return names
