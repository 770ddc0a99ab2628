"""The OpenAI HTTP API's responses as values: the response, stream-chunk and usage objects, and logprobs in OpenAI's
shapes, built from what the engine produced (speculative figures ride along in `meta_info`, as SGLang reports them).
Does not own: parsing requests (protocol.py), running them (service.py) or HTTP (app.py).
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import dataclass

from fastspec.utils.metrics import SpecMetrics


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def meta_info(metrics: SpecMetrics) -> dict:
    """The speculative figures, in an extra field OpenAI clients ignore (SGLang reports these in meta_info)."""
    return {"spec_verify_ct": metrics.verify_rounds, "spec_accepted_tokens": metrics.accepted_tokens,
            "spec_accept_length": round(metrics.tau, 4)}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def logprobs_object(chat: bool, entries: list, token_bytes, offsets: TextOffsets | None = None) -> dict | None:
    """OpenAI's logprobs for TokenLogprob entries (`token_bytes(id)`: the token's bytes): chat {"content": [...]},
    completions parallel lists (an echoed prompt's first token: logprob and top None, null in JSON; text_offset
    from `offsets`, the choice's, which has counted the text of its earlier entries)."""
    if entries is None:
        return None
    if chat:
        def item(token: int, logprob: float) -> dict:
            raw = token_bytes(token)
            return {"token": token_name(raw), "logprob": logprob, "bytes": list(raw)}
        return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    pieces = [token_bytes(e.token) for e in entries]
    return {"tokens": [token_name(p) for p in pieces], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {token_name(token_bytes(t)): lp for t, lp in e.top}
                             for e in entries],
            "text_offset": (offsets or TextOffsets()).starts(pieces)}


def token_name(raw: bytes) -> str:
    """A token as OpenAI names it: its text, or, for bytes that are no whole characters (a piece of an emoji),
    `bytes:\\xf0\\x9f` (as U+FFFD, distinct tokens would share one name, and a top_logprobs key)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token's text starts in a choice's text (completions' text_offset): the whole characters the bytes
    of the tokens before it make. E.g. 😀 in three tokens, then "a": offsets 0, 0, 0, 1."""

    def __init__(self):
        self.chars, self._utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")

    def starts(self, pieces: list[bytes]) -> list[int]:
        """The offsets of the next tokens, given their bytes."""
        out = []
        for raw in pieces:
            out.append(self.chars)
            self.chars += len(self._utf8.decode(raw))
        return out


@dataclass(frozen=True)
class Choice:
    """One finished choice of a response."""

    text: str | None
    reason: str
    logprobs: dict | None
    tool_calls: tuple = ()  # fastspec.serve.tools.ToolCall: the reason is then "tool_calls"


def response(rid: str, chat: bool, model: str, choices: list[Choice], prompt_tokens: int, completion_tokens: int,
             metrics: SpecMetrics) -> dict:
    """`completion_tokens`: all choices' together; `metrics`: their speculative figures summed."""
    out = []
    for index, c in enumerate(choices):
        reason = "tool_calls" if c.tool_calls and c.reason == "stop" else finish_reason(c.reason)
        choice = {"index": index, "finish_reason": reason, "logprobs": c.logprobs}
        message = {"role": "assistant", "content": c.text}
        if c.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in c.tool_calls]
        choice |= {"message": message} if chat else {"text": c.text}
        out.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(prompt_tokens, completion_tokens),
            "meta_info": meta_info(metrics)}


def chunk(rid: str, chat: bool, model: str, text: str | None, reason: str | None, logprobs: dict | None = None,
          role: bool = False, index: int = 0, tool_calls: tuple = ()) -> dict:
    """A stream chunk of choice `index`: a text delta, tool-call deltas (fastspec.serve.tools.ArgumentsDelta), or
    its end."""
    choice = {"index": index, "finish_reason": reason if reason == "tool_calls" else finish_reason(reason),
              "logprobs": logprobs}
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if tool_calls:
            delta["tool_calls"] = [call.as_dict() for call in tool_calls]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}


def usage_chunk(rid: str, chat: bool, model: str, prompt_tokens: int, completion_tokens: int,
                metrics: SpecMetrics) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens),
            "meta_info": meta_info(metrics)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
