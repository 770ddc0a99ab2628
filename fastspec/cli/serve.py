"""`fastspec serve`: the OpenAI-compatible server (fastspec.serve) with every model / engine / speculative flag."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from fastspec.cli.options import ModelOptions


def serve(
    options: ModelOptions,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 30000,
    served_model_name: Annotated[Optional[str], typer.Option(help="The model name clients send (default: --model).")]
    = None,
    max_queued_requests: Annotated[int, typer.Option(help="Open requests (waiting + running) past which a new one "
                                                          "gets a 503.")] = 256,
    tool_call_parser: Annotated[Optional[str], typer.Option(help="How answers carry tool calls: hermes (Hermes, "
                                                                 "Qwen) | llama3 | mistral | pythonic (Llama 3.2 / 4) "
                                                                 "| deepseek_v3 (default: as the chat template "
                                                                 "asks).")] = None,
):
    """Serve the model over the OpenAI HTTP API: /v1/chat/completions (tool calls too), /v1/completions, /v1/models,
    /health, /metrics."""
    from fastspec.llm import LLM
    from fastspec.serve import bind
    from fastspec.serve import serve as run

    sock = bind(host, port)  # before the model loads: a port in use fails at once
    llm = LLM(**options.llm_kwargs())
    name = served_model_name or options.model
    run(llm, sock, name, max_queued_requests, tool_call_parser,
        on_ready=lambda url: typer.echo(f"fastspec serve: {name} on {url}/v1 (Ctrl-C stops)", err=True))


def check_flags(max_queued_requests: int, tool_call_parser: str | None, **_) -> None:
    """serve's own flags, checked with the shared ones (before torch is imported: a bad flag answers at once)."""
    from fastspec.errors import FastspecError
    from fastspec.serve.tool_formats import FORMATS

    if max_queued_requests < 1:
        raise FastspecError(f"--max-queued-requests must be >= 1, got {max_queued_requests}")
    if tool_call_parser is not None and tool_call_parser not in FORMATS:
        raise FastspecError(f"--tool-call-parser must be one of {', '.join(FORMATS)}, got {tool_call_parser!r}")


serve.check_flags = check_flags
