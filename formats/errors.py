"""Exceptions a user can hit. Each message is one sentence that names the fix."""


class TinyInferError(Exception):
    """An error caused by the user's input or environment; CLIs print it without a traceback."""


class FormatError(TinyInferError):
    """A .tinf file is malformed, truncated, corrupt or from a newer tinyinfer."""


MAX_SHOWN = 80   # characters of a file's value quoted in an error message


def shown(value, limit: int = MAX_SHOWN) -> str:
    """A short repr of an untrusted value for an error message: bounded in length, never recursing
    more than a few levels (a value nested thousands deep, or an int of thousands of digits, is
    summarized rather than formatted)."""
    text = _short_repr(value, depth=3, budget=limit + 1)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_repr(value, depth: int, budget: int) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 128 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes)):
        return repr(value[:budget])
    if isinstance(value, (list, tuple, dict)):
        if depth == 0:
            return f"<{type(value).__name__} of {len(value)}>"
        items = value.items() if isinstance(value, dict) else value
        parts, used = [], 0
        for item in items:
            if used > budget:
                parts.append("...")
                break
            part = (f"{_short_repr(item[0], depth - 1, budget)}: {_short_repr(item[1], depth - 1, budget)}"
                    if isinstance(value, dict) else _short_repr(item, depth - 1, budget))
            parts.append(part)
            used += len(part) + 2
        brackets = "{}" if isinstance(value, dict) else "()" if isinstance(value, tuple) else "[]"
        return brackets[0] + ", ".join(parts) + brackets[1]
    return f"<{type(value).__name__}>"


def clipped(text: str, limit: int = 200) -> str:
    """A problem description built from untrusted names, printable and at most `limit` characters."""
    text = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."
