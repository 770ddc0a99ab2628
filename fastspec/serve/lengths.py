"""How long a served request may be: a default length within what the context and the KV pool leave, and the
engine's own length check (Engine.check_length) told as OpenAI's 400 naming the request's field. A refusal past
the KV pool is the server's to remedy (--max-total-tokens): its log says so, at most once a minute, so a client
cannot flood it. Does not re-derive the limits: the engine's numbers are the only ones."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from fastspec.errors import RequestTooLong, tokens
from fastspec.sampling.params import SamplingParams
from fastspec.serve.api_error import APIError
from fastspec.serve.protocol import ParsedRequest

_log = logging.getLogger(__name__)


class PoolRefusals:
    """The KV pool's refusals told in the server's log: the first at once, then at most one line per `interval`
    seconds, which counts the refusals since the last line (each client still gets its 400). The event loop's."""

    def __init__(self, interval: float = 60.0):
        self.interval = interval
        self.last: float | None = None  # time.monotonic() when the last line was logged
        self.held = 0  # refusals since then, not logged

    def refused(self, e: RequestTooLong) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval:
            self.held += 1
            return
        since = f" ({self.held} more refused since the last such line)" if self.held else ""
        _log.warning("refused a request of %d prompt + %d new tokens: more than the KV pool of %d tokens holds "
                     "(raise --max-total-tokens to serve it)%s", e.prompt_len, e.max_new_tokens, e.capacity, since)
        self.last, self.held = now, 0


def default_length(engine, parsed: ParsedRequest, params: SamplingParams, prompt_ids: list[int]) -> SamplingParams:
    """Without max_tokens: the default (chat's: the rest of the context, capped), within what the context and the
    KV pool leave (a chat that asked for no length is not refused for one it did not ask for)."""
    if parsed.max_tokens_field is not None:
        return params
    room = engine.room_for(len(prompt_ids))
    return replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)))


def check_length(engine, refusals: PoolRefusals, parsed: ParsedRequest, prompt_len: int, max_new_tokens: int,
                 index: int | None) -> None:
    """The engine's refusal of a request past the context length or the KV pool as a 400 naming the request's own
    field, as OpenAI's (param, code context_length_exceeded): the messages / prompt when they leave no room for a
    token, else the length field. `index`: the prompt's in a batch."""
    try:
        engine.check_length(prompt_len, max_new_tokens)
    except RequestTooLong as e:
        field = "messages" if parsed.chat else "prompt"
        what = field if index is None else f"prompt {index} of the batch"
        name = parsed.max_tokens_field or "max_tokens"  # (None: the default never asks past the context or pool)
        if e.limit == "context":
            where, past = f"the context length {e.capacity}", f"exceeds the context length {e.capacity}"
        else:
            refusals.refused(e)
            where = f"this server's KV pool ({e.capacity} tokens)"
            past = f"is more than this server's KV pool holds ({e.capacity} tokens)"
        if e.room < 1:
            raise APIError(f"{what}: {tokens(prompt_len)}, no room for an answer in {where}", param=field,
                           code="context_length_exceeded") from None
        raise APIError(f"{what} ({tokens(prompt_len)}) + {name} ({max_new_tokens}) {past}: at most {e.room}",
                       param=name, code="context_length_exceeded") from None
