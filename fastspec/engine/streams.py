"""An engine's streams: one at a time (two would share the drafter's and `abort`'s request ids), and closed at exit
while the interpreter is whole if a script left one open (left to its last collection, torch aborted the process:
an internal assert in THPVariable_clear, exit status 134)."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Iterator

from fastspec.errors import FastspecError

OPEN_STREAMS = weakref.WeakSet()  # every stream `one_at_a_time` handed out, not yet finished or closed


def one_at_a_time(lock: threading.Lock, steps: Iterator) -> Iterator:
    """`steps`, run while holding `lock` (the engine's); taken already: a FastspecError at the first step."""
    guarded = _holding(lock, steps)
    OPEN_STREAMS.add(guarded)
    return guarded


def _holding(lock: threading.Lock, steps: Iterator) -> Iterator:
    if not lock.acquire(blocking=False):
        raise FastspecError("this LLM is already running a generate or stream (another thread's, or a stream not yet "
                            "finished or closed): it runs one at a time; close() the stream, or give each thread an "
                            "LLM of its own")
    try:
        yield from steps
    finally:
        lock.release()


@atexit.register
def close_open_streams() -> None:
    """Close, at exit, the streams still open (one another thread is running is left to it)."""
    for steps in list(OPEN_STREAMS):
        if not steps.gi_running:
            steps.close()
