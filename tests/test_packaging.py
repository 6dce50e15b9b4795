"""The built wheel (not just the editable install), installed with its dependencies into a fresh venv,
imports every module and ships the kernel sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

IMPORT_EVERYTHING = r"""
import importlib, pkgutil, sys
from importlib.resources import files
target = sys.argv[1]
names = []
for pkg in ["convert", "runtime", "kernels", "formats"]:
    mod = importlib.import_module("tinyinfer." + pkg)
    assert mod.__file__.startswith(target), (mod.__file__, target)
    names += ["tinyinfer.%s.%s" % (pkg, m.name) for m in pkgutil.iter_modules(mod.__path__)]
# Modules of an optional extra (pyproject.toml) import without it, or fail only for its packages.
extras = {"tinyinfer.runtime.server": {"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client"}}
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name.split(".")[0] not in extras.get(name, ()):
            raise
assert "cupy" not in sys.modules, "importing tinyinfer must not import cupy"
repo_sources = sys.argv[2].split(",") if sys.argv[2] else []
shipped = sorted(p.name for p in files("tinyinfer.kernels").iterdir() if p.name.endswith((".cu", ".cuh")))
assert shipped == sorted(repo_sources), (shipped, repo_sources)
for name in shipped:
    assert files("tinyinfer.kernels").joinpath(name).read_text()
assert files("tinyinfer.formats").joinpath("README.md").read_text().startswith("# The `.tinf` file format")
print("imported", len(names), "modules;", len(shipped), "kernel sources")
"""


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_imports_every_module(tmp_path):
    wheel_dir, venv = tmp_path / "wheel", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(REPO)],
                   check=True)
    (wheel,) = wheel_dir.glob("tinyinfer-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    sources = ",".join(p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh"))
    result = subprocess.run([str(python), "-c", IMPORT_EVERYTHING, site, sources],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    scripts = {line.split("=")[0].strip() for line in
               (next(Path(site).glob("tinyinfer-*.dist-info")) / "entry_points.txt").read_text().splitlines()
               if "=" in line}
    assert {"tinyconvert", "tinyrun"} <= scripts
    assert (venv / "bin" / "tinyrun").exists() and (venv / "bin" / "tinyconvert").exists()
