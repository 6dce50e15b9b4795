"""GGUF files as untrusted input: a bounded structural check, then the gguf package's reader.

The gguf package's GGUFReader trusts the lengths a file declares: an array length of 2**63 makes
it loop, a string length beyond the file makes it read short, a tensor's dimensions can overflow
its element count. So before the reader sees a file, `check_layout` walks the header, every
metadata value and the tensor directory once, checking each declared length, count, type, offset
and alignment against the file's size; only then is the file handed to GGUFReader, whose own
failures are wrapped too. Values are then read through `Metadata`, which checks their types.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.formats.errors import clipped

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                  # ggml tensors have at most 4 dimensions
MAX_NAME = 64                 # ggml's GGML_MAX_NAME, terminator included
MAX_KEY = 65535
MAX_ARRAY_DEPTH = 2           # an array of arrays at most; llama and qwen2 files use none
MAX_ELEMENTS = 1 << 48        # far beyond any real tensor, far below int64 overflow
# The reader builds Python objects per array item, tensor and key: bound them far above real files
# (vocabularies of 262K tokens, ~500K merges, a few thousand tensors) and far below what exhausts memory.
MAX_ARRAY_ITEMS = 1 << 21
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
# GGUF value type -> size in bytes of a scalar; 8 is a string, 9 an array.
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
FLOAT_TYPES = {6, 12}
BOOL_TYPE = 7
UINT32 = 4
# The smallest possible encodings, to bound counts by the bytes left before walking them.
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


class BadFile(Exception):
    """Raised inside the walk; turned into one ConvertError naming the file."""


def refuse(path: Path, problem: str) -> ConvertError:
    return ConvertError(f"{path} is not a GGUF file this converter can read because {clipped(problem)}; "
                        f"re-download it or convert the original checkpoint.")


class LayoutWalker:
    """Reads the header fields in order from a memory map, never past its end."""

    def __init__(self, data, size: int):
        self.data, self.size, self.pos = data, size, 0

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.size - self.pos:
            raise BadFile(f"{what} at byte {self.pos} declares {n} bytes, beyond the end of the file")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str):
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, start)

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        length = self.u64(f"the length of {what}")
        if limit is not None and length > limit:
            raise BadFile(f"{what} at byte {self.pos - 8} is {length} bytes long, more than {limit}")
        start = self.take(length, what)
        return bytes(self.data[start : start + length])

    def count(self, n: int, min_bytes: int, what: str, limit: int = MAX_ARRAY_ITEMS) -> int:
        """A declared count of items each at least min_bytes long must fit in what is left."""
        if n > (self.size - self.pos) // min_bytes:
            raise BadFile(f"it declares {n} {what}, more than the {self.size} bytes of the file can hold")
        if n > limit:
            raise BadFile(f"it declares {n} {what}, more than the {limit} any real model has")
        return n


def check_value(walker: LayoutWalker, value_type: int, key: str, depth: int = 0) -> int | None:
    """Skip one metadata value of `value_type`; returns the value of a uint32 (for general.alignment)."""
    if value_type in SCALAR_SIZES:
        start = walker.take(SCALAR_SIZES[value_type], f"the value of {key}")
        return struct.unpack_from("<I", walker.data, start)[0] if value_type == UINT32 else None
    if value_type == STRING:
        walker.take(walker.u64(f"the length of {key}"), f"the value of {key}")
        return None
    if value_type != ARRAY:
        raise BadFile(f"metadata key {key} has the unknown value type {value_type}")
    if depth >= MAX_ARRAY_DEPTH:
        raise BadFile(f"metadata key {key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
    item_type = walker.u32(f"the item type of {key}")
    length = walker.u64(f"the length of {key}")
    if item_type in SCALAR_SIZES:
        walker.take(walker.count(length, SCALAR_SIZES[item_type], f"items in {key}") * SCALAR_SIZES[item_type],
                    f"the items of {key}")
    elif item_type in (STRING, ARRAY):
        for _ in range(walker.count(length, 8 if item_type == STRING else 12, f"items in {key}")):
            check_value(walker, item_type, key, depth + 1)
    else:
        raise BadFile(f"metadata key {key} is an array of the unknown value type {item_type}")
    return None


def check_key(walker: LayoutWalker) -> tuple[str, int | None, int]:
    raw = walker.string("a metadata key", MAX_KEY)
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadFile(f"metadata key {raw[:40]!r} is not UTF-8") from None
    value_type = walker.u32(f"the type of {key}")
    return key, check_value(walker, value_type, key), value_type


def check_tensor_info(walker: LayoutWalker, quant_sizes) -> tuple[str, int, int]:
    """One tensor directory entry; returns (name, offset, byte size)."""
    raw = walker.string("a tensor name", MAX_NAME - 1)
    name = raw.decode("utf-8", errors="replace")
    n_dims = walker.u32(f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise BadFile(f"tensor {name} has {n_dims} dimensions (ggml tensors have 1 to {MAX_DIMS})")
    dims = walker.unpack(f"<{n_dims}Q", f"the dimensions of {name}")
    if min(dims) < 1 or math.prod(dims) > MAX_ELEMENTS:
        raise BadFile(f"tensor {name} has dimensions {list(dims)}, whose product is zero or overflows")
    type_id = walker.u32(f"the type of {name}")
    if type_id not in quant_sizes:
        raise BadFile(f"tensor {name} has the unknown ggml type {type_id}")
    block, block_bytes = quant_sizes[type_id]
    if dims[0] % block:
        raise BadFile(f"tensor {name} has rows of {dims[0]} values, not a multiple of its type's block of {block}")
    offset = walker.u64(f"the offset of {name}")
    return name, offset, math.prod(dims) // block * block_bytes


def check_layout(path: Path) -> None:
    """Walk the whole header of a GGUF file with every length bounded by the file size."""
    from gguf.constants import GGML_QUANT_SIZES

    quant_sizes = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise refuse(path, "it is shorter than a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                walk_layout(LayoutWalker(data, size), quant_sizes)
    except BadFile as e:
        raise refuse(path, str(e)) from None
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}; check the path and permissions.") from e


def walk_layout(walker: LayoutWalker, quant_sizes) -> None:
    if bytes(walker.data[:4]) != MAGIC:
        raise BadFile("it does not start with the GGUF magic")
    walker.take(4, "the magic")
    version = walker.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise BadFile("it is a big-endian GGUF file (only little-endian files are read)")
    if version not in VERSIONS:
        raise BadFile(f"it is GGUF version {version} (versions 2 and 3 are read)")
    n_tensors, n_kv = walker.u64("the tensor count"), walker.u64("the metadata count")
    walker.count(n_kv, MIN_KV_BYTES, "metadata entries", MAX_KEYS)
    walker.count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensors", MAX_TENSORS)
    alignment, keys = DEFAULT_ALIGNMENT, set()
    for _ in range(n_kv):
        key, uint_value, value_type = check_key(walker)
        if key in keys:
            raise BadFile(f"metadata key {key} appears twice")
        keys.add(key)
        if key == "general.alignment":
            if value_type != UINT32 or not uint_value or uint_value & (uint_value - 1):
                raise BadFile("general.alignment is not a power of two stored as uint32")
            alignment = uint_value
    tensors, names = [], set()
    for _ in range(n_tensors):
        name, offset, nbytes = check_tensor_info(walker, quant_sizes)
        if name in names:
            raise BadFile(f"tensor {name} appears twice")
        names.add(name)
        tensors.append((name, offset, nbytes))
    data_start = -(-walker.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        if offset % alignment:
            raise BadFile(f"tensor {name} starts at offset {offset}, not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > walker.size:
            raise BadFile(f"tensor {name} ({nbytes} bytes at offset {offset}) runs past the end of the file")


def read_gguf(path: Path):
    """A GGUFReader over a file that passed check_layout; any failure of the reader is one ConvertError."""
    check_layout(path)
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ConvertError("reading GGUF files needs the gguf package; install it with `pip install gguf`.") from e
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, UnicodeDecodeError...
        raise refuse(path, f"the gguf reader failed ({brief(e)})") from e


class Metadata:
    """Typed access to a GGUF file's key/value metadata; a value of an unexpected type is refused."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def types(self, key: str) -> list[int]:
        return [int(t) for t in self.fields[key].types]

    def wrong_type(self, key: str, expected: str) -> ConvertError:
        return refuse(self.path, f"its metadata key {key} is not {expected}")

    def scalar(self, key: str, allowed: set[int], expected: str, default):
        if key not in self.fields:
            return default
        types = self.types(key)
        if len(types) != 1 or types[0] not in allowed:
            raise self.wrong_type(key, expected)
        return self.fields[key].contents()

    def int(self, key: str, default=None, low: int = 0, high: int = 2**31 - 1):
        value = self.scalar(key, INTEGER_TYPES, "an integer", default)
        if value is not default and not low <= value <= high:
            raise refuse(self.path, f"its metadata key {key} is {value}, outside [{low}, {high}]")
        return value if value is default else int(value)

    def float(self, key: str, default=None):
        value = self.scalar(key, FLOAT_TYPES, "a floating-point number", default)
        if value is not default and not math.isfinite(value):
            raise refuse(self.path, f"its metadata key {key} is {value}, not a finite number")
        return value if value is default else float(value)

    def bool(self, key: str, default=None):
        value = self.scalar(key, {BOOL_TYPE}, "a boolean", default)
        return value if value is default else bool(value)

    def str(self, key: str, default=None):
        try:
            return self.scalar(key, {STRING}, "a string", default)
        except UnicodeDecodeError:
            raise self.wrong_type(key, "UTF-8 text") from None

    def array(self, key: str, item_types: set[int], expected: str) -> list | None:
        """An array whose items all have one of item_types (a string array decodes as UTF-8)."""
        if key not in self.fields:
            return None
        types = self.types(key)
        if len(types) == 1 and types[0] == ARRAY:
            return []                   # an empty array records no item type
        if len(types) != 2 or types[0] != ARRAY or types[1] not in item_types:
            raise self.wrong_type(key, f"an array of {expected}")
        try:
            return self.fields[key].contents()
        except UnicodeDecodeError:
            raise self.wrong_type(key, "an array of UTF-8 strings") from None
