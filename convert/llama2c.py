"""llama2.c checkpoints (.bin): the legacy v0 layout and the v1 (fp32) / v2 (Q8_0) exports.

llama2.c applies RoPE to interleaved pairs (x[2i], x[2i+1]); the runtime uses Hugging Face's
rotate-half pairs (x[i], x[i + head_dim/2]). The wq/wk rows of each head are permuted at convert
time so that the same attention comes out.

v0: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means the classifier is not shared), then fp32 weights grouped by kind over all layers,
the final norm, two freq_cis tables [seq_len, head_dim/2] (skipped), and the classifier if unshared.
v1/v2: a 256-byte header (magic "ak42", version, the 7 ints, a shared-classifier byte, v2: group
size), then norms first; v2 stores the matrices as int8 with fp32 scales per group after all of them.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from tinyinfer.convert.errors import ConvertError
from tinyinfer.formats.tinf import MAX_CONTEXT, MAX_TENSORS

MAGIC = 0x616B3432
HEADER_V1 = 256
NORM_EPS = 1e-5          # llama2.c's ModelArgs default
MAX_LAYERS = (MAX_TENSORS - 3) // 6   # what a .tinf file can hold; bounds the layout tables built from the header
ROPE_THETA = 10000.0
# Per-layer matrices in file order (llama2.c names): w1 = gate, w2 = down, w3 = up.
MATRICES = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
LLAMA2C_NAMES = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "wo": "wo", "w_down": "w2"}


def rotate_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder a projection's rows from interleaved pairs to rotate-half, head by head.

    Within a head, interleaved row 2i+c (pair i, component c) moves to row c*head_dim/2 + i.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


class Llama2cCheckpoint:
    """A validated llama2.c .bin file; `load(tinf_name)` returns one fused float32 tensor."""

    def __init__(self, path: Path):
        self.path = path
        self.version, params, self.shared, self.group = read_header(path)
        dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = params
        if dim % n_heads or (dim // n_heads) % 2 or n_heads % n_kv_heads:
            raise bad_file(path, f"its heads ({n_heads} heads, {n_kv_heads} kv heads) do not divide dim {dim}")
        self.config = {
            "architecture": "llama", "dim": dim, "n_layers": n_layers, "n_heads": n_heads,
            "n_kv_heads": n_kv_heads, "head_dim": dim // n_heads, "ffn_dim": hidden,
            "vocab_size": vocab, "norm_eps": NORM_EPS, "rope_theta": ROPE_THETA,
            "rope_scaling": None, "max_context": seq_len, "tied_embeddings": self.shared,
            "qkv_bias": False, "sliding_window": None,
        }
        self.offsets = self.layout()
        expected = self.offsets.pop("end")
        size = path.stat().st_size
        if size != expected:
            raise bad_file(path, f"it has {size} bytes where its header implies {expected}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored array in file order; per-layer weights are named "<kind>.<layer>"."""
        c = self.config
        dim, hd, ffn, vocab = c["dim"], c["head_dim"], c["ffn_dim"], c["vocab_size"]
        kv = c["n_kv_heads"] * hd
        layer_shapes = {"attn_norm": (dim,), "ffn_norm": (dim,), "wq": (dim, dim), "wk": (kv, dim),
                        "wv": (kv, dim), "wo": (dim, dim), "w1": (ffn, dim), "w2": (dim, ffn), "w3": (ffn, dim)}

        def all_layers(*kinds):
            return {f"{k}.{i}": layer_shapes[k] for k in kinds for i in range(c["n_layers"])}

        embedding = {"tok_embeddings": (vocab, dim)}
        head = {} if self.shared else {"output": (vocab, dim)}
        if self.version == 0:
            return {**embedding, **all_layers("attn_norm", "wq", "wk", "wv", "wo"),
                    **all_layers("ffn_norm", "w1", "w2", "w3"), "norm": (dim,),
                    "freq_cis": (2, c["max_context"], hd // 2), **head}
        return {**all_layers("attn_norm", "ffn_norm"), "norm": (dim,), **embedding,
                **all_layers(*MATRICES), **head}

    def layout(self) -> dict:
        """name -> (byte offset, shape[, scale offset]) and "end": the file size implied by the header."""
        offsets, position = {}, HEADER_V1 if self.version else 28
        shapes = self.shapes()
        if self.version == 2:
            return self.layout_q8(shapes, position)
        for name, shape in shapes.items():
            offsets[name] = (position, shape)
            position += 4 * math.prod(shape)
        offsets["end"] = position
        return offsets

    def layout_q8(self, shapes: dict, position: int) -> dict:
        """v2: the fp32 norms, then the int8 values of every matrix, then all their fp32 scales."""
        norms = [name for name, shape in shapes.items() if len(shape) == 1]
        matrices = [name for name, shape in shapes.items() if len(shape) == 2]
        offsets, value_offsets = {}, {}
        for name in norms:
            offsets[name] = (position, shapes[name])
            position += 4 * shapes[name][0]
        for name in matrices:
            numel = math.prod(shapes[name])
            if numel % self.group:
                raise bad_file(self.path, f"{name} has {numel} weights, not a multiple of group {self.group}")
            value_offsets[name] = position
            position += numel
        for name in matrices:
            offsets[name] = (value_offsets[name], shapes[name], position)
            position += 4 * math.prod(shapes[name]) // self.group
        offsets["end"] = position
        return offsets

    def read(self, name: str) -> np.ndarray:
        if name == "output" and self.shared:
            name = "tok_embeddings"
        offset, shape, *scale_offset = self.offsets[name]
        numel = math.prod(shape)
        if not scale_offset:
            return np.fromfile(self.path, dtype="<f4", count=numel, offset=offset).reshape(shape)
        q = np.fromfile(self.path, dtype=np.int8, count=numel, offset=offset)
        scales = np.fromfile(self.path, dtype="<f4", count=numel // self.group, offset=scale_offset[0])
        return (q.reshape(-1, self.group) * scales[:, None]).astype(np.float32).reshape(shape)

    def load(self, tinf_name: str) -> np.ndarray:
        parts = tinf_name.split(".")
        if len(parts) == 1:
            return self.read(tinf_name)
        i, kind = parts[1], parts[2]
        c = self.config
        if kind == "wqkv":
            q = rotate_half_rows(self.read(f"wq.{i}"), c["n_heads"])
            k = rotate_half_rows(self.read(f"wk.{i}"), c["n_kv_heads"])
            return np.concatenate([q, k, self.read(f"wv.{i}")], axis=0)
        if kind == "w_gate_up":
            return np.concatenate([self.read(f"w1.{i}"), self.read(f"w3.{i}")], axis=0)
        return self.read(f"{LLAMA2C_NAMES[kind]}.{i}")


def read_header(path: Path) -> tuple[int, tuple[int, ...], bool, int | None]:
    """(version, (dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len), shared classifier, group)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_V1)
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}; check the path and permissions.") from e
    if len(head) < 28:
        raise bad_file(path, "it is shorter than a llama2.c header")
    if head.startswith(b"PK\x03\x04"):
        raise ConvertError(f"{path} is a PyTorch (zip) checkpoint, which is not read; convert a "
                           f"safetensors Hugging Face folder or a llama2.c export instead.")
    (magic,) = struct.unpack_from("<I", head, 0)
    if magic != MAGIC:
        params = struct.unpack_from("<7i", head, 0)
        version, shared, group = 0, params[5] > 0, None
        params = params[:5] + (abs(params[5]),) + params[6:]
    else:
        if len(head) < HEADER_V1:
            raise bad_file(path, "its header is shorter than 256 bytes")
        (version,) = struct.unpack_from("<i", head, 4)
        if version not in (1, 2):
            raise bad_file(path, f"it is llama2.c export version {version} (only 0, 1 and 2 are read)")
        params = struct.unpack_from("<7i", head, 8)
        shared = bool(head[36])
        group = struct.unpack_from("<i", head, 37)[0] if version == 2 else None
        if group is not None and group < 1:
            raise bad_file(path, f"its quantization group size {group} is not positive")
    if min(params) < 1:
        raise bad_file(path, f"its header {list(params)} has a non-positive size")
    if params[2] > MAX_LAYERS or params[6] > MAX_CONTEXT:
        raise bad_file(path, f"its header {list(params)} declares more than {MAX_LAYERS} layers or "
                             f"{MAX_CONTEXT} positions")
    return version, params, shared, group


def bad_file(path: Path, problem: str) -> ConvertError:
    return ConvertError(f"{path} is not a llama2.c checkpoint this converter reads because {problem}; "
                        f"pass a llama2.c export (version 0, 1 or 2) or a Hugging Face checkpoint.")
