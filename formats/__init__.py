"""The .tinf single-file model format: reader, writer and tensor encodings (spec: formats/README.md)."""

from .errors import FormatError, TinyInferError
from .quant import ENCODINGS, Tensor, encode, max_abs_error_bound, tensor_nbytes
from .tinf import FORMAT_VERSION, TensorInfo, TensorSpec, TinfFile, TinfWriter, open_tinf, rewrite_metadata

__all__ = [
    "ENCODINGS", "FORMAT_VERSION", "FormatError", "Tensor", "TensorInfo", "TensorSpec", "TinfFile",
    "TinfWriter", "TinyInferError", "encode", "max_abs_error_bound", "open_tinf", "rewrite_metadata",
    "tensor_nbytes",
]
