"""Publish a .tinf file on the Hugging Face Hub: create the repo if needed, then one commit holding
the file and its generated model card (README.md).

Everything goes through huggingface_hub's HfApi, so HF_ENDPOINT, HF_TOKEN / `hf auth login`, its
progress bars and its upload protocols (Xet, or Git LFS when Xet is unavailable) behave as usual.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

from tinyinfer.convert.errors import ConvertError
from tinyinfer.convert.model_card import file_sha256, model_card
from tinyinfer.formats import open_tinf

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class PushError(ConvertError):
    """Publishing to the Hub failed; the message names what to change."""


def push_to_hub(tinf_path, repo_id: str, private: bool = False, token: str | None = None,
                progress: bool = True) -> str:
    """Upload `tinf_path` and its model card to `repo_id` in one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    tinf_path = Path(tinf_path)
    check_repo_id(repo_id)
    if tinf_path.suffix != ".tinf":
        raise PushError(f"{tinf_path} does not end in .tinf, so `tinyrun {repo_id}` would not find it; "
                        f"rename it to {tinf_path.stem}.tinf first.")
    with open_tinf(tinf_path):   # refuse to publish a file the reader would reject
        pass
    card = model_card(tinf_path, repo_id, sha256=file_sha256(tinf_path, progress=progress))
    api = HfApi(token=token)
    operations = [CommitOperationAdd(path_in_repo=tinf_path.name, path_or_fileobj=str(tinf_path)),
                  CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8"))]
    with push_errors(repo_id):
        # private=None leaves an existing repo (or the organisation's default) as it is.
        api.create_repo(repo_id, private=True if private else None, exist_ok=True)
        commit = api.create_commit(repo_id, operations, commit_message=f"Upload {tinf_path.name} with tinyinfer")
    return commit.commit_url


def check_push_options(repo_id: str | None, private: bool) -> None:
    """tinyconvert's --push-to-hub / --private, checked before any conversion work."""
    if private and not repo_id:
        raise PushError("--private only applies when publishing; add --push-to-hub ORG/REPO or drop --private.")
    if repo_id:
        check_repo_id(repo_id)


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        raise PushError(f"{repo_id!r} is not a Hub repo id; pass the destination as ORG/REPO "
                        f"(your user name or an organisation, a slash, then the repo name).")


@contextmanager
def push_errors(repo_id: str):
    """One sentence for each way the Hub can refuse a push; other exceptions propagate."""
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import httpx

    try:
        yield
    except errors.OfflineModeIsEnabled as e:
        raise PushError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it to push.") from e
    except errors.RepositoryNotFoundError as e:
        raise PushError(f"cannot write to {repo_id}: it does not exist or your token cannot see it; check "
                        f"the name and pass a token with write access (--token or `hf auth login`).") from e
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise PushError(f"the Hub refused to let you write to {repo_id} (HTTP {status}); pass a token "
                            f"with write access (--token or `hf auth login`).") from e
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PushError(f"uploading to {repo_id} failed ({first_line}); check the repo id and try again.") from e
    except errors.LocalTokenNotFoundError as e:
        raise PushError("no Hugging Face token found; pass --token or run `hf auth login`.") from e
    except httpx.TransportError as e:
        raise PushError(f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}); check the "
                        f"network (or HF_ENDPOINT) and try again.") from e
