"""Downloading a checkpoint from the Hugging Face Hub: only the files the conversion reads.

Small files come first so the config and tokenizer are validated before any weights are fetched;
then exactly the shards the index names (or model.safetensors), pinned to the same commit.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.convert.hf import INDEX_FILE, SINGLE_FILE, index_weight_map

METADATA_FILES = ["config.json", "generation_config.json", INDEX_FILE, "tokenizer.json",
                  "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "chat_template.json", "README.md"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
COMMIT = re.compile(r"[0-9a-f]{40}")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.fullmatch(source)) and ".." not in source


def download_metadata(repo_id: str, revision: str | None, token: str | None, progress: bool) -> Path:
    """Fetch config, index, tokenizer, chat template and model card; returns the snapshot folder."""
    return snapshot(repo_id, METADATA_FILES, revision, token, progress)


def download_weights(repo_id: str, folder: Path, revision: str | None, token: str | None,
                     progress: bool) -> Path:
    """Fetch the safetensors files into the same snapshot (same commit) as the metadata."""
    if (folder / INDEX_FILE).is_file():
        files = sorted(set(index_weight_map(folder).values()))
    else:
        files = [SINGLE_FILE]
    return snapshot(repo_id, files, commit_of(folder) or revision, token, progress)


def commit_of(folder: Path) -> str | None:
    """The commit hash of a Hub cache snapshot folder."""
    return folder.name if COMMIT.fullmatch(folder.name) else None


def snapshot(repo_id, patterns, revision, token, progress) -> Path:
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision, progress):
        return Path(snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns))


def download_file(repo_id: str, filename: str, revision: str | None, token: str | None, progress: bool) -> Path:
    """One .gguf file of a Hub repo, with huggingface_hub's progress bar; returns its cached path."""
    from huggingface_hub import errors, hf_hub_download

    if not filename.endswith(".gguf") or ".." in Path(filename).parts or filename.startswith("/"):
        raise ConvertError(f"--file {filename!r} is not the name of a .gguf file inside the repo; pass a "
                           f"name such as model-Q4_0.gguf.")
    with hub_errors(repo_id, revision, progress):
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision, token=token))
        except errors.RemoteEntryNotFoundError as e:
            raise ConvertError(f"{repo_id} has no file {filename}; check the name against the repo's file "
                               f"list on the Hub.") from e


@contextmanager
def hub_errors(repo_id: str, revision: str | None, progress: bool):
    """huggingface_hub's exceptions as one-sentence ConvertErrors; progress bars off unless wanted."""
    from huggingface_hub import errors
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        yield
    except errors.GatedRepoError as e:
        raise ConvertError(f"{repo_id} is gated; accept its terms on huggingface.co and pass "
                           f"--token (or run `hf auth login`).") from e
    except errors.RepositoryNotFoundError as e:
        raise ConvertError(f"{repo_id} was not found on the Hub or is private; check the repo id "
                           f"or pass --token.") from e
    except errors.RevisionNotFoundError as e:
        raise ConvertError(f"revision {revision!r} does not exist in {repo_id}; pass an existing "
                           f"branch, tag or commit with --revision.") from e
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        raise ConvertError(f"cannot download {repo_id} (offline, or the Hub is unreachable); check "
                           f"the network or convert a local folder instead.") from e
    except errors.HfHubHTTPError as e:
        raise ConvertError(f"downloading {repo_id} failed ({brief(e)}); check the repo id, "
                           f"--revision and --token.") from e
    finally:
        if not progress and not was_disabled:
            enable_progress_bars()
