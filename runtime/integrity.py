"""`tinyrun info FILE --check`: verify every tensor's CRC-32 against the one recorded at write time.

Opening the file already validates its header and tensor directory; this reads every tensor byte,
so it catches bit rot, truncated copies padded with zeros, and edits made after conversion.
"""

from __future__ import annotations

from tinyinfer.formats import FormatError, open_tinf


class IntegrityError(FormatError):
    """One or more tensors do not match their recorded checksums."""


def corrupt_tensors(tinf_file, progress: bool = True) -> list[str]:
    """Names of the tensors whose bytes do not match their CRC-32, in file order."""
    from tqdm import tqdm

    total = sum(tinf_file.info(name).nbytes for name in tinf_file.names)
    corrupt = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="checking tensors",
              disable=None if progress else True) as bar:
        for name in tinf_file.names:
            if not tinf_file.check(name):
                corrupt.append(name)
            bar.update(tinf_file.info(name).nbytes)
    return corrupt


def check_file(path, progress: bool = True) -> int:
    """Verify every tensor of the file at `path`; returns how many were checked, raises IntegrityError
    naming the corrupt ones."""
    with open_tinf(path) as f:
        corrupt = corrupt_tensors(f, progress)
        if corrupt:
            shown = ", ".join(corrupt[:10]) + (f" and {len(corrupt) - 10} more" if len(corrupt) > 10 else "")
            noun = "tensor fails its" if len(corrupt) == 1 else f"{len(corrupt)} tensors fail their"
            raise IntegrityError(f"{f.path}: {noun} checksum ({shown}); the file is corrupt, download or "
                                 f"convert it again.")
        return len(f.names)


def verify_download(path, progress: bool = True) -> None:
    """Check a file just downloaded from the Hub, once, before its first use (the Hub checks sizes and
    its own hashes of what it stores, not what the file's tensors were written as). A corrupt download
    is removed from the cache, so the next attempt fetches it anew; a file that is no readable .tinf at
    all is left for the loader to report."""
    from pathlib import Path

    path = Path(path)
    try:
        check_file(path, progress)
    except IntegrityError as e:
        blob = path.resolve()
        for cached in {path, blob}:
            cached.unlink(missing_ok=True)
        raise IntegrityError(f"{str(e).split(';')[0]}; the download is corrupt and was removed from the cache, "
                             f"run the command again to download it anew.") from None
    except FormatError:
        pass
