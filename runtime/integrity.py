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
