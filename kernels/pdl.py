"""Programmatic dependent launch (PDL, Hopper and newer) through the driver's cuLaunchKernelEx.

A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start while the
kernel before it in the stream is still running: its blocks can issue their weight loads, then
block in `pdl_wait()` (common.cuh: `griddepcontrol.wait`) until the previous kernel has finished
and its writes are visible. In the decode graph that hides each kernel's launch gap and first DRAM
round trip behind the previous kernel's tail. Stream capture records the programmatic edges in the
graph. Every kernel launched this way must call pdl_wait() before it reads or writes activations.

CuPy's kernel call cannot set launch attributes, hence ctypes: the structures below mirror cuda.h
(CUlaunchConfig, CUlaunchAttribute) and have not changed since CUDA 12.0. The same path launches
kernels in thread-block clusters (the split-K GEMV), whose size is a launch attribute too.
"""

from __future__ import annotations

import ctypes

import numpy as np

CLUSTER_DIMENSION = 4                   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MIN_COMPUTE_CAPABILITY = 90


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int), ("dims", ctypes.c_uint * 3)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_driver = None


def _cu_launch_kernel_ex():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        _driver.cuLaunchKernelEx.restype = ctypes.c_int
    return _driver.cuLaunchKernelEx


_C_TYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _c_value(arg):
    """The C value of one kernel argument as a Launch holds it (device array or NumPy scalar)."""
    if hasattr(arg, "data") and hasattr(arg.data, "ptr"):
        return ctypes.c_void_p(arg.data.ptr)
    if isinstance(arg, np.generic) and arg.dtype in _C_TYPES:
        return _C_TYPES[arg.dtype](arg.item())
    raise TypeError(f"cannot pass {type(arg).__name__} to cuLaunchKernelEx")


class DriverLaunch:
    """The arguments of one launch marshalled once for cuLaunchKernelEx, with PDL enabled (early)
    and/or in clusters of launch.cluster blocks along x."""

    def __init__(self, launch, early: bool):
        self.values = [_c_value(a) for a in launch.args]
        self.pointers = (ctypes.c_void_p * len(self.values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in self.values])
        dims = lambda d: (ctypes.c_uint * 3)(*(tuple(d) + (1, 1))[:3])    # (x,) -> (x, 1, 1)
        attributes = []
        if early:
            attributes.append(_Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION))
            attributes[-1].value.value = 1
        if launch.cluster > 1:
            attributes.append(_Attribute(id=CLUSTER_DIMENSION))
            attributes[-1].value.dims = dims((launch.cluster,))
        self.attributes = (_Attribute * max(len(attributes), 1))(*attributes)
        self.function = launch.kernel.kernel.ptr        # RawKernel -> its cupy.cuda.Function
        self.config = _LaunchConfig(dims(launch.grid), dims(launch.block), launch.shared_mem, None,
                                    ctypes.cast(self.attributes, ctypes.POINTER(_Attribute)), len(attributes))

    def __call__(self, stream) -> None:
        self.config.stream = stream.ptr if stream is not None else None
        status = _cu_launch_kernel_ex()(ctypes.byref(self.config), self.function, self.pointers, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {status}")
