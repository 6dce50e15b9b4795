"""Load the CUDA sources shipped in this package and compile them with NVRTC through CuPy.

Sources are read with importlib.resources (works from a wheel and from an editable install). The
`#include "common.cuh"` lines are inlined here so NVRTC needs no include path. Every kernel is
compiled for the device's own architecture (CuPy's default, sm_75 and newer); Hopper gets the
sm_90a target. CuPy caches the binaries on disk, keyed by source, options and architecture.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from importlib import resources

SOURCES = ("common.cuh", "gemv.cu", "mlp.cu", "attention.cu", "sampling.cu", "misc.cu", "prefill.cu", "batch.cu")
INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)
MIN_COMPUTE_CAPABILITY = 75
COMPILED_S = 0.2       # a module that took longer to get was compiled, not found in the cache


def source_text(name: str) -> str:
    return resources.files("tinyinfer.kernels").joinpath(name).read_text()


def expanded_source(name: str) -> str:
    """The file with its local includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(match):
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        text = source_text(header).replace("#pragma once", "")
        return INCLUDE.sub(expand, text)

    return INCLUDE.sub(expand, source_text(name))


@lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of every kernel source: part of the autotune cache key."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + source_text(name).encode())
    return digest.hexdigest()[:16]


def compile_options(compute_capability: int) -> tuple:
    options = ("--std=c++17",)
    if compute_capability == 90:
        options += ("-arch=sm_90a",)   # Hopper's own target (checked on an H200 with CuPy 14.2)
    if os.environ.get("TINYINFER_TIMELINE") == "1":
        options += ("-DTI_TIMELINE",)  # per-block timestamps for tests/perf/timeline.py (common.cuh)
    return options


@lru_cache(maxsize=None)
def module(name: str, name_expressions: tuple = (), compute_capability: int = 0, defines: tuple = ()):
    """A cupy.RawModule for one source file; templates are instantiated through name_expressions;
    defines: extra -D options."""
    import cupy

    options = compile_options(compute_capability) + tuple(defines)
    if name_expressions:
        return cupy.RawModule(code=expanded_source(name), options=options,
                              name_expressions=list(name_expressions))
    return cupy.RawModule(code=expanded_source(name), options=options)


def compile_all(modules) -> None:
    """Compile and load RawModules, those missing from CuPy's disk cache on parallel threads.

    NVRTC releases the GIL, so a first-ever build of a model's GEMV instantiations is several times
    faster on parallel threads than in one module; but a pool costs more than loading cached modules
    in turn (kernels/README.md, "Building the kernels"). So modules load in turn until one takes long
    enough to be a compilation, and the rest go to the pool."""
    import cupy

    pending = list(modules)
    while pending:
        tick = time.perf_counter()
        pending.pop(0).compile()
        if time.perf_counter() - tick > COMPILED_S:
            break
    if not pending:
        return
    device = cupy.cuda.Device().id

    def compile_one(mod):
        with cupy.cuda.Device(device):       # a new thread starts on device 0
            mod.compile()

    with ThreadPoolExecutor(min(len(pending), os.cpu_count() or 1)) as pool:
        list(pool.map(compile_one, pending))


def device_compute_capability() -> int:
    import cupy

    return int(cupy.cuda.Device().compute_capability)


def allow_shared_memory(kernel, shared_bytes: int) -> None:
    """Raise a kernel's dynamic shared-memory limit to shared_bytes where that and its static shared
    memory are above the default 48 KiB a block; never lowers it (one kernel may serve launches of
    several sizes)."""
    if shared_bytes + kernel.shared_size_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_bytes:
        kernel.max_dynamic_shared_size_bytes = shared_bytes


class Launch:
    """One kernel launch with everything fixed: kernel, grid, block, shared memory and arguments.

    Built once, replayed many times (also inside CUDA graph capture). Scalars must already be
    NumPy scalars of the kernel's parameter type: CuPy passes Python ints as 64-bit and floats as
    double without checking the signature.
    """

    def __init__(self, name: str, kernel, grid, block, args, shared_mem: int = 0, bytes_read: int = 0,
                 waits: bool = False, cluster: int = 1):
        self.name = name
        self.waits = waits                 # the kernel calls pdl_wait() before touching activations
        self.cluster = int(cluster)        # blocks per thread-block cluster along x (Hopper)
        self._driver_launches = {}
        self.kernel = kernel
        self.grid = tuple(int(g) for g in grid)
        self.block = tuple(int(b) for b in block)
        self.args = tuple(args)
        self.shared_mem = int(shared_mem)
        self.bytes_read = int(bytes_read)   # HBM bytes the launch must read (for GB/s tables)
        allow_shared_memory(kernel, self.shared_mem)

    def __call__(self, stream=None, early: bool = False):
        """early: with programmatic dependent launch (kernels/pdl.py), if the kernel supports it.
        Such launches, and launches in clusters, go through the driver (CuPy sets no attributes)."""
        early = early and self.waits
        if early or self.cluster > 1:
            if early not in self._driver_launches:
                from tinyinfer.kernels.pdl import DriverLaunch

                self._driver_launches[early] = DriverLaunch(self, early)
            self._driver_launches[early](stream)
        else:
            self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem, stream=stream)

    def __repr__(self):
        cluster = f", cluster={self.cluster}" if self.cluster > 1 else ""
        return f"Launch({self.name}, grid={self.grid}, block={self.block}, smem={self.shared_mem}{cluster})"
