"""Tool calls in `fastspec serve`: OpenAI's `tools` / `tool_choice` checked, the grammar that `required` and named
choices decode under, and the model's output parsed into `tool_calls`.

Formats (`--tool-call-parser`, else the one the chat template asks for): `hermes` (Hermes, Qwen 2.5 / 3:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them is content) and `llama3`
(Llama 3.1 / 3.2: the whole answer is `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, calls
separated by `;`). `required` and a named function are decoded under a JSON-schema grammar, as vLLM does: the
output is the calls' JSON itself (a list of {"name", "parameters"} for `required`, the arguments for a named
function), so it always parses and matches the functions' schemas, whatever the template's format. Objects in those
schemas are closed unless they say otherwise (`close_objects`), so a forced call holds only keys the function
declares, and ends. A named function's arguments are the answer's text itself, streamed as it comes
(`ArgumentsDelta`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fastspec.serve.errors import APIError

PARSERS = ("hermes", "llama3")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


@dataclass(frozen=True)
class ArgumentsDelta:
    """A streamed fragment of a call's arguments (a named tool_choice streams them as they are generated); the first
    fragment also carries the call's id and name."""

    name: str | None  # the first fragment's; None for the others
    arguments: str

    def as_dict(self, index: int) -> dict:
        if self.name is None:
            return {"index": index, "function": {"arguments": self.arguments}}
        return ToolCall(self.name, self.arguments).as_dict(index)


@dataclass(frozen=True)
class Tools:
    """A request's tools: the function dicts as the chat template reads them, and how the answer may use them."""

    functions: tuple[dict, ...]  # {"type": "function", "function": {"name", "description", "parameters"}}
    choice: str  # "auto" | "required" | "named" | "none"
    named: str | None = None  # the function `tool_choice` names
    schemas: dict = field(default_factory=dict)  # name -> the parameters a call is held to (close_objects)
    parallel: bool = True  # `parallel_tool_calls`: several calls in one answer

    def grammar(self) -> str | None:
        """The JSON schema the answer is decoded under (`required`, named), or None (free text)."""
        if self.choice == "named":
            return json.dumps(self.schemas[self.named])
        if self.choice != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in self.schemas.items()]
        return json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": call}} |
                          ({} if self.parallel else {"maxItems": 1}))


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "contains", "additionalProperties")


def close_objects(schema, strict: bool = False, where: str = "parameters"):
    """`schema` with every object that does not say otherwise closed: `additionalProperties: false` where neither it
    nor `patternProperties` / `unevaluatedProperties` is given (plain JSON Schema would admit any further key, and a
    small model keeps inventing them). `strict` (OpenAI's): every property is also required, and an object that
    allows more keys is refused (ValueError naming it). A copy; `schema` is left as it is."""
    if isinstance(schema, list):
        return [close_objects(s, strict, f"{where}[{i}]") for i, s in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: close_objects(v, strict, f"{where}.{k}") for k, v in value.items()}
        else:
            out[key] = close_objects(value, strict, f"{where}.{key}") if key in _SUBSCHEMAS else value
    types = out.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in out:
        if not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
            out["additionalProperties"] = False
        elif strict and out.get("additionalProperties", True) is not False:
            raise ValueError(f"{where} allows keys beyond its properties")
        if strict:
            out["required"] = list(out.get("properties", {}))
    return out


def parse_tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` of a chat request, checked (APIError 400), or None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError("tools must be a non-empty list", param="tools")
    functions, names, schemas = [], set(), {}
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError("each tool needs type function and a function name of 1-64 letters, digits, _ or -",
                           param="tools")
        if name in names:
            raise APIError(f"tool {name!r} is given twice", param="tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or not isinstance(f.get("strict", False), bool):
            raise APIError(f"tool {name!r}: parameters must be a JSON schema object and strict a boolean",
                           param="tools")
        try:
            schemas[name] = close_objects(params or {"type": "object", "properties": {}}, strict=f.get("strict", False))
        except ValueError as e:
            raise APIError(f"tool {name!r}: strict needs closed objects, but {e}", param="tools") from None
        names.add(name)
        functions.append({"type": "function", "function": {k: v for k, v in f.items()
                                                           if k in ("name", "description", "parameters")}})
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(tuple(functions), choice or "auto", schemas=schemas, parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', param="tool_choice")
    if named not in names:
        raise APIError(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    return Tools(tuple(functions), "named", named, schemas=schemas, parallel=parallel)


def template_parser(chat_template: str | None) -> str:
    """The format a chat template asks for: llama3 when it speaks of the python tag / ipython, else hermes."""
    template = chat_template or ""
    return "llama3" if PYTHON_TAG in template or "ipython" in template else "hermes"


def parse_output(text: str, tools: Tools, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer. Under `required` / named the answer is the calls' JSON; under `auto`
    it is read in `parser`'s format, and what does not parse stays content."""
    if tools.choice in ("named", "required"):
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens: the text as it is
            return text, []
        if tools.choice == "named":  # the text itself: what streaming sent, fragment by fragment
            return None, [ToolCall(tools.named, text)]
        return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in calls]
    if tools.choice == "none":
        return text, []
    return _hermes(text, tools) if parser == "hermes" else _llama3(text, tools)


def hold_back(text: str, tools: Tools | None, parser: str) -> int:
    """How many characters of a growing answer may be streamed as content now: all but what may become a tool
    call (the text from a `<tool_call>` or a prefix of it; a llama3 answer that may be one JSON call)."""
    if tools is None or tools.choice == "none":
        return len(text)
    if tools.choice != "auto":
        return 0
    if parser == "llama3":
        stripped = text.lstrip()
        may_be_call = not stripped or stripped[0] == "{" or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)])
        return 0 if may_be_call else len(text)
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a prefix of "<tool_call>" at the end
        if text.endswith(HERMES_OPEN[:k]):
            return len(text) - k
    return len(text)


def _hermes(text: str, tools: Tools) -> tuple[str | None, list[ToolCall]]:
    calls = [_call(m.group(1), tools, "arguments") for m in HERMES.finditer(text)]
    if not calls or None in calls:
        return text, []
    content = HERMES.sub("", text)  # not stripped: what was streamed before the first call is its start
    return content if content.strip() else None, calls


def _llama3(text: str, tools: Tools) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = [_call(part, tools, "parameters") for part in body.split(";") if part.strip()] if body else []
    if not calls or None in calls:
        return text, []
    return None, calls


def _call(raw: str, tools: Tools, key: str) -> ToolCall | None:
    """{"name": ..., key: {...}} naming one of the tools, else None."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tools.schemas:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], json.dumps(args)) if isinstance(args, dict) else None
