"""The converter's user-facing error."""

from tinyinfer.formats.errors import TinyInferError


class ConvertError(TinyInferError):
    """A checkpoint cannot be converted; the message is one sentence naming what to change."""


def brief(error: Exception) -> str:
    """The first line of a library's error message, to quote inside our one-sentence errors."""
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else type(error).__name__
