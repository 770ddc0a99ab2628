"""Tool calls in `fastspec serve`: OpenAI's `tools` / `tool_choice` checked, the grammar each choice decodes under,
and the model's output read into content and `tool_calls`.

`required` and a named function are decoded under a JSON-schema grammar, as vLLM does: the output is the calls'
JSON itself (a list of {"name", "parameters"} for `required`, the arguments for a named function), so it always
parses and matches the functions' schemas, whatever the template's format. `auto` decodes under the format's lazy
grammar (fastspec.serve.tool_formats): free text until the model opens a call, the call then held to the
schemas. Objects in those schemas are closed unless they say otherwise (`close_objects`), so a call holds only
keys the function declares, and ends. Arguments are the answer's own text, streamed as generated
(fastspec.serve.tool_stream). An `auto` request that brings its own response_format / regex / ebnf decodes
without the format's grammar: its calls are read from free text, each only once whole (fastspec.serve.free_calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fastspec.serve import free_calls
from fastspec.serve.api_error import APIError
from fastspec.serve.json_scan import skip_space
from fastspec.serve.tool_calls import PartialCall, Scanned, json_calls, one_line
from fastspec.serve.tool_formats import FORMATS, template_parser  # noqa: F401

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PARSERS = tuple(FORMATS)


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
    """A streamed fragment of a call's arguments, as they are generated (fastspec.serve.tool_stream); the first
    fragment also carries the call's id and name."""

    index: int  # the call's place in the answer
    name: str | None  # the first fragment's; None for the others
    arguments: str

    def as_dict(self) -> dict:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return ToolCall(self.name, self.arguments).as_dict(self.index)


@dataclass(frozen=True)
class Tools:
    """A request's tools: the function dicts as the chat template reads them, and how the answer may use them."""

    functions: tuple[dict, ...]  # {"type": "function", "function": {"name", "description", "parameters"}}
    choice: str  # "auto" | "required" | "named" | "none"
    named: str | None = None  # the function `tool_choice` names
    schemas: dict = field(default_factory=dict)  # name -> the parameters a call is held to (close_objects)
    parallel: bool = True  # `parallel_tool_calls`: several calls in one answer
    spaced: bool = True  # calls' JSON with `, ` and `: ` (False: the tokenizer cannot write a space)
    held: bool = True  # a grammar holds the answer to the format (False: an `auto` request that brings its own
    #                    response_format / regex / ebnf; calls are then read from free text, each only once whole)

    def auto_grammar(self, parser: str, specials: dict[str, int]) -> str | None:
        """The Lark grammar an `auto` answer decodes under in `parser`'s format (None for other choices);
        `specials`: the tokenizer's special tokens (text -> id)."""
        return FORMATS[parser][0](self, specials) if self.choice == "auto" else None

    def grammar(self) -> str | None:
        """The JSON schema the answer is decoded under (`required`, named), or None (free text)."""
        if self.choice == "named":
            return json.dumps(one_line(self.schemas[self.named], self.spaced))
        if self.choice != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in self.schemas.items()]
        return json.dumps(one_line({"type": "array", "minItems": 1, "items": {"anyOf": call}} |
                                   ({} if self.parallel else {"maxItems": 1}), self.spaced))


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
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
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
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(tuple(functions), choice or "auto", schemas=schemas, parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                       '{"name": ...}}', param="tool_choice")
    if named not in names:
        raise APIError(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    return Tools(tuple(functions), "named", named, schemas=schemas, parallel=parallel)


def writes_spaces(tokenizer) -> bool:
    """Whether the tokenizer can write `, ` (calls' JSON is spaced as models write it only where it can)."""
    return tokenizer.decode(tokenizer.encode(", ", add_special_tokens=False)) == ", "


def parse_output(text: str, tools: Tools, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer: exactly what its stream sent (fastspec.serve.tool_stream)."""
    found = scan(text, tools, parser, final=True)
    calls = [ToolCall(c.name, c.arguments) for c in found.calls]
    return (None if calls and not found.content.strip() else found.content), calls


def scan(text: str, tools: Tools | None, parser: str, final: bool) -> Scanned:
    """An answer so far read as content and calls: under `required` a JSON list of calls, under a named function
    its arguments, under `auto` the parser's format (fastspec.serve.tool_formats; fastspec.serve.free_calls where
    no grammar held the answer to it)."""
    if tools is None or tools.choice == "none":
        return Scanned(text)
    if tools.choice == "named":
        return Scanned("", (PartialCall(tools.named, text, final),))
    if tools.choice == "required":
        i = skip_space(text, 0)
        if i < len(text) and text[i] == "[":
            found = json_calls(text, skip_space(text, i + 1), tools, final, ",", ("parameters",))
            return Scanned("" if found.calls else found.content, found.calls)
        return Scanned(text if final else "")
    found = FORMATS[parser][1](text, tools, final)
    return found if tools.held else free_calls.scan(found, text, tools, parser, final)
