"""The torch-free safetensors reader: exact values for F32/F16/BF16, and the Rust crate's header checks."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from checkpoints import stored, write_safetensors  # noqa: E402

from tinyinfer.convert import ConvertError  # noqa: E402
from tinyinfer.convert.safetensors_io import SafetensorsFile  # noqa: E402
from tinyinfer.formats.quant import bf16_to_f32  # noqa: E402


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_round_trip_exact(tmp_path, dtype):
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32),
              "empty": np.zeros((0, 4), np.float32)}
    pairs = {name: stored(a, dtype) for name, a in arrays.items()}
    write_safetensors(tmp_path / "x.safetensors", {n: p[0] for n, p in pairs.items()}, dtype, {"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.names == ["a", "b", "empty"] and f.metadata == {"format": "pt"}
    for name, (_, values) in pairs.items():
        got = f.read(name)
        assert got.dtype == np.float32 and got.shape == values.shape
        np.testing.assert_array_equal(got, values)


def test_bf16_widening_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.random.default_rng(2).integers(0, 2**16, 200_000, dtype=np.uint32).astype(np.uint16)
    bits[:6] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7F7F]   # ±0, ±inf, a subnormal, the max
    ours = bf16_to_f32(bits)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))


def test_reads_files_from_the_official_writer(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    tensors = {"w.bf16": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
               "w.f16": rng.standard_normal((2, 3)).astype(np.float16),
               "w.f32": rng.standard_normal(5).astype(np.float32)}
    save_file(tensors, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    for name, array in tensors.items():
        np.testing.assert_array_equal(f.read(name), array.astype(np.float32))


def write_raw(path: Path, header, data: bytes = b"", header_len=None) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
    return path


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_FILES = {
    "header length beyond the file": (dict(header={}, header_len=10**6)),
    "header over 100 MB": (dict(header={}, header_len=100_000_001)),
    "not JSON": (dict(header=b"{not json")),
    "not an object": (dict(header=[1, 2])),
    "duplicate names": (dict(header=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                   b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', data=bytes(8))),
    "hole between tensors": (dict(header={"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, data=bytes(12))),
    "overlapping tensors": (dict(header={"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, data=bytes(8))),
    "size not matching shape": (dict(header={"a": entry("F32", [3], 0, 8)}, data=bytes(8))),
    "trailing bytes": (dict(header={"a": entry("F32", [1], 0, 4)}, data=bytes(8))),
    "truncated data": (dict(header={"a": entry("F32", [4], 0, 16)}, data=bytes(8))),
    "unknown dtype": (dict(header={"a": entry("F17", [1], 0, 4)}, data=bytes(4))),
    "negative shape": (dict(header={"a": entry("F32", [-1], 0, 4)}, data=bytes(4))),
    "extra entry key": (dict(header={"a": {**entry("F32", [1], 0, 4), "x": 1}}, data=bytes(4))),
    "non-string metadata": (dict(header={"__metadata__": {"k": 1}})),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_invalid_headers_are_refused(tmp_path, case):
    path = write_raw(tmp_path / "bad.safetensors", **BAD_FILES[case])
    with pytest.raises(ConvertError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert "not a valid safetensors file" in message and "\n" not in message and message.endswith(".")


def test_file_shorter_than_length_prefix(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ConvertError):
        SafetensorsFile(tmp_path / "short.safetensors")


def test_unconvertible_dtype_is_refused_on_read(tmp_path):
    path = write_raw(tmp_path / "i.safetensors", {"ids": entry("I32", [2], 0, 8)}, bytes(8))
    f = SafetensorsFile(path)          # a valid file ...
    with pytest.raises(ConvertError, match="only F32, F16 and BF16"):
        f.read("ids")                  # ... whose integer tensor we do not convert
