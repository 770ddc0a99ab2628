"""An engine's runs, one at a time: a stream (LLM.generate / stream / chat, Engine.generate) or a server's loop for
as long as it serves (two would share the drafter's and `abort`'s request ids, and step one engine from two
threads); and the engine's other calls while a run holds it: a change to the engine is refused (`between_runs`),
what a server's thread may do between its steps is routed there (`server_route`). Streams are
closed at exit while the interpreter is whole if a script left one open (left to its last collection, torch
aborted the process: an internal assert in THPVariable_clear, exit status 134)."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

from fastspec.errors import FastspecError

OPEN_STREAMS = weakref.WeakSet()  # every stream `OneRun.stream` handed out, not yet finished or closed
BUSY = ("this LLM is already running a generate or stream (another thread's, or a stream not yet finished or closed): "
        "it runs one at a time; close() the stream, or give each thread an LLM of its own")
SERVED = "this LLM is being served: send requests to the server, or give this code an LLM of its own"
SERVED_ABORT = "this LLM is being served: its requests end when their clients go away, not by abort"


class OneRun:
    """Who runs the engine now. Another run while one holds it is a FastspecError at its first step, saying
    whether a stream or a server holds it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._served = False  # the holder is a server's loop
        self._holder: int | None = None  # the thread running the holder's steps (a server's: its engine thread)
        self._call: Callable | None = None  # a server's call(fn): fn run by its engine thread between two steps

    def stream(self, steps: Iterator) -> Iterator:
        """`steps` run as a stream: closed at exit if still open."""
        guarded = self._holding(steps)
        OPEN_STREAMS.add(guarded)
        return guarded

    def serve(self, steps: Iterator, call: Callable) -> Iterator:
        """`steps` run as a server's loop, which holds the engine until it stops (its thread stops it: not closed at
        exit); `call(fn)` runs fn on that thread between two steps and returns its result (`server_route`)."""
        return self._holding(steps, call)

    def _holding(self, steps: Iterator, call: Callable | None = None) -> Iterator:
        if not self._lock.acquire(blocking=False):
            raise FastspecError(SERVED if self._served else BUSY)
        self._served, self._holder, self._call = call is not None, threading.get_ident(), call
        try:
            yield from steps
        finally:
            self._served, self._holder, self._call = False, None, None
            self._lock.release()

    def server_route(self) -> Callable | None:
        """While a server holds the engine, for a thread other than its engine thread: the server's call(fn), which
        runs fn there between two steps; else None (run it here)."""
        call = self._call
        return call if call is not None and self._holder != threading.get_ident() else None

    @contextlib.contextmanager
    def between_runs(self, what: str):
        """Change the engine (`what`: its policy, its tree shapes) with no run holding it, and none starting
        meanwhile; a FastspecError while one holds it."""
        if not self._lock.acquire(blocking=False):
            held = "this LLM is being served" if self._served else "this LLM is running a generate or stream"
            raise FastspecError(f"{held}: {what} may change only between runs (stop the server, or close the "
                                "stream, first)")
        try:
            yield
        finally:
            self._lock.release()


@atexit.register
def close_open_streams() -> None:
    """Close, at exit, the streams still open (one another thread is running is left to it)."""
    for steps in list(OPEN_STREAMS):
        if not steps.gi_running:
            steps.close()
