"""MODEL arguments: a local .tinf path, or a .tinf file on the Hugging Face Hub fetched into its cache.

Accepted references (first match wins):
  ./any/path.tinf, /abs/path, ~/x.tinf, or any path that exists   -> that local file
  hf://ORG/REPO[/DIR/FILE.tinf][@REVISION]                        -> the Hub, explicitly
  ORG/REPO/DIR/FILE.tinf                                         -> that file in that Hub repo
  ORG/REPO                                                        -> the repo's only .tinf file

Downloads go through huggingface_hub (its cache, progress bar, resume, token and HF_HUB_OFFLINE
handling). The cache is only read, never written by us: callers get a path into it.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tinyinfer.runtime.errors import LoadError

HF_PREFIX = "hf://"
REPO_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REPO_ID = re.compile(rf"{REPO_PART}/{REPO_PART}")
FILE_IN_REPO = re.compile(rf"({REPO_PART}/{REPO_PART})/((?:[^/@]+/)*[^/@]+\.tinf)")
COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(LoadError):
    """A model reference on the Hub cannot be resolved to a local file."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    filename: str | None = None   # path of the .tinf inside the repo; None = "the repo's only .tinf"
    revision: str | None = None   # branch, tag or commit; None = main
    explicit: bool = False        # written as hf://..., so it cannot have meant a local path

    def __str__(self) -> str:
        name = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return name + (f"@{self.revision}" if self.revision else "")


def parse_ref(ref: str) -> Path | HubRef:
    """A local path, or a HubRef for a Hub reference; raises HubError for a malformed hf:// reference."""
    if ref.startswith(HF_PREFIX):
        return parse_hub(ref[len(HF_PREFIX):], ref)
    path = Path(ref).expanduser()
    if path.exists() or ref.startswith(("/", ".", "~")) or "\\" in ref:
        return path
    if REPO_ID.fullmatch(ref) and valid_repo_id(ref) and not ref.endswith(".tinf"):
        return HubRef(ref)
    match = FILE_IN_REPO.fullmatch(ref)
    if match and valid_repo_id(match.group(1)):
        return HubRef(match.group(1), match.group(2))
    return path


def parse_hub(body: str, ref: str) -> HubRef:
    body, _, revision = body.partition("@")
    if REPO_ID.fullmatch(body) and valid_repo_id(body):
        repo_id, filename = body, None
    else:
        match = FILE_IN_REPO.fullmatch(body)
        if not match or not valid_repo_id(match.group(1)):
            raise HubError(f"{ref} is not a valid Hub reference; write hf://ORG/REPO/FILE.tinf[@REVISION].")
        repo_id, filename = match.group(1), match.group(2)
    if "@" in ref[len(HF_PREFIX):] and not revision:
        raise HubError(f"{ref} has an empty revision after @; name a branch, tag or commit, or drop the @.")
    return HubRef(repo_id, filename, revision or None, explicit=True)


def valid_repo_id(repo_id: str) -> bool:
    """The Hub's rules beyond the character set: no '--' or '..', no part ending in '.' or '-'."""
    return "--" not in repo_id and ".." not in repo_id and not any(p.endswith((".", "-")) for p in repo_id.split("/"))


def resolve_model(ref: str, token: str | None = None) -> Path:
    """The local .tinf file for a MODEL argument, downloading it into the Hugging Face cache if needed."""
    parsed = parse_ref(ref)
    if isinstance(parsed, Path):
        return parsed
    return download(parsed, token)


def download(ref: HubRef, token: str | None = None) -> Path:
    """Fetch ref's .tinf into the Hub cache (or find it there when offline); returns its cached path."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    from tinyinfer.runtime.integrity import verify_download

    online_files = hub_listing(ref, token)
    filename = ref.filename or only_tinf(ref, cached_files(ref) if online_files is None else online_files)
    with hub_errors(ref, filename):
        before = try_to_load_from_cache(ref.repo_id, filename, revision=ref.revision)
        path = Path(hf_hub_download(ref.repo_id, filename, revision=ref.revision, token=token,
                                    local_files_only=online_files is None))
    if not isinstance(before, str) or Path(before).resolve() != path.resolve():
        verify_download(path)   # fetched just now: its checksums are read once, here
    return path


def only_tinf(ref: HubRef, files: list[str]) -> str:
    """The single .tinf file among the repo's files; a clear error for none or several."""
    names = sorted(name for name in files if name.endswith(".tinf"))
    if not names:
        raise HubError(f"{ref} holds no .tinf file; convert the model with tinyconvert --push-to-hub, "
                       f"or run a .tinf file from another repo.")
    if len(names) > 1:
        listing = ", ".join(names)
        raise HubError(f"{ref} holds several .tinf files ({listing}); pick one, for example "
                       f"tinyrun {ref.repo_id}/{names[0]}.")
    return names[0]


def hub_listing(ref: HubRef, token: str | None) -> list[str] | None:
    """The repo's files at ref.revision from the Hub, in one request; None when offline or when the Hub
    cannot be reached. Asking first spares a user without network huggingface_hub's retries of a failed
    connection (~24 s) in hf_hub_download and list_repo_files."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import httpx

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        with hub_errors(ref, None):
            info = HfApi().model_info(ref.repo_id, revision=ref.revision, token=token,
                                      timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except httpx.TransportError:
        return None
    return [sibling.rfilename for sibling in info.siblings or ()]


def cached_files(ref: HubRef) -> list[str]:
    """Files of the cached snapshot for ref.revision (the cache layout: refs/<branch> names the commit)."""
    from huggingface_hub import constants

    repo_folder = Path(constants.HF_HUB_CACHE) / ("models--" + ref.repo_id.replace("/", "--"))
    revision = ref.revision or "main"
    commit = revision if COMMIT.fullmatch(revision) else read_ref(repo_folder / "refs" / revision)
    snapshot = repo_folder / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise HubError(offline_message(ref))
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def read_ref(path: Path) -> str | None:
    try:
        commit = path.read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.fullmatch(commit) else None


def offline_message(ref: HubRef) -> str:
    return (f"{ref} is not in the Hugging Face cache and the Hub cannot be reached (no network, or "
            f"HF_HUB_OFFLINE=1); connect once to download it, or pass a local .tinf path.")


@contextmanager
def hub_errors(ref: HubRef, filename: str | None):
    """Turn huggingface_hub's exceptions into one-sentence HubErrors; anything else propagates."""
    try:
        yield
    except Exception as exc:
        message = hub_error_message(exc, ref, filename)
        if message is None:
            raise
        raise HubError(message) from exc


def hub_error_message(exc: BaseException, ref: HubRef, filename: str | None) -> str | None:
    """One sentence for a huggingface_hub error, or None to let it propagate. Subclasses come first."""
    from huggingface_hub import constants, errors

    repo = ref.repo_id
    if isinstance(exc, errors.GatedRepoError):
        return (f"{repo} is gated; accept its terms at {constants.ENDPOINT}/{repo} and pass --token "
                f"(or run `hf auth login`).")
    if isinstance(exc, errors.RepositoryNotFoundError):
        if not ref.explicit:
            return (f"there is no local file {ref} and {repo} was not found on the Hugging Face Hub (or "
                    f"it is private); check the path or the repo name, or pass --token.")
        return (f"{repo} was not found on the Hugging Face Hub, or it is private; check the name "
                f"or pass --token.")
    if isinstance(exc, errors.RevisionNotFoundError):
        return (f"revision {ref.revision!r} does not exist in {repo}; name an existing branch, tag "
                f"or commit after @.")
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        return offline_message(ref)
    if isinstance(exc, errors.EntryNotFoundError):
        return (f"{repo} has no file {filename}; check its files at "
                f"{constants.ENDPOINT}/{repo}/tree/{ref.revision or 'main'}.")
    if isinstance(exc, errors.HfHubHTTPError):
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"the Hub refused to serve {ref} ({first_line}); check the name, the revision and --token."
    return None
