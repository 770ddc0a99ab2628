"""The tool-call formats models write, each three things: the lazy grammar an `auto` answer decodes under (text
runs free until the model opens a call in its format; from there the call follows the functions' schemas), and
the reading of an answer as far as it has been generated into content and calls (`scan`: what streaming sends,
and with `final` the finished answer's content and calls, so the streamed pieces join to exactly those).

An answer the grammar holds to the format (`tools.held`) is read as it grows: a call from its function's name on,
its arguments' text as it comes (pythonic: each call once it closes). From free text (the request brought its own
grammar) a hermes block is a call only once it closes as a valid one; the other formats' answers are read whole
when they end (fastspec.serve.free_calls).

- hermes (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, any number, text
  around them is content.
- llama3 (Llama 3.1 / 3.2 JSON): the whole answer `{"name": "f", "parameters": {...}}`, optionally after
  `<|python_tag|>`, calls separated by `;`.
- mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` after any text; with a tokenizer that has the
  `[ARGS]` token (Mistral's v11 tokenizers: Mistral Small 3.2, Magistral), `[TOOL_CALLS]f[ARGS]{...}` per call.
- pythonic (Llama 3.2 / 4 pythonic templates): the whole answer `[f(a=1, b="x"), g()]` (fastspec.serve.pythonic).
- deepseek_v3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` after any text.

Grammars are llguidance's Lark: a trigger that is one special token of the tokenizer is named by id (`<[id]>`),
else written as text and found by a lazy lexeme (the free text ends at the trigger's first occurrence).
"""

from __future__ import annotations

import json

from fastspec.serve import pythonic
from fastspec.serve.json_scan import read_call, skip_space, whole_call
from fastspec.serve.tool_calls import (TEXT, PartialCall, Scanned, args_so_far, call_schema, free_text, json_calls,
                                       lit, one_line, opening, per_function, value_call)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
ARGS_KEYS, LLAMA3_KEYS = ("arguments", "parameters"), ("parameters", "arguments")


# ---- hermes ----

def hermes_grammar(tools, specials: dict[str, int]) -> str:
    call = f"call: open /\\n?/ %json {json.dumps(call_schema(tools, 'arguments'))} /\\n?/ " \
           f"{lit(HERMES_CLOSE, specials)}\n"
    start = "start: call* TEXT\n" if tools.parallel else "start: TEXT | call /\\n?/\n"
    return "%llguidance {}\n" + start + call + opening(HERMES_OPEN, specials) + TEXT


def hermes_scan(text: str, tools, final: bool) -> Scanned:
    content, calls, pos = [], [], 0
    while (at := text.find(HERMES_OPEN, pos)) >= 0:
        content.append(text[pos:at])
        call, pos = _hermes_block(text, at, tools, final)
        calls += [] if call is None else [call]
        if pos is None:
            return Scanned("".join(content), tuple(calls))
        if call is None:
            content.append(text[at:pos])
    content.append(free_text(text[pos:], HERMES_OPEN, final))
    return Scanned("".join(content), tuple(calls))


def _hermes_block(text: str, at: int, tools, final: bool) -> tuple[PartialCall | None, int | None]:
    """The `<tool_call>` block at `at`: the call it is (None: it is content, through the next `</tool_call>`) and
    where it ends (None: not known yet). Held to the format it is a call from a known name on, whatever follows;
    from free text only once whole: a valid call object, then `</tool_call>`."""
    start = skip_space(text, at + len(HERMES_OPEN))
    read = read_call(text, start, ARGS_KEYS)
    close = len(text) if read.end is None else skip_space(text, read.end)
    closed = text.startswith(HERMES_CLOSE, close)
    coming = not (final or closed) and HERMES_CLOSE.startswith(text[close:close + len(HERMES_CLOSE)])
    if tools.held and read.name in tools.schemas:
        call = PartialCall(read.name, args_so_far(read, text, final), read.end is not None)
        if read.end is None or coming:
            return call, None
        return call, (close + len(HERMES_CLOSE) if closed else read.end)
    whole = whole_call(text, start, tools.schemas, ARGS_KEYS)
    if whole is not None and closed:  # free text (held, a known name returned above)
        return PartialCall(whole[0], whole[1], True), close + len(HERMES_CLOSE)
    unknown = read.name is not None and read.name not in tools.schemas
    if not (final or read.invalid or unknown or (read.end is not None and not coming)):
        return None, None  # it may still be a call
    end = text.find(HERMES_CLOSE, at)
    if end < 0:
        return None, (len(text) if final else None)
    return None, end + len(HERMES_CLOSE)


# ---- llama3 (JSON) ----

def llama3_grammar(tools, specials: dict[str, int]) -> str:
    more = ' ("; " call)*' if tools.parallel else ""
    return ("%llguidance {}\n"
            f"start: PROSE | /\\s*/ [{lit(PYTHON_TAG, specials)} /\\n?/] call{more}\n"
            f"call: %json {json.dumps(call_schema(tools, 'parameters'))}\n"
            "PROSE: /\\s*([^{\\s](.|\\n)*)?/\n")  # text is what does not open with a brace


def llama3_scan(text: str, tools, final: bool) -> Scanned:
    i = skip_space(text, 0)
    rest = text[i:]
    if not final and (not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
        return Scanned("")  # undecided
    if rest.startswith(PYTHON_TAG):
        i = skip_space(text, i + len(PYTHON_TAG))
    return json_calls(text, i, tools, final, ";", LLAMA3_KEYS)


# ---- mistral ----

def mistral_grammar(tools, specials: dict[str, int]) -> str:
    if MISTRAL_ARGS in specials:  # v11: [TOOL_CALLS]name[ARGS]{...}, each call after its own [TOOL_CALLS]
        rules, call = per_function(tools, lambda name: f"{json.dumps(name)} {lit(MISTRAL_ARGS, specials)}")
        more = f" ({lit(MISTRAL_CALLS, specials)} {call})*" if tools.parallel else ""
        return ("%llguidance {}\n" f"start: TEXT | open {call}{more}\n" + rules
                + opening(MISTRAL_CALLS, specials) + TEXT)
    calls = one_line({"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1} | (
        {} if tools.parallel else {"maxItems": 1}), tools.spaced)
    return ("%llguidance {}\n" f"start: TEXT | open / ?/ %json {json.dumps(calls)}\n"
            + opening(MISTRAL_CALLS, specials) + TEXT)


def mistral_scan(text: str, tools, final: bool) -> Scanned:
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        return Scanned(free_text(text, MISTRAL_CALLS, final))
    i = skip_space(text, at + len(MISTRAL_CALLS))
    if i < len(text) and text[i] not in "[{":  # v11: name[ARGS]{...} after each [TOOL_CALLS]
        got = _named_calls(text, at, tools, final)
    else:
        if i < len(text) and text[i] == "[":
            i = skip_space(text, i + 1)
        got = json_calls(text, i, tools, final, ",", ARGS_KEYS)
    return Scanned(text[:at] if got.calls or not final else text, got.calls)


def _named_calls(text: str, at: int, tools, final: bool) -> Scanned:
    """`[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}` from `at`."""
    calls = []
    while text.startswith(MISTRAL_CALLS, at):
        sep = text.find(MISTRAL_ARGS, at)
        name = text[at + len(MISTRAL_CALLS):sep].strip() if sep >= 0 else None
        if name not in tools.schemas:
            break
        call, end = value_call(name, text, skip_space(text, sep + len(MISTRAL_ARGS)), final)
        calls.append(call)
        if end is None:
            break
        at = skip_space(text, end)
    return Scanned("", tuple(calls))


# ---- deepseek_v3 ----

def deepseek_grammar(tools, specials: dict[str, int]) -> str:
    mark = lambda s: lit(s, specials)  # noqa: E731
    rules, function = per_function(tools, lambda name: json.dumps(f"{name}\n```json\n"), json.dumps("\n```"))
    calls = "call (/\\n?/ call)*" if tools.parallel else "call"
    return ("%llguidance {}\n" f"start: TEXT | open {calls} /\\n?/ {mark(DS_END)}\n"
            f"call: {mark(DS_CALL)} \"function\" {mark(DS_SEP)} {function} {mark(DS_CALL_END)}\n" + rules
            + opening(DS_BEGIN, specials) + TEXT)


def deepseek_scan(text: str, tools, final: bool) -> Scanned:
    at = text.find(DS_BEGIN)
    if at < 0:
        return Scanned(free_text(text, DS_BEGIN, final))
    calls, i = [], at + len(DS_BEGIN)
    while (begin := text.find(DS_CALL, i)) >= 0:
        sep = text.find(DS_SEP, begin)
        line = text.find("\n", sep + len(DS_SEP)) if sep >= 0 else -1
        name = text[sep + len(DS_SEP):line].strip() if line >= 0 else None
        if name not in tools.schemas:
            break
        fence = text.find("```json", line)
        start = skip_space(text, fence + len("```json")) if fence >= 0 else None
        call, end = value_call(name, text, start, final)
        calls.append(call)
        if end is None:
            break
        i = end
    return Scanned(text[:at] if calls or not final else text, tuple(calls))


# ---- pythonic ----

def pythonic_scan(text: str, tools, final: bool) -> Scanned:
    found = pythonic.scan(text, set(tools.schemas))
    if found is None:
        return Scanned(text if final else ("" if not text.strip() or text.lstrip()[0] == "[" else text))
    return Scanned("", tuple(PartialCall(name, args, True) for name, args in found))


FORMATS = {  # name -> (auto grammar, scan, the tokens it needs to see in the answer's text)
    "hermes": (hermes_grammar, hermes_scan, (HERMES_OPEN, HERMES_CLOSE)),
    "llama3": (llama3_grammar, llama3_scan, (PYTHON_TAG,)),
    "mistral": (mistral_grammar, mistral_scan, (MISTRAL_CALLS, MISTRAL_ARGS)),
    "pythonic": (lambda tools, specials: pythonic.grammar(tools.schemas, tools.parallel), pythonic_scan, ()),
    "deepseek_v3": (deepseek_grammar, deepseek_scan, (DS_BEGIN, DS_END, DS_CALL, DS_SEP, DS_CALL_END)),
}


def template_parser(chat_template: str | None) -> str:
    """The format a chat template asks for, from the markers it writes (hermes where it names none)."""
    template = chat_template or ""
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if MISTRAL_CALLS in template:
        return "mistral"
    if "func_name1(" in template or "<|python_start|>" in template:
        return "pythonic"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return "hermes"


def needs_special_text(parser: str, specials: dict[str, int]) -> bool:
    """Whether the answer must be decoded with special tokens kept for `parser` to see its markers."""
    return any(marker in specials for marker in FORMATS[parser][2])
