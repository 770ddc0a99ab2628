"""What every tool-call format (fastspec.serve.tool_formats) is built of: a call as far as an answer has been read
(PartialCall, Scanned), the Lark pieces of a format's grammar (a trigger, the free text up to it, one call object
of the tools, a rule per function) and the readings the formats share (a call's arguments so far, a call whose
arguments are a JSON value, calls written as JSON objects one after another). Knows no format's markers."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastspec.serve.json_scan import read_call, skip_space, value_end

TEXT = "TEXT: /(.|\\n)*/\n"


@dataclass(frozen=True)
class PartialCall:
    name: str | None  # None: not known yet (nothing of the call is streamed before its name)
    arguments: str  # JSON text so far: a prefix of the finished arguments
    done: bool = False


@dataclass(frozen=True)
class Scanned:
    content: str  # the content so far: a prefix of the finished answer's content
    calls: tuple[PartialCall, ...] = ()


def lit(text: str, specials: dict[str, int]) -> str:
    """`text` in a Lark rule: the special token by id where the tokenizer has it as one, else a string."""
    return f"<[{specials[text]}]>" if text in specials else json.dumps(text)


def opening(trigger: str, specials: dict[str, int]) -> str:
    """The rule `open`: free text up to the trigger's first occurrence."""
    if trigger in specials:  # free text cannot hold a special token: no laziness needed
        return f"open: TEXT {lit(trigger, specials)}\n"
    return f"open[lazy]: TEXT {json.dumps(trigger)}\n"


def one_line(schema: dict, spaced: bool = True) -> dict:
    """`schema` written on one line with `, ` and `: ` (llguidance's options; `,` and `:` for a tokenizer that
    cannot write a space): JSON as models write calls, and no room for a small model to spend tokens on
    whitespace (free to, it wrote `"city" : "Paris"\n\n,` and repeated calls)."""
    return schema | {"x-guidance": {"whitespace_flexible": False, "item_separator": ", " if spaced else ",",
                                    "key_separator": ": " if spaced else ":"}}


def call_schema(tools, args_key: str) -> dict:
    """One call object of any of the tools: {"name": <its name>, args_key: <its parameters>}."""
    return one_line({"anyOf": [{"type": "object", "properties": {"name": {"const": name}, args_key: schema},
                       "required": ["name", args_key], "additionalProperties": False}
                      for name, schema in tools.schemas.items()]}, tools.spaced)


def _hold(text: str, trigger: str) -> int:
    """Characters at the end of `text` that may be the start of `trigger`."""
    return next((k for k in range(min(len(trigger) - 1, len(text)), 0, -1) if text.endswith(trigger[:k])), 0)


def free_text(text: str, trigger: str, final: bool) -> str:
    """The free text of `text` so far: all of it once `final`, else short of an end that may start `trigger`."""
    return text if final else text[:len(text) - _hold(text, trigger)]


def per_function(tools, head, tail: str = "") -> tuple[str, str]:
    """(rules, alternatives) of a format that writes each function's name around its arguments' JSON: rule fK is
    `head(name) %json <K's parameters> tail` (Lark pieces), the alternatives `(f0 | f1 | ...)`."""
    names = list(tools.schemas)
    rules = "".join(f"f{k}: {head(name)} %json {json.dumps(one_line(tools.schemas[name], tools.spaced))} {tail}\n"
                    for k, name in enumerate(names))
    return rules, "(" + " | ".join(f"f{k}" for k in range(len(names))) + ")"


def value_call(name: str, text: str, start: int | None, final: bool) -> tuple[PartialCall, int | None]:
    """Call `name` whose arguments are the JSON value from `text[start]` on (None: not started yet), and where
    that value ends (None: not yet)."""
    if start is None or start >= len(text):
        return PartialCall(name, "{}" if final else ""), None
    end = value_end(text, start)
    return PartialCall(name, text[start:end if end is not None else len(text)], end is not None), end


def args_so_far(read, text: str, final: bool) -> str:
    """A call's arguments so far; a finished call without any is {}."""
    if read.args_start is None:
        return "{}" if final or read.end is not None else ""
    return read.arguments(text)


def json_calls(text: str, i: int, tools, final: bool, separator: str, args_keys: tuple[str, ...]) -> Scanned:
    """Calls from `text[i]` on, separated by `separator`; the answer is content where the first is none."""
    calls = []
    while True:
        read = read_call(text, i, args_keys)
        if read.name not in tools.schemas:
            if calls or read.invalid or read.name is not None or final or read.end is not None:
                return Scanned("" if calls else text, tuple(calls))
            return Scanned("")  # the name is still coming
        calls.append(PartialCall(read.name, args_so_far(read, text, final), read.end is not None))
        if read.end is None:
            return Scanned("", tuple(calls))
        i = skip_space(text, read.end)
        if not text.startswith(separator, i):
            return Scanned("", tuple(calls))
        i = skip_space(text, i + len(separator))
