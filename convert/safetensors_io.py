"""A torch-free safetensors reader that validates the header like the Rust crate and reads one
tensor at a time as float32.

Format: u64 little-endian header length N, N bytes of JSON, then the data buffer. Every tensor's
`data_offsets` are relative to the buffer; together they must tile it exactly (no holes, no
overlap, nothing after the last tensor).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from tinyinfer.convert.errors import ConvertError
from tinyinfer.formats.errors import shown
from tinyinfer.formats.quant import bf16_to_f32

MAX_HEADER_BYTES = 100_000_000          # the Rust crate's limit
# Source dtypes we convert, as (numpy storage dtype, bytes per element).
DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}
# Every dtype the format defines, in bits, so we can validate sizes of tensors we will not read.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16,
              "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64,
              "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class SafetensorsFile:
    """Header of one .safetensors file; `read(name)` loads a single tensor as float32."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.data_start, self.entries, self.metadata = read_header(self.path)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as float32 (bf16 and f16 widened exactly), in a fresh array or written into `out`
        (a C-contiguous float32 array of the tensor's shape, e.g. a row block of a fused matrix)."""
        entry = self.entries[name]
        if entry["dtype"] not in DTYPES:
            raise ConvertError(f"tensor {shown(name)} in {self.path} has dtype {entry['dtype']}; "
                               f"only F32, F16 and BF16 checkpoints can be converted.")
        storage, itemsize = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // itemsize
        raw = np.fromfile(self.path, dtype=storage, count=count, offset=self.data_start + begin)
        if raw.size != count:
            raise ConvertError(f"{self.path} was truncated while reading {shown(name)}; download it again.")
        raw = raw.reshape(entry["shape"])
        if out is None:
            out = np.empty(raw.shape, np.float32)
        if entry["dtype"] == "BF16":
            return bf16_to_f32(raw, out)
        out[...] = raw
        return out


def read_header(path: Path) -> tuple[int, dict, dict]:
    """Parse and validate the header: (data start offset, {name: entry} in file order, metadata)."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad_file(path, "it is shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise bad_file(path, f"its header length {header_len} is larger than the limit or the file")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}; check the path and permissions.") from e
    header = parse_json(path, header_bytes)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise bad_file(path, "its __metadata__ is not a map of strings")
    entries = {name: checked_entry(path, name, entry) for name, entry in header.items()}
    check_offsets(path, entries, file_size - 8 - header_len)
    return 8 + header_len, entries, metadata


def parse_json(path: Path, header_bytes: bytes) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise bad_file(path, "its header repeats a tensor name")
        return dict(pairs)

    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:   # ValueError: JSON syntax, huge integers
        raise bad_file(path, "its header is not valid UTF-8 JSON") from e
    if not isinstance(header, dict):
        raise bad_file(path, "its header is not a JSON object")
    return header


def checked_entry(path: Path, name: str, entry) -> dict:
    """Validate one tensor entry: known dtype, non-negative shape, size matching its byte range."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise bad_file(path, f"tensor {shown(name)} does not have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise bad_file(path, f"tensor {shown(name)} has unknown dtype {shown(dtype)}")
    if not (isinstance(shape, list) and all(is_count(d) for d in shape)):
        raise bad_file(path, f"tensor {shown(name)} has an invalid shape {shown(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise bad_file(path, f"tensor {shown(name)} has invalid data_offsets {shown(offsets)}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]           # Python ints: no overflow
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise bad_file(path, f"tensor {shown(name)} has {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype}")
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def check_offsets(path: Path, entries: dict, buffer_size: int) -> None:
    """The byte ranges must tile [0, buffer_size) exactly, as the Rust reader requires."""
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin != position:
            raise bad_file(path, f"tensor {shown(name)} starts at byte {begin} instead of {position}")
        position = end
    if position != buffer_size:
        raise bad_file(path, f"its tensors cover {position} bytes but the data section has {buffer_size}")


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def bad_file(path: Path, problem: str) -> ConvertError:
    return ConvertError(f"{path} is not a valid safetensors file because {problem}; "
                        f"re-download or re-save the checkpoint.")
