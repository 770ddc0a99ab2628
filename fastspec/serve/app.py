"""The HTTP side of `fastspec serve`: a Starlette app with OpenAI's routes over an EngineService.

/v1/chat/completions and /v1/completions (JSON, or server-sent events with `stream`), /v1/models, /health,
/metrics (Prometheus).
A streamed request whose client disconnects is aborted (its KV freed before the engine's next step); a plain
request is watched for a disconnect while it waits. Every error is OpenAI's error object.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fastspec.errors import FastspecError
from fastspec.serve import protocol as api
from fastspec.serve.metrics import CONTENT_TYPE
from fastspec.serve.protocol import APIError, ParsedRequest
from fastspec.serve.service import EngineService, Event

DISCONNECT_POLL_S = 0.25


def build_app(service: EngineService, model_name: str) -> Starlette:
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

    async def metrics(_: Request) -> Response:  # Prometheus' text format (fastspec.serve.metrics)
        if service.metrics is None:
            return _error(APIError("this server keeps no metrics", 404, kind="not_found_error"))
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    routes = [Route("/v1/chat/completions", partial(_complete, service, model_name, True), methods=["POST"]),
              Route("/v1/completions", partial(_complete, service, model_name, False), methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/flush_cache", flush_cache, methods=["POST"]), Route("/metrics", metrics, methods=["GET"])]
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _complete(service: EngineService, model_name: str, chat: bool, request: Request) -> Response:
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        parsed = api.parse_request(api.parse_body(await request.body()), chat, model_name)
        prompt_ids = _encode(service, parsed)
        params = parsed.params
        if not parsed.max_tokens_given:  # chat's default: the rest of the context, capped
            room = service.engine.worker.max_context_len - len(prompt_ids)
            params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)))
        rid = service.submit(prompt_ids, params, lambda e: _post(loop, events, e))
    except APIError as e:
        return _error(e)
    reply = _Reply(service, parsed, model_name, api.new_id(chat), len(prompt_ids), rid, events)
    if parsed.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    return await reply.collect(request)


def _encode(service: EngineService, parsed: ParsedRequest) -> list[int]:
    try:
        if parsed.chat:
            return service.llm.encode_chat(parsed.messages)
        return parsed.prompt if isinstance(parsed.prompt, list) else service.llm.encode(parsed.prompt)
    except FastspecError as e:
        raise APIError(str(e)) from None


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, event: Event) -> None:
    """From the engine thread into the request's queue (nothing to do if the server loop already closed)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, event)
    except RuntimeError:
        pass


class _Reply:
    def __init__(self, service, parsed: ParsedRequest, model: str, rid: str, prompt_tokens: int, engine_rid: int,
                 events: asyncio.Queue):
        self.service, self.parsed, self.model, self.id = service, parsed, model, rid
        self.prompt_tokens, self.engine_rid, self.events = prompt_tokens, engine_rid, events
        self.finished = False

    def _logprobs(self, event: Event) -> dict | None:
        if not self.parsed.logprobs or event.logprobs is None:
            return None
        text = lambda t: self.service.llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        return api.logprobs_object(self.parsed.chat, list(event.logprobs), text)

    async def stream(self):
        chat = self.parsed.chat
        try:
            if chat:
                yield api.sse(api.chunk(self.id, chat, self.model, None, None, role=True))
            while True:
                event: Event = await self.events.get()
                if event.error:  # the engine ended every open request already
                    self.finished = True
                    yield api.sse(APIError(event.error, 500, kind="server_error").body())
                    break
                logprobs = self._logprobs(event)
                if event.text or logprobs:
                    yield api.sse(api.chunk(self.id, chat, self.model, event.text, None, logprobs))
                if event.finish_reason is not None:
                    self.finished = True
                    yield api.sse(api.chunk(self.id, chat, self.model, None, event.finish_reason))
                    if self.parsed.include_usage:
                        yield api.sse(api.usage_chunk(self.id, chat, self.model, self.prompt_tokens,
                                                      event.completion_tokens, event.metrics))
                    break
            yield api.sse("[DONE]")
        finally:  # the client went away (the task is cancelled) or the stream ended
            if not self.finished:
                self.service.abort(self.engine_rid)

    async def collect(self, request: Request) -> Response:
        text, logprobs = [], []
        while True:
            event = await self._next_or_disconnect(request)
            if event is None:
                self.service.abort(self.engine_rid)
                return Response(status_code=499)  # nobody reads it
            if event.error:
                return _error(APIError(event.error, 500, kind="server_error"))
            text.append(event.text)
            if event.logprobs is not None:
                logprobs += event.logprobs
            if event.finish_reason is not None:
                break
        lp = self._logprobs(replace(event, logprobs=tuple(logprobs))) if self.parsed.logprobs else None
        return JSONResponse(api.response(self.id, self.parsed.chat, self.model, "".join(text), event.finish_reason,
                                         self.prompt_tokens, event.completion_tokens, event.metrics, lp))

    async def _next_or_disconnect(self, request: Request) -> Event | None:
        get = asyncio.ensure_future(self.events.get())
        while True:
            done, _ = await asyncio.wait([get], timeout=DISCONNECT_POLL_S)
            if done:
                return get.result()
            if await request.is_disconnected():
                get.cancel()
                return None


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    return _error(APIError(e.detail or "not found", e.status_code, code=str(e.status_code)))


async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    return _error(APIError(f"internal error: {type(e).__name__}: {e}", 500, kind="server_error"))
