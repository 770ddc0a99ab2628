"""A chat request's messages, checked against OpenAI's message objects and turned into what the chat template reads
(fastspec.serve.protocol checks the rest of the request). Text content only; earlier tool calls' arguments as dicts.
"""

from __future__ import annotations

import json

from fastspec.serve.api_error import APIError, type_name

MESSAGE_FIELDS = {  # OpenAI's message objects by role (an unknown key is a 400, as an unknown top-level field)
    "system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "refusal", "tool_calls", "audio", "function_call"},
    "tool": {"role", "content", "tool_call_id"}}
UNSUPPORTED_MESSAGE_FIELDS = ("audio", "function_call")  # OpenAI's, not served: refused rather than dropped
TOOL_CALL_FIELDS, FUNCTION_FIELDS = {"id", "type", "function"}, {"name", "arguments"}  # an assistant's tool_calls item


def parse_messages(body: dict) -> list[dict]:
    """A chat request's messages as the chat template reads them (APIError 400 naming what is wrong)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m, i: int) -> dict:
    """Message i as the chat template reads it ({role, content} and name, tool_call_id, tool_calls where given)."""
    if not isinstance(m, dict) or m.get("role") not in MESSAGE_FIELDS:
        raise APIError("each message needs a role: system, developer, user, assistant or tool", param="messages")
    unknown = sorted(set(m) - MESSAGE_FIELDS[m["role"]])
    if unknown:
        raise APIError(f"unknown field(s) in messages[{i}] ({m['role']}): {', '.join(unknown)}", param="messages")
    unsupported = [k for k in UNSUPPORTED_MESSAGE_FIELDS if m.get(k) is not None]
    if unsupported:
        raise APIError(f"messages[{i}]: {', '.join(unsupported)} is not supported", param="messages")
    extra = {}
    for name in ("name", "refusal"):
        if m.get(name) is not None and not isinstance(m[name], str):
            raise APIError(f"messages[{i}].{name} must be of type str, got {type_name(m[name])}", param="messages")
    if m.get("name") is not None:
        extra["name"] = m["name"]
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise APIError("a tool message needs the tool_call_id it answers", param="messages")
        extra["tool_call_id"] = m["tool_call_id"]
    if m["role"] == "assistant" and m.get("content") is None:  # (a refusal's text is what the assistant said)
        m = m | {"content": m.get("refusal") or ("" if m.get("tool_calls") is not None else None)}
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        extra["tool_calls"] = _tool_calls(m["tool_calls"], i)
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError("only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError("message content must be a string or a list of text parts", param="messages")
    return {"role": "system" if m["role"] == "developer" else m["role"], "content": content} | extra


def _tool_calls(calls, i: int) -> list[dict]:
    """Message i's earlier tool calls, for the chat template (arguments as a dict, as templates read them); a key
    OpenAI's tool call object does not have (id, type, function {name, arguments}) is a 400 naming it."""
    if not isinstance(calls, list):
        raise APIError("tool_calls must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError("each tool call needs a function name", param="messages")
        where = f"messages[{i}].tool_calls[{j}]"
        for keys, allowed, at in ((c, TOOL_CALL_FIELDS, where), (f, FUNCTION_FIELDS, f"{where}.function")):
            if unknown := sorted(set(keys) - allowed):
                raise APIError(f"unknown field(s) in {at}: {', '.join(unknown)}", param="messages")
        if c.get("type") not in (None, "function"):
            raise APIError(f"{where}.type must be function, got {c['type']!r}", param="messages")
        args = f.get("arguments") or "{}"  # (OpenAI's is JSON text; a dict, as some clients send, is taken)
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise APIError(f"{where}.function.arguments must be a JSON object", param="messages")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out
