"""`tinyrun list`, `tinyrun pull` and `tinyrun rm`: the .tinf files on this machine, as Ollama's ls/pull/rm.

Pulled models live in the Hugging Face cache (huggingface_hub's cache-management API reads and
prunes it); local files live wherever the user keeps them, for example in the folders named by
--dir or TINYINFER_MODELS. There is no `tinyrun ps`: no model stays loaded between commands.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import click

from tinyinfer.runtime.errors import LoadError
from tinyinfer.runtime.hub import HubError, HubRef, download, parse_ref

MODELS_ENV = "TINYINFER_MODELS"


@dataclass(frozen=True)
class Entry:
    name: str          # what to pass to tinyrun
    path: Path
    size: int
    modified: float


# ------------------------------------------------------------------------------------------ finding

def hub_cache():
    """huggingface_hub's scan of its cache, or None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:
        return None


def cached_entries(cache) -> list[Entry]:
    """Every cached .tinf file; revisions other than main's are named with @COMMIT."""
    entries = []
    for repo in (cache.repos if cache else ()):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            suffix = "" if "main" in revision.refs else f"@{revision.commit_hash}"
            for f in revision.files:
                if f.file_name.endswith(".tinf"):
                    inner = f.file_path.relative_to(revision.snapshot_path).as_posix()
                    name = f"{repo.repo_id}/{inner}{suffix}"
                    entries.append(Entry(("hf://" if suffix else "") + name, f.file_path, f.size_on_disk,
                                         f.blob_last_modified))
    return entries


def model_folders(folders) -> list[Path]:
    """--dir folders, then those of TINYINFER_MODELS (separated like PATH)."""
    from_env = [p for p in os.environ.get(MODELS_ENV, "").split(os.pathsep) if p]
    return [Path(p).expanduser() for p in [*folders, *from_env]]


def local_entries(folders: list[Path]) -> list[Entry]:
    entries = []
    for folder in folders:
        for path in sorted(folder.rglob("*.tinf")) if folder.is_dir() else ():
            if path.is_file():
                stat = path.stat()
                entries.append(Entry(str(path), path, stat.st_size, stat.st_mtime))
    return entries


def quant_of(path: Path) -> str:
    """The encoding of the file's linear layers, as recorded at conversion ('?' for an unreadable file)."""
    from tinyinfer.formats import TinyInferError, open_tinf

    try:
        with open_tinf(path) as f:
            quant = (f.metadata.get("provenance") or {}).get("quant")
            if quant is None and "layers.0.wqkv" in f.names:
                quant = f.info("layers.0.wqkv").encoding
            return str(quant or "?")
    except (TinyInferError, OSError):
        return "?"


def format_size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------ list

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--dir", "folders", multiple=True, type=click.Path(file_okay=False),
              help=f"Also list the .tinf files under this folder (repeatable; ${MODELS_ENV} names more, "
                   f"separated by '{os.pathsep}').")
def list_command(folders):
    """List the .tinf models in the Hugging Face cache (tinyrun pull) and in your models folders."""
    from huggingface_hub import constants

    folders = model_folders(folders)
    entries = cached_entries(hub_cache()) + local_entries(folders)
    if not entries:
        where = ", ".join([constants.HF_HUB_CACHE, *map(str, folders)])
        click.echo(f"No .tinf models in {where}; pull one with `tinyrun pull ORG/REPO`, convert one with "
                   f"tinyconvert, or name a folder with --dir or {MODELS_ENV}.", err=True)
        return
    width = max(len("NAME"), *(len(e.name) for e in entries))
    click.echo(f"{'NAME':<{width}}  {'SIZE':>10}  {'QUANT':<5}  MODIFIED")
    for e in entries:
        modified = datetime.fromtimestamp(e.modified).strftime("%Y-%m-%d %H:%M")
        click.echo(f"{e.name:<{width}}  {format_size(e.size):>10}  {quant_of(e.path):<5}  {modified}")


# ------------------------------------------------------------------------------------------ pull

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("ref", metavar="ORG/REPO[/FILE.tinf]")
@click.option("--token", help="Hugging Face token, for a private or gated repo.")
def pull_command(ref, token):
    """Download a .tinf model from the Hugging Face Hub into its cache (hf://ORG/REPO/FILE.tinf@REV too)."""
    from tinyinfer.formats import open_tinf

    parsed = hub_reference(ref)
    path = download(parsed, token)
    with open_tinf(path):          # a file that is not a valid .tinf fails here, not at the first run
        pass
    click.echo(f"pulled {ref} ({format_size(path.stat().st_size)}) to {path}")
    click.echo(f"run it with: tinyrun {ref}")


def hub_reference(ref: str) -> HubRef:
    parsed = parse_ref(ref)
    if isinstance(parsed, Path):
        raise HubError(f"{ref} is not a Hub reference; write ORG/REPO or ORG/REPO/FILE.tinf "
                       f"(or hf://ORG/REPO when a local path of that name exists).")
    return parsed


# ------------------------------------------------------------------------------------------ rm

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--yes", "-y", is_flag=True, help="Remove without asking.")
def rm_command(model, yes):
    """Remove a pulled model from the Hugging Face cache (ORG/REPO: every cached revision; ORG/REPO/FILE.tinf:
    that file), or a local .tinf file."""
    parsed = parse_ref(model)
    if isinstance(parsed, Path):
        return remove_local(parsed, yes)
    cache = hub_cache()
    targets = cached_files(cache, parsed)
    if not targets:
        if any(repo.repo_id == parsed.repo_id for repo in (cache.repos if cache else ())):
            raise HubError(f"the cached {parsed.repo_id} holds no .tinf file {parsed.filename or ''}".rstrip()
                           + "; tinyrun rm removes only .tinf models (huggingface_hub's `hf cache` removes others).")
        raise HubError(f"{parsed} is not in the Hugging Face cache; `tinyrun list` shows what is.")
    names = sorted({f.file_path.relative_to(rev.snapshot_path).as_posix() + f" @{rev.commit_hash[:8]}"
                    for rev, f in targets})
    if parsed.filename is None or not hasattr(cache, "delete_files"):
        strategy = cache.delete_revisions(*{rev.commit_hash for rev, _ in targets})   # whole revisions
    else:
        strategy = cache.delete_files(*[f for _, f in targets])
    what = (f"{parsed.repo_id} from the Hugging Face cache ({', '.join(names)}; "
            f"frees {strategy.expected_freed_size_str})")
    if confirm(f"Remove {what}?", yes):
        strategy.execute()
        click.echo(f"removed {what}")


def cached_files(cache, ref: HubRef) -> list:
    """(revision, file) pairs of the cache that ref names: the .tinf files of the repo (every revision,
    or ref.revision's), or just ref.filename. Without a filename every file of those revisions goes."""
    pairs = []
    for repo in (cache.repos if cache else ()):
        if repo.repo_type != "model" or repo.repo_id != ref.repo_id:
            continue
        for rev in repo.revisions:
            if ref.revision and ref.revision != rev.commit_hash and ref.revision not in rev.refs:
                continue
            for f in rev.files:
                inner = f.file_path.relative_to(rev.snapshot_path).as_posix()
                if inner == ref.filename or (ref.filename is None and inner.endswith(".tinf")):
                    pairs.append((rev, f))
    return pairs


def remove_local(path: Path, yes: bool) -> None:
    from huggingface_hub import constants

    from tinyinfer.formats.tinf import is_tinf_file

    if not path.is_file():
        raise LoadError(f"No file at {path}; `tinyrun list` shows the models on this machine.")
    if Path(constants.HF_HUB_CACHE).resolve() in path.absolute().parents:
        raise HubError(f"{path} is inside the Hugging Face cache; remove it with tinyrun rm ORG/REPO/FILE.tinf.")
    if not is_tinf_file(path):
        raise LoadError(f"{path} is not a .tinf file, so tinyrun rm leaves it alone; delete it yourself if you "
                        f"mean to.")
    if confirm(f"Remove {path} ({format_size(path.stat().st_size)})?", yes):
        path.unlink()
        click.echo(f"removed {path}")


def confirm(question: str, yes: bool) -> bool:
    """True to go ahead: --yes, or a yes typed on the terminal; without a terminal, --yes is required."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise LoadError(f"{question.removesuffix('?')} needs confirmation; pass --yes when no terminal can ask.")
    if click.confirm(question, default=False, err=True):
        return True
    click.echo("nothing removed", err=True)
    return False
