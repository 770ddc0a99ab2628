"""Reading JSON that is still being generated: where a value ends (or that it has not ended yet), and a tool call
object `{"name": ..., "arguments": {...}}` read as far as it goes, so that its arguments can be streamed as raw
text while they grow. The arguments text so far is always a prefix of the finished arguments text. And the same
call read whole (`whole_call`): valid JSON, or not a call."""

from __future__ import annotations

import json
from dataclasses import dataclass

SPACE = " \t\r\n"


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in SPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that starts at `text[i]`, or None where the text ends before it does. Not a
    validator: it follows strings and brackets only (what it returns for malformed JSON is for json.loads to
    refuse)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                if j is None:
                    return None
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: it ends where a delimiter comes
    while j < len(text) and text[j] not in SPACE + ",}]":
        j += 1
    return j if j < len(text) else None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _string(quoted: str) -> str | None:
    """A whole JSON string's value; None where it is not valid JSON (a raw newline, a bad escape)."""
    try:
        return json.loads(quoted)
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class CallRead:
    """A call object read from its `{`: what is known so far. `end` is None until the object closes;
    `invalid` when it cannot be a call object."""

    name: str | None = None  # once the name's string is complete
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None
    invalid: bool = False

    def arguments(self, text: str) -> str:
        """The arguments' raw text so far ("" before they start)."""
        if self.args_start is None:
            return ""
        return text[self.args_start:self.args_end if self.args_end is not None else len(text)]


def read_call(text: str, i: int, args_keys: tuple[str, ...]) -> CallRead:
    """The call object starting at `text[i]` (`{"name": "f", "<args key>": {...}}`, keys in any order)."""
    if i >= len(text):
        return CallRead()
    if text[i] != "{":
        return CallRead(invalid=True)
    got: dict = {}
    i += 1
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return CallRead(**got)
        if text[i] == "}":
            return CallRead(**got, end=i + 1)
        if text[i] != '"':
            return CallRead(**got, invalid=True)
        key_end = _string_end(text, i)
        if key_end is None:
            return CallRead(**got)
        key = _string(text[i:key_end])
        if key is None or (key == "name" and "name" in got):  # a call names its function once
            return CallRead(**got, invalid=True)
        i = skip_space(text, key_end)
        if i >= len(text):
            return CallRead(**got)
        if text[i] != ":":
            return CallRead(**got, invalid=True)
        i = skip_space(text, i + 1)
        if key in args_keys and "args_start" not in got and i < len(text):
            got["args_start"] = i
        end = value_end(text, i)
        if end is None:
            return CallRead(**got)
        if key == "name":
            name = _string(text[i:end]) if text[i] == '"' else None
            if name is None:
                return CallRead(**got, invalid=True)
            got["name"] = name
        elif key in args_keys and got.get("args_start") == i:
            got["args_end"] = end
        i = skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] != "}":
            return CallRead(**got, invalid=True)


def whole_object(text: str, i: int) -> int | None:
    """The index after the JSON object that starts at `text[i]`, where one does (valid JSON); None otherwise."""
    end = value_end(text, i) if text.startswith("{", i) else None
    try:
        return end if end is not None and isinstance(json.loads(text[i:end]), dict) else None
    except json.JSONDecodeError:
        return None


def whole_call(text: str, i: int, names, args_keys: tuple[str, ...]) -> tuple[str, str, int] | None:
    """The call object at `text[i]` read whole: (name, its arguments' text, the index after it) where it is a valid
    JSON object that names one of `names` and whose arguments are an object (none given: {}); None otherwise."""
    read = read_call(text, i, args_keys)
    if read.end is None or read.name not in names or whole_object(text, i) != read.end:
        return None
    if read.args_start is None:
        return read.name, "{}", read.end
    return (read.name, read.arguments(text), read.end) if whole_object(text, read.args_start) else None
