"""Calls read from free text: an `auto` answer that no grammar held to its format (the request brought its own
response_format / regex / ebnf). In the formats whose answer is its calls (llama3, mistral, deepseek_v3, pythonic)
the finished answer is calls only where it is exactly its format's calls, each a valid one (a function of the
request's, its arguments a JSON object); else all of it is content. Until it ends only the content before a call's
marker is sent, so no call is streamed that the finished answer does not have. (hermes reads each `<tool_call>`
block whole in its own scan: its blocks stand alone.)"""

from __future__ import annotations

import re

from fastspec.serve import pythonic
from fastspec.serve.json_scan import skip_space, whole_call, whole_object
from fastspec.serve.tool_calls import PartialCall, Scanned
from fastspec.serve.tool_formats import (DS_BEGIN, DS_CALL, DS_CALL_END, DS_END, DS_SEP, ARGS_KEYS, LLAMA3_KEYS,
                                         MISTRAL_ARGS, MISTRAL_CALLS, PYTHON_TAG)

DS_HEAD = re.compile(re.escape(DS_CALL) + "function" + re.escape(DS_SEP) + "([^\n]*)\n```json\\s*")
DS_TAIL = re.compile("\\s*```\\s*" + re.escape(DS_CALL_END) + "\\s*")


def scan(found: Scanned, text: str, tools, parser: str, final: bool) -> Scanned:
    """`found` (the format's scan of `text` as if held to it) as free text reads it."""
    read = READERS.get(parser)
    if read is None:
        return found
    if not final:
        return Scanned(found.content)  # before the first marker (or all of an answer that cannot open a call)
    return read(text, tools) or Scanned(text)


def _objects(text: str, i: int, tools, separator: str, args_keys: tuple[str, ...]):
    """Call objects read whole from `text[i]` on, `separator` between them: (calls, the index after the last and
    the spaces after it), or None where one is not a call."""
    calls = []
    while (got := whole_call(text, i, tools.schemas, args_keys)) is not None:
        calls.append(PartialCall(got[0], got[1], True))
        i = skip_space(text, got[2])
        if not text.startswith(separator, i):
            return tuple(calls), i
        i = skip_space(text, i + len(separator))
    return None


def _llama3(text: str, tools) -> Scanned | None:
    i = skip_space(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = skip_space(text, i + len(PYTHON_TAG))
    got = _objects(text, i, tools, ";", LLAMA3_KEYS)
    return Scanned("", got[0]) if got is not None and got[1] == len(text) else None


def _mistral(text: str, tools) -> Scanned | None:
    """`[TOOL_CALLS]`, then a list of call objects, the objects alone, or v11's `name[ARGS]{...}`s."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return None
    i = skip_space(text, at + len(MISTRAL_CALLS))
    if text.startswith("[", i):
        got = _objects(text, skip_space(text, i + 1), tools, ",", ARGS_KEYS)
        got = (got[0], skip_space(text, got[1] + 1)) if got is not None and text.startswith("]", got[1]) else None
    elif text.startswith("{", i):
        got = _objects(text, i, tools, ",", ARGS_KEYS)
    else:
        got = _named(text, at, tools)
    return Scanned(text[:at], got[0]) if got is not None and got[0] and got[1] == len(text) else None


def _named(text: str, at: int, tools):
    """v11's calls from `at`: (calls, the index after the last), or None where one is not a call."""
    calls = []
    while text.startswith(MISTRAL_CALLS, at):
        sep = text.find(MISTRAL_ARGS, at)
        name = text[at + len(MISTRAL_CALLS):sep].strip() if sep >= 0 else None
        start = skip_space(text, sep + len(MISTRAL_ARGS))
        end = whole_object(text, start) if name in tools.schemas else None
        if end is None:
            return None
        calls.append(PartialCall(name, text[start:end], True))
        at = skip_space(text, end)
    return tuple(calls), at


def _deepseek(text: str, tools) -> Scanned | None:
    """Calls as the grammar writes them (spaces around the JSON free), then the end marker or the answer's end."""
    at = text.find(DS_BEGIN)
    if at < 0:
        return None
    calls, i = [], skip_space(text, at + len(DS_BEGIN))
    while text.startswith(DS_CALL, i):
        m = DS_HEAD.match(text, i)
        name = m.group(1).strip() if m is not None else None
        end = whole_object(text, m.end()) if name in tools.schemas else None
        tail = DS_TAIL.match(text, end) if end is not None else None
        if tail is None:
            return None
        calls.append(PartialCall(name, text[m.end():end], True))
        i = tail.end()
    i = skip_space(text, i + len(DS_END) if text.startswith(DS_END, i) else i)
    return Scanned(text[:at], tuple(calls)) if calls and i == len(text) else None


def _pythonic(text: str, tools) -> Scanned | None:
    calls = pythonic.read(text, set(tools.schemas))
    return None if calls is None else Scanned("", tuple(PartialCall(name, args, True) for name, args in calls))


READERS = {"llama3": _llama3, "mistral": _mistral, "deepseek_v3": _deepseek, "pythonic": _pythonic}
