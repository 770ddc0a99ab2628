"""The HTTP side of `fastspec serve`: a Starlette app with OpenAI's routes over an EngineService.

/v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream`), /v1/models, /health,
/metrics (Prometheus).
A streamed request whose client disconnects is aborted (its KV freed before the engine's next step); a plain
request is watched for a disconnect while it waits. Every error is OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fastspec.errors import FastspecError
from fastspec.sampling.params import SamplingParams
from fastspec.serve import protocol as api
from fastspec.serve import responses
from fastspec.serve.api_error import APIError
from fastspec.serve.prometheus import CONTENT_TYPE
from fastspec.serve.protocol import ParsedRequest
from fastspec.serve.service import EngineService, Event
from fastspec.serve.tool_formats import needs_special_text
from fastspec.serve.tool_stream import ToolStream
from fastspec.serve.tools import Tools, parse_output, template_parser, writes_spaces

DISCONNECT_POLL_S = 0.25


def build_app(service: EngineService, model_name: str, tool_parser: str | None = None) -> Starlette:
    """`tool_parser`: how answers carry tool calls (fastspec.serve.tools.PARSERS; None: as the chat template
    asks)."""
    ctx = service.engine.worker.max_context_len

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "fastspec", "max_model_len": ctx}]})

    async def health(_: Request) -> Response:
        if service.healthy:
            return JSONResponse({"status": "ok", "open_requests": service.open_requests})
        return _error(APIError(f"the engine has stopped: {service.error}", 503, kind="server_error"))

    async def flush_cache(_: Request) -> JSONResponse:  # SGLang's: empty the prefix cache
        await asyncio.to_thread(service.call, service.engine.flush_cache)
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:  # Prometheus' text format (fastspec.serve.prometheus)
        if service.metrics is None:
            return _error(APIError("this server keeps no metrics", 404, kind="not_found_error"))
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    tok = service.llm.tokenizer
    tool_text = _ToolText(tool_parser or template_parser(tok.chat_template), tok.special_tokens(), writes_spaces(tok))
    chat, text = (partial(_complete, service, model_name, tool_text, c) for c in (True, False))
    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", text, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/flush_cache", flush_cache, methods=["POST"]), Route("/metrics", metrics, methods=["GET"])]
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)


@dataclass(frozen=True)
class _ToolText:
    """What tool calls need of the tokenizer, read once per server: the format answers carry calls in, the special
    tokens (text -> id) and whether it can write `, ` (fastspec.serve.tools.writes_spaces)."""

    parser: str
    specials: dict
    spaced: bool


async def _complete(service: EngineService, model_name: str, tool_text: _ToolText, chat: bool,
                    request: Request) -> Response:
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        parsed = api.parse_request(api.parse_body(await request.body()), chat, model_name)
        params, keep_special = parsed.params, False
        if parsed.tools is not None:
            _check_schemas(service, parsed.tools)
            tools = replace(parsed.tools, spaced=tool_text.spaced)
            tools, params, keep_special = _tool_grammar(tools, tool_text, params)
            parsed = replace(parsed, tools=tools)
        prompt_ids = _encode(service, parsed)
        if not parsed.max_tokens_given:  # chat's default: the rest of the context, capped
            room = service.engine.worker.max_context_len - len(prompt_ids)
            params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)))
        if parsed.n > 1 and service.engine.config.radix_cache:
            await _cache_prompt(service, prompt_ids, params)
        rids = _submit_choices(service, prompt_ids, parsed.choice_params(params), loop, events, keep_special)
    except APIError as e:
        return _error(e)
    reply = _Reply(service, parsed, model_name, responses.new_id(chat), len(prompt_ids), rids, events, tool_text.parser)
    if parsed.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    return await reply.collect(request)


def _check_schemas(service: EngineService, tools: Tools) -> None:
    """Every tool's parameters compile to a grammar (a tool the model may call must be one it can be held to)."""
    for name, schema in tools.schemas.items():
        try:
            service.engine.grammars.compile(SamplingParams(json_schema=json.dumps(schema)))
        except FastspecError as e:
            raise APIError(f"tool {name!r}: {e}", param="tools") from None


def _tool_grammar(tools: Tools, tool_text: _ToolText, params: SamplingParams) -> tuple[Tools, SamplingParams, bool]:
    """The parameters with the choice's grammar: `required` / named, the calls' JSON schema (spaced as the
    tokenizer can); `auto`, the format's lazy grammar unless the request brings its own (the tools then say that
    no grammar holds the answer to the format: calls are read from free text). And whether the answer's text must
    keep special tokens for the parser to see its markers."""
    if tools.choice != "auto":
        schema = tools.grammar()
        return tools, (params if schema is None else replace(params, json_schema=schema)), False
    keep_special = needs_special_text(tool_text.parser, tool_text.specials)
    if params.json_schema is not None or params.regex is not None or params.ebnf is not None:
        return replace(tools, held=False), params, keep_special
    return tools, replace(params, lark=tools.auto_grammar(tool_text.parser, tool_text.specials)), keep_special


def _encode(service: EngineService, parsed: ParsedRequest) -> list[int]:
    try:
        if parsed.chat:
            offered = parsed.tools is not None and parsed.tools.choice != "none"
            return service.llm.encode_chat(parsed.messages, list(parsed.tools.functions) if offered else None)
        return parsed.prompt if isinstance(parsed.prompt, list) else service.llm.encode(parsed.prompt)
    except FastspecError as e:
        raise APIError(str(e)) from None


def _submit_choices(service: EngineService, prompt_ids: list[int], params: list, loop, events: asyncio.Queue,
                    keep_special: bool = False) -> list[int]:
    """One engine request per choice; their events go into `events` as (choice index, Event). All or none."""
    rids = []
    try:
        for i, p in enumerate(params):
            rids.append(service.submit(prompt_ids, p, partial(_post, loop, events, i), keep_special))
    except APIError:
        for rid in rids:
            service.abort(rid)
        raise
    return rids


async def _cache_prompt(service: EngineService, prompt_ids: list[int], params) -> None:
    """Put the prompt's KV into the prefix cache with one one-token request, so that n choices admitted together
    share it instead of each computing it."""
    loop = asyncio.get_running_loop()
    one = replace(params, max_new_tokens=1, temperature=0.0, seed=None, stop=(), logprobs=None, json_schema=None,
                  regex=None, ebnf=None, lark=None, ignore_eos=True)
    finished = asyncio.Queue()
    service.submit(prompt_ids, one, partial(_post, loop, finished, 0))
    while (await finished.get())[1].finish_reason is None:
        pass


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, event: Event) -> None:
    """From the engine thread into the request's queue (nothing to do if the server loop already closed)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, (index, event))
    except RuntimeError:
        pass


class _Reply:
    """The response to one request of n choices: each choice's events arrive as (index, Event). With tools, text
    that may be a tool call is held back while streaming and the finished text is parsed into tool calls."""

    def __init__(self, service, parsed: ParsedRequest, model: str, rid: str, prompt_tokens: int,
                 engine_rids: list[int], events: asyncio.Queue, tool_parser: str | None = None):
        self.service, self.parsed, self.model, self.id = service, parsed, model, rid
        self.prompt_tokens, self.engine_rids, self.events = prompt_tokens, engine_rids, events
        self.tool_parser = tool_parser
        self.open = set(range(len(engine_rids)))  # choices not finished
        self.finals: dict[int, Event] = {}  # choice -> its last event
        self.texts = {i: "" for i in self.open}  # choice -> its text so far
        self.streams = {i: ToolStream(parsed.tools, tool_parser) for i in self.open}  # what each choice streamed
        self.checked = time.monotonic()  # when the client was last asked whether it is still there

    def _logprobs(self, entries: tuple | None) -> dict | None:
        if not self.parsed.logprobs or entries is None:
            return None
        text = lambda t: self.service.llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        return responses.logprobs_object(self.parsed.chat, list(entries), text)

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
        self.texts[index], logprobs = full, self._logprobs(event.logprobs)
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
                if event.error:  # the engine ended every open request already
                    self.open.clear()
                    failed = True
                    yield responses.sse(APIError(event.error, 500, kind="server_error").body())
                    break
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
                return _error(APIError(event.error, 500, kind="server_error"))
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


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    return _error(APIError(e.detail or "not found", e.status_code, code=str(e.status_code)))


async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    return _error(APIError(f"internal error: {type(e).__name__}: {e}", 500, kind="server_error"))
