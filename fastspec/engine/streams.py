"""An engine's runs, one at a time: a stream (LLM.generate / stream / chat, Engine.generate) or a server's loop for
as long as it serves (two would share the drafter's and `abort`'s request ids, and step one engine from two
threads). Streams are closed at exit while the interpreter is whole if a script left one open (left to its last
collection, torch aborted the process: an internal assert in THPVariable_clear, exit status 134)."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Iterator

from fastspec.errors import FastspecError

OPEN_STREAMS = weakref.WeakSet()  # every stream `OneRun.stream` handed out, not yet finished or closed
BUSY = ("this LLM is already running a generate or stream (another thread's, or a stream not yet finished or closed): "
        "it runs one at a time; close() the stream, or give each thread an LLM of its own")
SERVED = "this LLM is being served: send requests to the server, or give this code an LLM of its own"


class OneRun:
    """Who runs the engine now. Another run while one holds it is a FastspecError at its first step, saying
    whether a stream or a server holds it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._served = False  # the holder is a server's loop

    def stream(self, steps: Iterator) -> Iterator:
        """`steps` run as a stream: closed at exit if still open."""
        guarded = self._holding(steps, served=False)
        OPEN_STREAMS.add(guarded)
        return guarded

    def serve(self, steps: Iterator) -> Iterator:
        """`steps` run as a server's loop, which holds the engine until it stops (its thread stops it: not closed at
        exit)."""
        return self._holding(steps, served=True)

    def _holding(self, steps: Iterator, served: bool) -> Iterator:
        if not self._lock.acquire(blocking=False):
            raise FastspecError(SERVED if self._served else BUSY)
        self._served = served
        try:
            yield from steps
        finally:
            self._served = False
            self._lock.release()


@atexit.register
def close_open_streams() -> None:
    """Close, at exit, the streams still open (one another thread is running is left to it)."""
    for steps in list(OPEN_STREAMS):
        if not steps.gi_running:
            steps.close()
