"""The installed console scripts (tinyrun, tinyconvert), run as a user runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def script(name: str) -> str:
    """The path of an installed console script: beside this Python (a venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"the {name} console script is not installed (pip install -e .)")
    return found


def run(name: str, *args, env: dict | None = None, input: str | None = None, timeout: float = 120,
        cwd=None) -> subprocess.CompletedProcess:
    """Run a console script to completion, in `env` (the whole environment; default: this process's);
    returns the CompletedProcess (text, stdout and stderr captured)."""
    return subprocess.run([script(name), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, input=input, cwd=cwd)
