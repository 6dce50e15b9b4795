"""Exceptions a user can hit. Each message is one sentence that names the fix."""


class TinyInferError(Exception):
    """An error caused by the user's input or environment; CLIs print it without a traceback."""


class FormatError(TinyInferError):
    """A .tinf file is malformed, truncated, corrupt or from a newer tinyinfer."""
