"""`fastspec serve`: the OpenAI HTTP API over one engine (protocol.py: the API's values; service.py: the engine on
its own thread; app.py: the routes). `bind` takes the port before the model loads, `serve` runs until Ctrl-C."""

from __future__ import annotations

import socket

from fastspec.errors import FastspecError


def bind(host: str, port: int) -> socket.socket:
    """The listening address, taken now (a port in use is a one-line error before the model loads)."""
    if not 0 <= port <= 65535:
        raise FastspecError(f"--port must be in [0, 65535], got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise FastspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def make_server(llm, model_name: str, max_queued: int, tool_parser: str | None = None):
    """(uvicorn.Server, EngineService started) for `llm`; run with `server.run(sockets=[sock])`."""
    import asyncio

    import uvicorn

    from fastspec.serve.app import build_app
    from fastspec.serve.prometheus import ServerMetrics
    from fastspec.serve.service import EngineService

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            """The engine stops first and every open request ends with a 503 (a stream: an error event), so
            uvicorn's graceful wait finds nothing to wait for or cancel."""
            await asyncio.to_thread(service.stop)
            await super().shutdown(sockets)

    service = EngineService(llm, max_queued, ServerMetrics(model_name, llm.engine)).start()
    config = uvicorn.Config(build_app(service, model_name, tool_parser), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5)
    return Server(config), service


def serve(llm, sock: socket.socket, model_name: str, max_queued: int, tool_parser: str | None = None,
          on_ready=None) -> None:
    """Serve `llm` on the bound `sock` until interrupted; the engine thread stops with the server."""
    server, service = make_server(llm, model_name, max_queued, tool_parser)
    if on_ready is not None:
        host, port = sock.getsockname()[:2]
        on_ready(f"http://{host}:{port}")
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
