"""Reading and writing .tinf files (the byte layout is specified in formats/README.md).

The reader trusts nothing: it bounds the metadata before unpacking it, checks the schema, and checks
every tensor's encoding, shape, size, alignment and range against the file before handing out a
zero-copy view. The writer lays out the whole file from the tensor specs up front, streams tensors
into a temporary file beside the target, fills in the checksums and renames only on success.
"""

from __future__ import annotations

import glob
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:   # not POSIX: temporary files are not locked, and stale ones are left alone
    fcntl = None

import msgpack
import numpy as np

from .errors import FormatError, shown
from .quant import (ENCODINGS, GROUP_SIZES, QUANTIZED, SECTION_ALIGN, STORAGE_DTYPE, Tensor, padded_cols,
                    rows_cols, scale_offset, tensor_nbytes)

MAGIC = b"TINYINF\0"
FORMAT_VERSION = (1, 0)
PREAMBLE = struct.Struct("<8sHHIQQ")  # magic, major, minor, flags, metadata length, data offset
DATA_ALIGN = 4096
TENSOR_ALIGN = SECTION_ALIGN
MAX_METADATA_BYTES = 64 << 20
MAX_TENSORS = 100_000
MAX_DIM = 1 << 31
# Longest context a file may declare: positions are int32 on the GPU, and no published model comes
# near 2^24 (16.7M) positions; the backends size their tables from it, so it is bounded before use.
MAX_CONTEXT = 1 << 24
CRC_PLACEHOLDER = "00000000"
REQUIRED_KEYS = {"config": dict, "tokenizer": dict, "tensors": list}
OPTIONAL_KEYS = {"chat_template": (str, type(None)), "generation": dict, "provenance": dict, "autotune": dict}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    encoding: str
    shape: tuple
    group: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    encoding: str
    shape: tuple
    group: int | None
    offset: int
    nbytes: int
    crc32: str


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------------------- writing


def layout(specs: list[TensorSpec]) -> list[dict]:
    """Directory entries with offsets for tensors placed in order, each on a 256-byte boundary."""
    entries, offset, seen = [], 0, set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)
        nbytes = tensor_nbytes(spec.encoding, spec.shape, spec.group)
        entry = {"name": spec.name, "encoding": spec.encoding, "shape": [int(s) for s in spec.shape],
                 "offset": offset, "nbytes": nbytes, "crc32": CRC_PLACEHOLDER}
        if spec.encoding in QUANTIZED:
            entry["group"] = int(spec.group)
        entries.append(entry)
        offset = round_up(offset + nbytes, TENSOR_ALIGN)
    return entries


def pack_header(metadata: dict) -> tuple[bytes, int]:
    """Preamble + metadata bytes, and the page-aligned data offset."""
    blob = msgpack.packb(metadata, use_bin_type=True)
    if len(blob) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(blob)} bytes, more than the {MAX_METADATA_BYTES} allowed")
    data_offset = round_up(PREAMBLE.size + len(blob), DATA_ALIGN)
    major, minor = FORMAT_VERSION
    return PREAMBLE.pack(MAGIC, major, minor, 0, len(blob), data_offset) + blob, data_offset


class TinfWriter:
    """Write a .tinf atomically: `with TinfWriter(path, meta, specs) as w: w.write(name, tensor)`.

    Tensors must be written in spec order. The file appears at `path` only when the block exits
    cleanly; on any exception the temporary file is removed.
    """

    def __init__(self, path, metadata: dict, specs: list[TensorSpec]):
        self.path = Path(path)
        self.specs = list(specs)
        self.metadata = dict(metadata)
        self.metadata.setdefault("autotune", {})
        self.metadata["tensors"] = layout(self.specs)
        self.header, self.data_offset = pack_header(self.metadata)
        self.next_index = 0
        self.file = None
        self.tmp_path = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.path)
        fd, tmp = locked_temporary(self.path)
        self.tmp_path = Path(tmp)
        self.file = os.fdopen(fd, "w+b")
        self.file.write(self.header)
        return self

    def write(self, name: str, tensor: Tensor) -> None:
        entry = self.metadata["tensors"][self.next_index]
        if entry["name"] != name:
            raise ValueError(f"expected tensor {entry['name']!r} next, got {name!r}")
        check_matches_spec(entry, tensor)
        self.file.seek(self.data_offset + entry["offset"])
        crc, written = 0, 0
        for rel, array in tensor.parts():
            gap = b"\0" * (rel - written)          # zero padding before the scale section
            raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            self.file.write(gap)
            self.file.write(raw.data)
            crc = zlib.crc32(raw.data, zlib.crc32(gap, crc))
            written = rel + raw.size
        if written != entry["nbytes"]:
            raise ValueError(f"tensor {name!r} produced {written} bytes, expected {entry['nbytes']}")
        entry["crc32"] = f"{crc:08x}"
        self.next_index += 1

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                if self.next_index != len(self.specs):
                    missing = self.specs[self.next_index].name
                    raise ValueError(f"tensor {missing!r} was never written")
                self.finish()
        finally:
            if self.file is not None and not self.file.closed:
                self.file.close()
            if self.tmp_path is not None and self.tmp_path.exists():
                self.tmp_path.unlink()
        return False

    def finish(self) -> None:
        header, data_offset = pack_header(self.metadata)  # same length: CRCs are fixed-width strings
        assert data_offset == self.data_offset and len(header) == len(self.header)
        end = self.data_offset + (self.metadata["tensors"][-1]["offset"] + self.metadata["tensors"][-1]["nbytes"]
                                  if self.specs else 0)
        self.file.truncate(end)
        self.file.seek(0)
        self.file.write(header)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.chmod(self.tmp_path, 0o666 & ~current_umask())  # mkstemp makes it 0600; give it normal permissions
        os.replace(self.tmp_path, self.path)


def locked_temporary(path: Path) -> tuple[int, str]:
    """mkstemp beside `path`, locked for as long as the descriptor is open: a writer that is killed
    loses its lock with its process, which is how the next run tells its file is stale."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".tmp-", dir=path.parent)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd, tmp


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files that killed writes of `path` left behind (those no process holds locked)."""
    if fcntl is None:
        return
    for name in glob.glob(glob.escape(str(path)) + ".tmp-*"):
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(name)
        except OSError:   # locked by a live writer, or already gone
            pass
        finally:
            os.close(fd)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_matches_spec(entry: dict, tensor: Tensor) -> None:
    group = entry.get("group")
    if (tensor.encoding, tuple(tensor.shape), tensor.group) != (entry["encoding"], tuple(entry["shape"]), group):
        raise ValueError(f"tensor {entry['name']!r} is {tensor.encoding}{list(tensor.shape)} group {tensor.group}, "
                         f"but its spec says {entry['encoding']}{entry['shape']} group {group}")


# ----------------------------------------------------------------------------------------- reading


def open_tinf(path) -> "TinfFile":
    return TinfFile(path)


def is_tinf_file(path) -> bool:
    """Whether the file starts with the .tinf magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


class TinfFile:
    """A validated, memory-mapped .tinf file."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FormatError(f"{self.path}: no such file; check the path.")
        self.file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            preamble = f.read(PREAMBLE.size)
            self.version, meta_len, self.data_offset = self.read_preamble(preamble)
            blob = f.read(meta_len)
        if len(blob) != meta_len:
            self.fail("the metadata block is truncated; the file is incomplete, download or convert it again.")
        self.metadata = self.unpack_metadata(blob)
        self.config = self.metadata["config"]
        self.infos = self.read_directory(self.metadata["tensors"])
        self.names = list(self.infos)
        self.memmap = (np.memmap(self.path, dtype=np.uint8, mode="r") if self.file_size
                       else np.zeros(0, dtype=np.uint8))

    def fail(self, problem: str):
        raise FormatError(f"{self.path}: {problem}")

    def read_preamble(self, preamble: bytes):
        if len(preamble) < PREAMBLE.size:
            self.fail("the file is too short to be a .tinf file; it is truncated or not a tinyinfer model.")
        magic, major, minor, flags, meta_len, data_offset = PREAMBLE.unpack(preamble)
        if magic != MAGIC:
            self.fail("this is not a .tinf file (bad magic bytes); convert the model with tinyconvert first.")
        if major > FORMAT_VERSION[0]:
            self.fail(f"format version {major}.{minor} is newer than this tinyinfer supports "
                      f"({FORMAT_VERSION[0]}.x); upgrade tinyinfer (pip install -U tinyinfer).")
        if major < 1 or flags != 0:
            self.fail(f"unsupported format version {major}.{minor} or flags {flags:#x}; convert the model again.")
        if meta_len > MAX_METADATA_BYTES:
            self.fail(f"the metadata length {meta_len} exceeds the {MAX_METADATA_BYTES}-byte limit; the file is corrupt.")
        if data_offset % DATA_ALIGN or data_offset < PREAMBLE.size + meta_len or data_offset > self.file_size:
            self.fail(f"the data offset {data_offset} is invalid; the file is corrupt or truncated.")
        return (major, minor), meta_len, data_offset

    def unpack_metadata(self, blob: bytes) -> dict:
        limit = len(blob)
        try:
            meta = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_array_len=min(limit, 1 << 20),
                                   max_map_len=min(limit, 1 << 20))
        except Exception as e:  # msgpack raises several types for malformed input
            self.fail(f"the metadata cannot be decoded ({type(e).__name__}); the file is corrupt.")
        if not isinstance(meta, dict):
            self.fail("the metadata is not a map; the file is corrupt.")
        for key, kind in REQUIRED_KEYS.items():
            if not isinstance(meta.get(key), kind):
                self.fail(f"metadata key {key!r} is missing or has the wrong type; the file is corrupt.")
        for key, kind in OPTIONAL_KEYS.items():
            if key in meta and not isinstance(meta[key], kind):
                self.fail(f"metadata key {key!r} has the wrong type; the file is corrupt.")
        return meta

    def read_directory(self, entries: list) -> dict[str, TensorInfo]:
        if len(entries) > MAX_TENSORS:
            self.fail(f"the tensor directory lists {len(entries)} tensors, more than {MAX_TENSORS}; the file is corrupt.")
        infos, ranges = {}, []
        data_size = self.file_size - self.data_offset
        for i, entry in enumerate(entries):
            info = self.check_entry(i, entry, data_size)
            if info.name in infos:
                self.fail(f"tensor {info.name!r} appears twice in the directory; the file is corrupt.")
            infos[info.name] = info
            ranges.append((info.offset, info.offset + info.nbytes, info.name))
        ranges.sort()
        for (_, end, name), (start, _, other) in zip(ranges, ranges[1:]):
            if start < end:
                self.fail(f"tensors {name!r} and {other!r} overlap; the file is corrupt.")
        return infos

    def check_entry(self, i: int, entry, data_size: int) -> TensorInfo:
        if not isinstance(entry, dict):
            self.fail(f"tensor directory entry {i} is not a map; the file is corrupt.")
        name = entry.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            self.fail(f"tensor directory entry {i} has no name (or one over 256 characters); the file is corrupt.")
        where = f"tensor {shown(name)}"
        encoding = entry.get("encoding")
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            self.fail(f"{where} has unknown encoding {shown(encoding)}; upgrade tinyinfer or convert the model again.")
        shape = entry.get("shape")
        if (not isinstance(shape, list) or len(shape) not in (1, 2)
                or not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s < MAX_DIM for s in shape)):
            self.fail(f"{where} has an invalid shape {shown(shape)}; the file is corrupt.")
        group = entry.get("group")
        if encoding in QUANTIZED and (type(group) is not int or group not in GROUP_SIZES):
            self.fail(f"{where} has invalid group size {shown(group)}; the file is corrupt.")
        if encoding not in QUANTIZED:
            group = None
        offset, nbytes, crc = entry.get("offset"), entry.get("nbytes"), entry.get("crc32")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, nbytes)):
            self.fail(f"{where} has an invalid offset or length; the file is corrupt.")
        if offset % TENSOR_ALIGN:
            self.fail(f"{where} is not aligned to {TENSOR_ALIGN} bytes; the file is corrupt.")
        expected = tensor_nbytes(encoding, shape, group)
        if nbytes != expected:
            self.fail(f"{where} claims {shown(nbytes)} bytes but {encoding}{shape} needs {expected}; "
                      "the file is corrupt.")
        if offset + nbytes > data_size:
            self.fail(f"{where} extends past the end of the file; the file is truncated, download or convert it again.")
        if not isinstance(crc, str) or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            self.fail(f"{where} has an invalid checksum field; the file is corrupt.")
        return TensorInfo(name, encoding, tuple(shape), group, offset, nbytes, crc)

    # --------------------------------------------------------------------------- tensor access

    def info(self, name: str) -> TensorInfo:
        if name not in self.infos:
            self.fail(f"tensor {name!r} is missing; convert the model again.")
        return self.infos[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapping."""
        info = self.info(name)
        start = self.data_offset + info.offset
        return self.memmap[start : start + info.nbytes]

    def tensor(self, name: str) -> Tensor:
        """A zero-copy Tensor over the mapping."""
        info = self.info(name)
        raw = self.raw(name)
        rows, cols = rows_cols(info.shape)
        cols_pad = padded_cols(info.encoding, cols, info.group)
        if info.encoding not in QUANTIZED:
            data = raw.view(STORAGE_DTYPE[info.encoding]).reshape(rows, cols_pad)
            return Tensor(info.encoding, info.shape, data)
        value_cols = cols_pad // 2 if info.encoding == "q4" else cols_pad
        data = raw[: rows * value_cols].view(STORAGE_DTYPE[info.encoding]).reshape(rows, value_cols)
        start = scale_offset(info.encoding, info.shape, info.group)
        scales = raw[start:].view(np.float16).reshape(rows, cols_pad // info.group)
        return Tensor(info.encoding, info.shape, data, scales, info.group)

    def check(self, name: str) -> bool:
        """True when the tensor's bytes match the CRC-32 recorded at write time."""
        raw = self.raw(name)
        crc = 0
        for start in range(0, len(raw), 64 << 20):
            crc = zlib.crc32(raw[start : start + (64 << 20)], crc)
        return f"{crc:08x}" == self.info(name).crc32

    def close(self) -> None:
        self.memmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ----------------------------------------------------------------------------------------- rewriting


def rewrite_metadata(source, out, updates: dict) -> Path:
    """Write a copy of `source` to `out` with top-level metadata keys replaced by `updates`.

    Tensor bytes are copied unchanged (their directory entries, checksums included, are kept; only the
    data offset moves). The copy goes to a temporary file beside `out` and is renamed over it only when
    complete, so `out` may be `source` itself and an interrupted rewrite never damages either file.
    """
    if "tensors" in updates:
        raise ValueError("rewrite_metadata cannot change the tensor directory")
    with open_tinf(source) as src:
        metadata = {**src.metadata, **updates}
        header, data_offset = pack_header(metadata)
        data_size = src.file_size - src.data_offset
        out = Path(out)
        remove_stale_temporaries(out)
        fd, tmp = locked_temporary(out)
        try:
            with os.fdopen(fd, "wb") as dst, open(src.path, "rb") as data:
                dst.write(header + b"\0" * (data_offset - len(header)))
                data.seek(src.data_offset)
                for _ in range(0, data_size, 64 << 20):
                    dst.write(data.read(64 << 20))
                dst.flush()
                os.fsync(dst.fileno())
            os.chmod(tmp, os.stat(src.path).st_mode & 0o777)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out
