"""Autotune choices shipped inside a .tinf file (its `autotune` metadata section).

The section maps a key naming the GPU, its compute capability and the kernel source hash, e.g.
"NVIDIA H200|sm_90|3f2a9c0d1e4b5a6c", to an entry:
    {"choices": <the autotuner's choices, opaque here>, "tuned_by": "tinyinfer X.Y.Z",
     "created": ISO 8601 UTC, "bench": {...} (optional benchmark numbers, shown in the model card)}
An entry is used only when all three key parts match this machine: another GPU's entry is foreign,
and an entry for other kernel sources is stale (its choices may name kernels that no longer exist).

Storing rewrites the metadata into a new file beside the target and renames it over the target
(formats.rewrite_metadata): tensor bytes and checksums are copied unchanged, a crash leaves the old
file intact, and a process that has the old file memory-mapped keeps reading the old inode. The
Hugging Face cache is never written: its files are shared, content-addressed blobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tinyinfer.formats import TinyInferError, open_tinf, rewrite_metadata
from tinyinfer.formats.version import tinyinfer_version

MAX_ENTRIES = 64             # keeps a shared file's metadata small however many GPUs tuned it
SEP = "|"


class TuneFileError(TinyInferError):
    """The autotune section cannot be written where asked."""


@dataclass(frozen=True)
class FileLookup:
    """What the file holds for this machine's key: the choices, or why there are none."""

    status: str                  # "match", "stale" (same GPU, other kernels), "foreign" or "empty"
    choices: dict | None = None
    others: tuple = ()           # keys of the entries that were not used

    def describe(self, key: str) -> str:
        """One line for --verbose."""
        if self.status == "match":
            return f"autotune: using the choices stored in the file for {key} (no timing needed)"
        if self.status == "stale":
            return (f"autotune: the file's entry for this GPU was tuned for other kernel sources "
                    f"({', '.join(self.others)}); ignoring it")
        if self.status == "foreign":
            return f"autotune: the file holds entries for other GPUs only ({', '.join(self.others)}); ignoring them"
        return "autotune: the file carries no autotune entries"


def file_key(gpu_name: str, compute_capability, kernel_hash: str) -> str:
    """The key of one GPU + kernel build: name, "sm_" + compute capability (e.g. "90"), source hash."""
    parts = [str(gpu_name).strip(), f"sm_{compute_capability}", str(kernel_hash)]
    if any(not p or SEP in p for p in parts):
        raise ValueError(f"autotune key parts must be non-empty and free of {SEP!r}: {parts}")
    return SEP.join(parts)


def split_key(key: str) -> tuple[str, str, str] | None:
    parts = key.rsplit(SEP, 2)
    return tuple(parts) if len(parts) == 3 else None


def lookup(tinf_file, key: str) -> FileLookup:
    """Classify the open file's autotune section against `key` (see the module docstring)."""
    section = tinf_file.metadata.get("autotune") or {}
    entry = section.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("choices"), dict):
        return FileLookup("match", entry["choices"], tuple(sorted(k for k in section if k != key)))
    others = tuple(sorted(k for k in section if k != key))
    if not others:
        return FileLookup("empty")
    mine = split_key(key)
    same_gpu = mine is not None and any((split_key(k) or ())[:2] == mine[:2] for k in others)
    return FileLookup("stale" if same_gpu else "foreign", None, others)


def load_file_entry(tinf_file, key: str) -> dict | None:
    """The stored choices for exactly this key, or None."""
    return lookup(tinf_file, key).choices


def store_file_entry(path, key: str, choices: dict, out=None, bench: dict | None = None) -> Path:
    """Write `choices` (and optional benchmark numbers) under `key` into a copy of `path` at `out`
    (default: `path` itself, replaced atomically); entries for other keys are kept."""
    path = Path(path)
    out = Path(out) if out is not None else path
    refuse_hub_cache(out)
    if out.is_symlink():
        out = out.resolve()   # replace the file the link points to, not the link
    entry = {"choices": dict(choices), "tuned_by": tinyinfer_version(),
             "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if bench:
        entry["bench"] = dict(bench)
    with open_tinf(path) as f:
        section = dict(f.metadata.get("autotune") or {})
    section.pop(key, None)
    while len(section) >= MAX_ENTRIES:   # drop the oldest entries first (dicts keep insertion order)
        section.pop(next(iter(section)))
    section[key] = entry
    rewrite_metadata(path, out, {"autotune": section})   # keeps the source's permissions
    with open_tinf(out) as written:   # the reader validates the new header before we report success
        if load_file_entry(written, key) != entry["choices"]:
            raise TuneFileError(f"{out}: the autotune entry did not survive the rewrite; report this as a bug.")
    return out


def gemv_configs(choices, candidates: dict, mlp_candidates=()) -> dict | None:
    """The CUDA backend's GemvConfig for every role, from stored choices, and "mlp" -> MlpConfig
    where the choices fuse the MLP; None unless each role of `candidates` (role -> the configurations
    the autotuner itself tries for it) is present with one of them, and a fused MLP names one of
    mlp_candidates (a file is untrusted input)."""
    from tinyinfer.kernels import gemv, mlp

    if not isinstance(choices, dict):
        return None
    configs = {}
    if choices.get("mlp") is not None:
        choice = choices["mlp"]
        fields = [choice.get("warps"), choice.get("depth"), choice.get("row_tiles", 1)] if isinstance(choice, dict) else [None]
        if any(type(value) is not int for value in fields) or mlp.MlpConfig(*fields) not in mlp_candidates:
            return None
        configs["mlp"] = mlp.MlpConfig(*fields)
    for role, allowed in candidates.items():
        choice = choices.get(role)
        if not isinstance(choice, dict):
            return None
        fields = [choice.get("row_tiles"), choice.get("warps"), choice.get("split", 1), choice.get("depth", 0)]
        # Plain ints only: a bool compares equal to 1 and a list does not hash.
        if any(type(value) is not int for value in fields):
            return None
        flags = [choice.get("balanced", False), choice.get("refill", False), choice.get("staggered", False)]
        if any(type(flag) is not bool for flag in flags):
            return None
        config = gemv.GemvConfig(*fields, *flags)
        if config not in allowed:
            return None
        configs[role] = config
    return configs


def shipped_gemv_configs(tinf_file, key: str, candidates: dict, mlp_candidates=()) -> tuple[dict | None, str]:
    """(GemvConfigs from the file's entry for `key`, or None to tune as usual; the line for --verbose).
    candidates: role -> the configurations the tuner tries for it; mlp_candidates: the fused MLP's."""
    found = lookup(tinf_file, key)
    configs = gemv_configs(found.choices, candidates, mlp_candidates) if found.status == "match" else None
    if found.status == "match" and configs is None:
        return None, f"autotune: the file's entry for {key} is incomplete or names unknown configurations; ignoring it"
    return configs, found.describe(key)


def backend_key(backend) -> str:
    """The file key of a CudaBackend: its GPU, its compute capability and the kernel sources it built."""
    from tinyinfer.kernels import build

    return file_key(backend.gpu_name, backend.compute_capability, build.source_hash())


def tune_file(path, out=None, bench_tokens: int = 0, verbose: bool = False) -> tuple[str, Path]:
    """Tune the model at `path` on this machine's GPU and store the choices in the file (or in a copy
    at `out`); with bench_tokens > 0 a short decode benchmark is stored too. Returns (key, file)."""
    from tinyinfer.runtime.model import load

    refuse_hub_cache(Path(out if out is not None else path))   # before spending time on tuning
    require_cuda()
    with load(path, device="cuda", verbose=verbose) as model:
        key = backend_key(model.backend)
        choices = {role: config.as_dict() for role, config in model.backend.tuning.items()}
        bench = benchmark(model, bench_tokens) if bench_tokens > 0 else None
    return key, store_file_entry(path, key, choices, out=out, bench=bench)


def require_cuda() -> None:
    """Fail early, with the fix, when this machine cannot run the CUDA backend."""
    from tinyinfer.runtime.errors import DeviceError
    from tinyinfer.runtime.model import cuda_backend_class

    backend_class, _ = cuda_backend_class()
    if backend_class is None:
        raise DeviceError("autotuning needs an NVIDIA GPU and CuPy (tinyinfer[cuda12] or [cuda13]), which this "
                          "machine lacks; run `tinyrun tune FILE.tinf` on a GPU machine instead.")


def benchmark(model, n_tokens: int) -> dict:
    """The headline numbers of runtime.bench.run_bench, small enough to ship in every file."""
    from tinyinfer.runtime.bench import run_bench

    result = run_bench(model, n_tokens, prompt_len=16, reps=3)
    keep = ("tok_s", "graph_tok_s", "achieved_gbs", "pct_of_read_bandwidth", "n_tokens", "prompt_len", "date")
    return {k: result[k] for k in keep if k in result}


def refuse_hub_cache(out: Path) -> None:
    """Files under the Hugging Face cache are shared blobs that must never change."""
    from huggingface_hub import constants

    cache = Path(constants.HF_HUB_CACHE).expanduser().resolve()
    target = out.expanduser().absolute()
    for candidate in (target, target.resolve()):
        if candidate == cache or cache in candidate.parents:
            raise TuneFileError(f"{out} is inside the Hugging Face cache, which must not be modified; "
                                f"write a tuned copy instead (tinyrun tune MODEL -o model.tinf).")
