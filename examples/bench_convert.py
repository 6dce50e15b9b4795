"""Time tinyconvert on a TinyLlama-shaped checkpoint and report its peak memory.

    python examples/bench_convert.py                       # q4 (calibrated), TinyLlama's shapes
    python examples/bench_convert.py --quant q4 --no-calibrate --keep /tmp/tl-checkpoint

Writes a random bf16 Hugging Face checkpoint with the real configuration (and TinyLlama's real
tokenizer when ../shared/assets is present, else a synthetic one), then runs `tinyconvert` on it in a
child process, so the peak resident memory measured is the converter's alone. Random weights cost
the converter exactly what trained ones do: the work depends only on shapes and encodings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_random import SHAPES, write_random_checkpoint

ASSETS = Path(os.environ.get("TINYINFER_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "assets"


def write_checkpoint(folder: Path, shape: str) -> None:
    real = ASSETS / "tinyllama-1.1b-chat-v1.0"
    use_real = real.is_dir() and SHAPES[shape]["vocab_size"] == 32000
    write_random_checkpoint(folder, SHAPES[shape], real if use_real else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--quant", choices=("q4", "q8", "f16"), default="q4")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--keep", help="write (or reuse) the checkpoint in this folder")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp) / "checkpoint"
        if not (folder / "model.safetensors").is_file():
            started = time.perf_counter()
            write_checkpoint(folder, args.shape)
            print(f"wrote the checkpoint in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        out = Path(tmp) / "model.tinf"
        command = [sys.executable, "-m", "tinyinfer.convert.cli", str(folder), "-o", str(out), "--quant", args.quant]
        if args.no_calibrate:
            command.append("--no-calibrate")
        started = time.perf_counter()
        subprocess.run(command, check=True)
        seconds = time.perf_counter() - started
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {"shape": args.shape, "quant": args.quant, "calibrated": not args.no_calibrate,
              "seconds": round(seconds, 1), "peak_rss_mib": round(peak_mib), "cpus": os.cpu_count()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
