"""The pythonic tool-call format (Llama 3.2 / 4 pythonic templates): the answer `[get_weather(city="Paris"),
get_time(zone="utc")]`. Its grammar (Lark for llguidance) writes each function's keyword arguments in the order
its schema declares them, the required ones always, each value a Python literal of its schema's type (strings
in either quote, True / False / None, lists, dicts); string lengths, ranges and patterns are not held (only
types, enums and consts). Calls are read with Python's own parser (`ast`) and their arguments sent as JSON."""

from __future__ import annotations

import ast
import json
import re
import warnings

CALL_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
TERMINALS = ('PY_STRING: /"([^"\\\\\\n]|\\\\.)*"|\'([^\'\\\\\\n]|\\\\.)*\'/\n'
             "PY_INT: /-?[0-9]+/\n"
             "PY_NUMBER: /-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?/\n"
             "SEP: /, ?/\n"
             'any: PY_STRING | PY_NUMBER | "True" | "False" | "None" | "[" (any (SEP any)*)? "]" '
             '| "{" (PY_STRING ": " any (SEP PY_STRING ": " any)*)? "}"\n')
PROSE = "PROSE: /\\s*([^\\[\\s](.|\\n)*)?/\n"  # text is what does not open with a bracket


def _literal(value) -> str:
    """A JSON value as the Lark string of its Python literal."""
    return json.dumps(repr(value) if not isinstance(value, str) else json.dumps(value))


class _Rules:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}\n")
        return name

    def value(self, schema) -> str:
        """A Lark expression for a Python literal of `schema`."""
        if not isinstance(schema, dict):
            return "any"
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
        options = schema.get("anyOf") or schema.get("oneOf")
        if options:
            return "(" + " | ".join(self.value(s) for s in options) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value(schema | {"type": k}) for k in kind) + ")"
        simple = {"string": "PY_STRING", "integer": "PY_INT", "number": "PY_NUMBER", "boolean": '("True" | "False")',
                  "null": '"None"'}
        if kind in simple:
            return simple[kind]
        if kind == "array":
            item = self.value(schema.get("items", {}))
            return self.add(f'"[" ({item} (SEP {item})*)? "]"')
        if kind == "object" and schema.get("properties"):
            return self.add('"{" ' + self.fields(schema, lambda k: f'{json.dumps(json.dumps(k))} ": "') + ' "}"')
        return "any"

    def fields(self, schema: dict, key) -> str:
        """The properties in declared order, comma-separated, the required ones always there: an expression
        (it may match nothing when none is required)."""
        props = list(schema.get("properties", {}).items())
        required = set(schema.get("required", []))
        items = [(f"{key(k)} {self.value(v)}", k in required) for k, v in props]
        after = [""] * (len(items) + 1)  # after[k]: items k.. once one was written (each after a comma)
        for k in range(len(items) - 1, -1, -1):
            expr, needed = items[k]
            part = f"SEP {expr}" if needed else f"(SEP {expr})?"
            after[k] = self.add(f"{part} {after[k + 1]}".strip())
        alternatives = []  # the first written item is item j: every required item is at j or later
        for j, (expr, needed) in enumerate(items):
            alternatives.append(f"{expr} {after[j + 1]}".strip())
            if needed:
                break
        if not alternatives:
            return ""
        optional = not any(needed for _, needed in items)
        return "(" + " | ".join(alternatives) + ")" + ("?" if optional else "")


def grammar(schemas: dict, parallel: bool) -> str:
    """The `auto` grammar: free text that does not open with `[`, or a list of calls."""
    rules = _Rules()
    calls = [rules.add(f'{json.dumps(name + "(")} {rules.fields(schema, lambda k: json.dumps(k + "="))} ")"')
             for name, schema in schemas.items()]
    call = rules.add(" | ".join(calls))
    more = f" (SEP {call})*" if parallel else ""
    return ("%llguidance {}\n" f'start: PROSE | /\\s*/ "[" {call}{more} "]"\n' + "".join(rules.lines)
            + TERMINALS + PROSE)


def scan(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """The calls of an answer so far as (name, JSON arguments), each once it has closed and read as a call (its
    arguments are sent whole): nothing of a call is known before, so none is sent that turns out not to be one.
    None where the answer is not (or not yet known to be) a list of calls."""
    i = len(text) - len(text.lstrip())
    if i >= len(text) or text[i] != "[":
        return None
    i += 1
    calls = []
    while True:
        m = CALL_NAME.match(text, i)
        close = _close(text, m.end()) if m is not None and m.group(1) in names else None
        arguments = None if close is None else _arguments(text[m.start(1):close + 1])
        if arguments is None:  # not a call of these functions, or not closed yet
            return calls or None
        calls.append((m.group(1), arguments))
        i = close + 1
        while i < len(text) and text[i] in " \n":
            i += 1
        if i >= len(text) or text[i] != ",":
            return calls
        i += 1


def read(text: str, names: set[str]) -> list[tuple[str, str]] | None:
    """A finished answer read whole (from free text): its calls where it is exactly a list of calls of these
    functions with literal keyword arguments, else None."""
    node = _parse(text.strip())
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        named = isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names
        arguments = _keywords(call) if named else None
        if arguments is None:
            return None
        calls.append((call.func.id, arguments))
    return calls


def _close(text: str, i: int) -> int | None:
    """Index of the `)` that closes a call whose arguments start at `text[i]`."""
    depth, quote = 1, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _arguments(call: str) -> str | None:
    """`f(a=1, b="x")` -> '{"a": 1, "b": "x"}'; None where it is not a call with literal keyword arguments."""
    node = _parse(call)
    return _keywords(node) if isinstance(node, ast.Call) else None


def _parse(source: str) -> ast.expr | None:
    """The expression `source` is, or None; quietly (a model's `"C:\\x"` is no warning of ours to print)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None


def _keywords(call: ast.Call) -> str | None:
    """A call's keyword arguments as JSON; None where it has others (positional, `**`) or a value is no literal."""
    if call.args or any(k.arg is None for k in call.keywords):
        return None
    try:
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in call.keywords})
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
