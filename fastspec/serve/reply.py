"""One OpenAI response over its engine requests (one per choice): a JSON body once every choice has finished, or a
stream of server-sent chunks as they go. Tool calls are parsed from a choice's finished text (and streamed as deltas
by fastspec.serve.tool_stream). A plain request asks after its client while it waits; a gone client's requests are
aborted. Knows nothing about routes or how the requests were submitted (fastspec.serve.app).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastspec.errors import FastspecError
from fastspec.sampling.logprobs import TokenLogprob
from fastspec.serve import responses
from fastspec.serve.api_error import APIError
from fastspec.serve.protocol import ParsedRequest
from fastspec.serve.service import Event
from fastspec.serve.tool_stream import ToolStream
from fastspec.serve.tools import parse_output

DISCONNECT_POLL_S = 0.25


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _decode_bytes(tokenizer, token: int) -> bytes:
    return tokenizer.decode_bytes([token])


class Reply:
    """The response to one request of n choices: each choice's events arrive as (index, Event). With tools, text
    that may be a tool call is held back while streaming and the finished text is parsed into tool calls."""

    def __init__(self, service, parsed: ParsedRequest, model: str, rid: str, prompt_tokens: int,
                 engine_rids: list[int], events: asyncio.Queue, tool_parser: str | None = None,
                 echoes: list[tuple[str, list[int]]] | None = None):
        """`echoes`: with echo, each choice's prompt (text, token ids)."""
        self.service, self.parsed, self.model, self.id = service, parsed, model, rid
        self.echoes = echoes
        self.prompt_tokens, self.engine_rids, self.events = prompt_tokens, engine_rids, events
        self.tool_parser = tool_parser
        self.open = set(range(len(engine_rids)))  # choices not finished
        self.finals: dict[int, Event] = {}  # choice -> its last event
        self.texts = {i: "" for i in self.open}  # choice -> its text so far
        self.streams = {i: ToolStream(parsed.tools, tool_parser) for i in self.open}  # what each choice streamed
        self.checked = time.monotonic()  # when the client was last asked whether it is still there
        self.echoed: set[int] = set()  # choices whose prompt was echoed
        self.offsets = {i: responses.TextOffsets() for i in self.open}  # where each streamed choice's text is at

    def _logprobs(self, entries: tuple | None, offsets: responses.TextOffsets | None = None) -> dict | None:
        """`offsets`: the choice's, which counted its earlier entries' text (completions' text_offset)."""
        if not self.parsed.logprobs or entries is None:
            return None
        return responses.logprobs_object(self.parsed.chat, list(entries), self._token_bytes(), offsets)

    def _token_bytes(self):
        """id -> the token's bytes (llguidance's reading of the tokenizer, the one grammars use; else the token's
        text, where that tokenizer cannot be read)."""
        try:
            return partial(_decode_bytes, self.service.engine.grammars.tokenizer)
        except FastspecError:
            decode = self.service.llm.tokenizer.decode
            return lambda t: decode([t], skip_special_tokens=False).encode()

    def _echoed(self, index: int, event: Event) -> Event:
        """With echo, the choice's first event (the one bringing the prompt's logprobs, where asked for) starts with
        its prompt's text and logprobs (the first token's: null); with max_tokens 0 no event carries output."""
        if self.parsed.prompt_only:
            event = replace(event, text="", logprobs=() if event.logprobs is not None else None, completion_tokens=0)
        if self.echoes is None or index in self.echoed or (self.parsed.logprobs and event.prompt_logprobs is None):
            return event
        self.echoed.add(index)
        text, ids = self.echoes[index]
        entries = None if event.logprobs is None else (
            (TokenLogprob(ids[0], None, None), *event.prompt_logprobs, *event.logprobs))
        return replace(event, text=text + event.text, logprobs=entries)

    def _finish(self, index: int, event: Event) -> None:
        self.open.discard(index)
        self.finals[index] = event

    def _totals(self) -> tuple[int, object]:
        """(completion tokens, speculative metrics) of every choice together."""
        finals = [self.finals[i] for i in sorted(self.finals)]
        return sum(e.completion_tokens for e in finals), sum((e.metrics for e in finals[1:]), finals[0].metrics)

    def _split(self, text: str) -> tuple[str | None, list]:
        """A finished choice's (content, tool calls)."""
        if self.parsed.tools is None:
            return text, []
        return parse_output(text, self.parsed.tools, self.tool_parser)

    def _stream_event(self, index: int, event: Event):
        """The chunks of one event of choice `index`: new content and tool-call deltas (fastspec.serve.tool_stream),
        then at the end finish_reason tool_calls where calls were made (else the engine's: length for a call cut
        short)."""
        chat, full = self.parsed.chat, self.texts[index] + event.text
        self.texts[index] = full
        logprobs = self._logprobs(event.logprobs, self.offsets[index]) if event.logprobs else None
        stream = self.streams[index]
        content, deltas = stream.feed(full, event.finish_reason is not None)
        if content or deltas or logprobs:
            yield responses.chunk(self.id, chat, self.model, content or None, None, logprobs, index=index,
                                  tool_calls=deltas)
        if event.finish_reason is not None:
            reason = "tool_calls" if stream.called and event.finish_reason == "stop" else event.finish_reason
            yield responses.chunk(self.id, chat, self.model, None, reason, index=index)

    async def stream(self):
        chat, failed = self.parsed.chat, False
        try:
            if chat:
                for index in sorted(self.open):
                    yield responses.sse(responses.chunk(self.id, chat, self.model, None, None, role=True, index=index))
            while self.open:
                index, event = await self.events.get()
                if event.error:  # the engine ended every open request already (failed, or the server stops)
                    self.open.clear()
                    failed = True
                    yield responses.sse(event.error.body())
                    break
                event = self._echoed(index, event)
                for piece in self._stream_event(index, event):
                    yield responses.sse(piece)
                if event.finish_reason is not None:
                    self._finish(index, event)
            if self.parsed.include_usage and not failed:
                tokens, metrics = self._totals()
                yield responses.sse(responses.usage_chunk(self.id, chat, self.model, self.prompt_tokens, tokens,
                                                          metrics))
            yield responses.sse("[DONE]")
        finally:  # the client went away (the task is cancelled) or the stream ended
            for index in self.open:
                self.service.abort(self.engine_rids[index])

    async def collect(self, request: Request) -> Response:
        logprobs = {i: [] for i in self.open}
        while self.open:
            got = await self._next_or_disconnect(request)
            if got is None:
                for index in self.open:
                    self.service.abort(self.engine_rids[index])
                return Response(status_code=499)  # nobody reads it
            index, event = got
            if event.error:
                return error_response(event.error)
            event = self._echoed(index, event)
            self.texts[index] += event.text
            if event.logprobs is not None:
                logprobs[index] += event.logprobs
            if event.finish_reason is not None:
                self._finish(index, event)
        choices = []
        for i in sorted(self.texts):
            content, calls = self._split(self.texts[i])
            choices.append(responses.Choice(content, self.finals[i].finish_reason,
                                            self._logprobs(tuple(logprobs[i])), tuple(calls)))
        tokens, metrics = self._totals()
        return JSONResponse(responses.response(self.id, self.parsed.chat, self.model, choices, self.prompt_tokens,
                                               tokens, metrics))

    async def _next_or_disconnect(self, request: Request) -> Event | None:
        """The next event, or None once the client is gone: asked at least every DISCONNECT_POLL_S, also while
        events keep coming (a step hands one out every few milliseconds)."""
        if time.monotonic() - self.checked > DISCONNECT_POLL_S:
            self.checked = time.monotonic()
            if await request.is_disconnected():
                return None
        get = asyncio.ensure_future(self.events.get())
        while True:
            done, _ = await asyncio.wait([get], timeout=DISCONNECT_POLL_S)
            if done:
                return get.result()
            self.checked = time.monotonic()
            if await request.is_disconnected():
                get.cancel()
                return None
