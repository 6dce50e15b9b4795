"""JSON from a checkpoint's files, parsed with the failures an untrusted file can cause made one sentence."""

from __future__ import annotations

import json

from tinyinfer.convert.errors import ConvertError, brief


def parse_json(text: str, where) -> object:
    """json.loads, where nesting thousands deep (RecursionError) and integers of thousands of digits
    (ValueError past Python's digit limit) end in a ConvertError like any syntax error."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConvertError(f"{where} is nested too deeply to be a checkpoint file; fix or re-download it.") from None
    except ValueError as e:   # json.JSONDecodeError, and int() past sys.get_int_max_str_digits()
        raise ConvertError(f"cannot parse {where} as JSON ({brief(e)}); fix or re-download that file.") from None
