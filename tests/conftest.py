"""Shared fixtures: the ../shared test assets (skip when absent) and a CUDA device (skip without one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout; TINYINFER_SHARED overrides it (the GPU machine carries a copy inside the repo).
SHARED = Path(os.environ.get("TINYINFER_SHARED", REPO.parent / "shared"))
# Hand-run GPU measurements (tests/perf/README.md), not tests.
collect_ignore = ["perf"]


@pytest.fixture(scope="session")
def shared_assets() -> Path:
    assets = SHARED / "assets"
    if not assets.is_dir():
        pytest.skip(f"test assets not found at {assets}")
    return assets


def cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


@pytest.fixture(scope="session")
def cupy_gpu():
    if not cuda_available():
        pytest.skip("needs an NVIDIA GPU and CuPy")
    import cupy

    if os.environ.get("TINYINFER_CUPY_POOL") == "0":
        # Every array its own cudaMalloc, so compute-sanitizer memcheck sees an access past one: a
        # memory pool would hand out neighbouring blocks of one allocation instead.
        cupy.cuda.set_allocator(None)
    return cupy


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="run the long adversarial suite (100,000 fuzz mutants; also TINYINFER_FUZZ_CASES=N)")


@pytest.fixture(scope="session")
def long_run(request) -> bool:
    return bool(request.config.getoption("--long"))


def pytest_collection_modifyitems(config, items):
    """Skip every @pytest.mark.gpu test when no GPU is present, even if it forgot the fixture."""
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
