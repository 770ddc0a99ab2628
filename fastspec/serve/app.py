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

from fastspec.errors import BadField, FastspecError
from fastspec.sampling.grammar import grammar_kind
from fastspec.sampling.params import SamplingParams
from fastspec.serve import protocol as api
from fastspec.serve import responses
from fastspec.serve.api_error import APIError
from fastspec.serve.body import parse_body
from fastspec.serve.lengths import PoolRefusals, check_length, default_length
from fastspec.serve.prometheus import CONTENT_TYPE
from fastspec.serve.protocol import ParsedRequest
from fastspec.serve.reply import Reply, error_response
from fastspec.serve.service import CALL_TIMEOUT_S, Checked, EngineService, Event
from fastspec.serve.tool_formats import needs_special_text
from fastspec.serve.tools import Tools, template_parser, writes_spaces


def build_app(service: EngineService, model_name: str, tool_parser: str | None = None) -> Starlette:
    """`tool_parser`: how answers carry tool calls (fastspec.serve.tools.PARSERS; None: as the chat template
    asks)."""
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "fastspec",
            "max_model_len": service.engine.worker.max_context_len}  # (created: when the server started)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> JSONResponse:  # (the openai client's models.retrieve)
        if request.path_params["model"] == model_name:
            return JSONResponse(card)
        return error_response(APIError(f"the model '{request.path_params['model']}' does not exist (this server "
                                       f"serves '{model_name}')", 404, param="model", code="model_not_found"))

    async def health(_: Request) -> Response:
        if service.healthy:
            return JSONResponse({"status": "ok", "open_requests": service.open_requests})
        return error_response(APIError(f"the engine has stopped: {service.error}", 503, kind="server_error"))

    async def flush_cache(_: Request) -> JSONResponse:  # SGLang's: empty the prefix cache
        try:
            await asyncio.to_thread(service.call, service.engine.flush_cache, "flush_cache", CALL_TIMEOUT_S)
        except APIError as e:  # (the engine stopped, stopped before running it or found no pause for it: a 503)
            return error_response(e)
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:  # Prometheus' text format (fastspec.serve.prometheus)
        if service.metrics is None:
            return error_response(APIError("this server keeps no metrics", 404, kind="not_found_error"))
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    tok = service.llm.tokenizer
    tool_text = _ToolText(tool_parser or template_parser(tok.chat_template), tok.special_tokens(), writes_spaces(tok))
    refusals = PoolRefusals()  # (the KV pool's refusals in the server's log: at most one line a minute)
    chat, text = (partial(_complete, service, model_name, tool_text, refusals, c) for c in (True, False))
    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", text, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/flush_cache", flush_cache, methods=["POST"]), Route("/metrics", metrics, methods=["GET"])]
    handlers = {HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.pool_refusals = refusals
    return app


@dataclass(frozen=True)
class _ToolText:
    """What tool calls need of the tokenizer, read once per server: the format answers carry calls in, the special
    tokens (text -> id) and whether it can write `, ` (fastspec.serve.tools.writes_spaces)."""

    parser: str
    specials: dict
    spaced: bool


async def _complete(service: EngineService, model_name: str, tool_text: _ToolText, refusals: PoolRefusals,
                    chat: bool, request: Request) -> Response:
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        parsed = api.parse_request(parse_body(await request.body()), chat, model_name)
        params, keep_special = parsed.params, False
        if parsed.logprobs or parsed.tools is not None or grammar_kind(params) is not None:
            await asyncio.to_thread(_read_token_bytes, service)  # (once; ~0.5 s for a large vocabulary)
        if parsed.tools is not None:
            await asyncio.to_thread(_check_schemas, service, parsed.tools)  # (compiles: a large schema is slow)
            tools = replace(parsed.tools, spaced=tool_text.spaced)
            tools, params, keep_special = _tool_grammar(tools, tool_text, params)
            parsed = replace(parsed, tools=tools)
        prompts = await asyncio.to_thread(_encode, service, parsed)  # (a long prompt: the other streams go on)
        lengths = [default_length(service.engine, parsed, params, ids) for ids in prompts]
        for i, (ids, p) in enumerate(zip(prompts, lengths)):
            check_length(service.engine, refusals, parsed, len(ids), p.max_new_tokens, None if len(prompts) == 1 else i)
        choices = [(ids, parsed.choice_params(p)) for ids, p in zip(prompts, lengths)]
        if len(prompts) * parsed.n > service.max_queued:
            raise APIError(f"{len(prompts) * parsed.n} choices: more than this server ever holds open "
                           f"(--max-queued-requests {service.max_queued})", param="n")
        checked = await asyncio.to_thread(_check_choices, service, choices, keep_special, parsed.chat)  # (grammars)
        if parsed.n > 1 and service.engine.config.radix_cache and params.prompt_logprobs is None:
            for ids, _ in choices:  # (a choice asking for prompt logprobs reads no cached prefix)
                await _cache_prompt(service, ids, params)
        rids = _submit_choices(service, checked, loop, events)
    except APIError as e:
        return error_response(e)
    echoes = None if not parsed.echo else [
        (p if isinstance(p, str) else service.llm.decode(ids), ids) for p, ids in zip(parsed.prompts, prompts)
        for _ in range(parsed.n)]
    reply = Reply(service, parsed, model_name, responses.new_id(chat), sum(map(len, prompts)), rids, events,
                  tool_text.parser, echoes)
    if parsed.stream:
        return StreamingResponse(reply.stream(), media_type="text/event-stream")
    return await reply.collect(request)


def _read_token_bytes(service: EngineService) -> None:
    """llguidance's reading of the tokenizer, which grammars and logprobs' token bytes use: built once, by the first
    request that needs it (others arriving meanwhile wait for it), here off the event loop (a FastspecError is said
    where it matters: a grammar's 400)."""
    try:
        service.engine.grammars.tokenizer
    except FastspecError:
        pass


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
        return tools, (params if schema is None else _held(params, json_schema=schema)), False
    keep_special = needs_special_text(tool_text.parser, tool_text.specials)
    if params.json_schema is not None or params.regex is not None or params.ebnf is not None:
        return replace(tools, held=False), params, keep_special
    return tools, _held(params, lark=tools.auto_grammar(tool_text.parser, tool_text.specials)), keep_special


def _held(params: SamplingParams, **grammar) -> SamplingParams:
    """The parameters with `auto` tools' grammar; refused with ignore_eos in the request's words (SamplingParams' own
    refusal would name a grammar the client never sent, and not as a 400; `required` / named: parse_request)."""
    if params.ignore_eos:
        raise APIError(api.IGNORE_EOS_WITH_TOOLS, param="ignore_eos")
    return replace(params, **grammar)


def _encode(service: EngineService, parsed: ParsedRequest) -> list[list[int]]:
    """Each prompt's token ids (a chat's one)."""
    try:
        if parsed.chat:
            offered = parsed.tools is not None and parsed.tools.choice != "none"
            return [service.llm.encode_chat(parsed.messages, list(parsed.tools.functions) if offered else None,
                                            parsed.add_generation_prompt, parsed.continue_final_message)]
        return [p if isinstance(p, list) else service.llm.encode(p) for p in parsed.prompts]
    except FastspecError as e:  # (a chat's flags and messages: BadField names the request's field)
        raise APIError(str(e), param=e.field if isinstance(e, BadField) else None) from None


def _check_choices(service: EngineService, choices: list[tuple[list[int], list[SamplingParams]]],
                   keep_special: bool, chat: bool) -> list[Checked]:
    """Each choice of each (prompt ids, each choice's params) pair checked by the service, its grammar compiled, in
    order (APIError 400 for the first that can never run): run off the event loop."""
    return [service.check(ids, p, keep_special, chat) for ids, params in choices for p in params]


def _submit_choices(service: EngineService, checked: list[Checked], loop, events: asyncio.Queue) -> list[int]:
    """The checked choices queued as engine requests, numbered in order; their events go into `events` as
    (choice index, Event). All or none."""
    rids = []
    try:
        for i, c in enumerate(checked):
            rids.append(service.enqueue(c, partial(_post, loop, events, i)))
    except APIError:
        for rid in rids:
            service.abort(rid)
        raise
    return rids


async def _cache_prompt(service: EngineService, prompt_ids: list[int], params) -> None:
    """Put the prompt's KV into the prefix cache with one one-token request, so that n choices admitted together
    share it instead of each computing it. It draws as the choices do (their temperature and top-k, which the
    engine took for them)."""
    loop = asyncio.get_running_loop()
    one = replace(params, max_new_tokens=1, seed=None, stop=(), logprobs=None, json_schema=None,
                  regex=None, ebnf=None, lark=None, ignore_eos=True)
    finished = asyncio.Queue()
    service.submit(prompt_ids, one, partial(_post, loop, finished, 0), counted=False)
    while (await finished.get())[1].finish_reason is None:
        pass


def _post(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int, event: Event) -> None:
    """From the engine thread into the request's queue (nothing to do if the server loop already closed)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, (index, event))
    except RuntimeError:
        pass


async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
    return error_response(APIError(e.detail or "not found", e.status_code, code=str(e.status_code)))


async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    return error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500, kind="server_error"))
