"""The installed tinyinfer version, as recorded in files it writes (provenance, autotune entries)."""

import importlib.metadata


def tinyinfer_version() -> str:
    """"tinyinfer X.Y.Z", or a marker when running from a source tree that was never installed."""
    try:
        return f"tinyinfer {importlib.metadata.version('tinyinfer')}"
    except importlib.metadata.PackageNotFoundError:
        return "tinyinfer (unknown version)"
