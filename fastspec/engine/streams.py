"""An engine's runs, one at a time: a stream (LLM.generate / stream / chat, Engine.generate) or a server's loop for
as long as it serves (two would share the drafter's and `abort`'s request ids, and step one engine from two
threads); and the engine's other calls while a run holds it: a change to the engine is refused (`between_runs`),
a call from another thread is run by the server's thread at its next safe point or refused during another thread's
stream (`call`), and aborts are taken by the run's next step from any thread but a server's, or by a stream handed
out and not started yet at its first step (`abort`). A stream's own thread is the one that last stepped it. Streams
are closed at exit while the interpreter is whole if a script left one open (left to its last collection, torch
aborted the process: an internal assert in THPVariable_clear, exit status 134)."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from fastspec.errors import FastspecError, RunEnded

OPEN_STREAMS = weakref.WeakSet()  # every stream `OneRun.stream` handed out, not yet finished or closed
BUSY = ("this LLM is already running a generate or stream (another thread's, or a stream not yet finished or closed): "
        "it runs one at a time; close() the stream, or give each thread an LLM of its own")
SERVED = "this LLM is being served: send requests to the server, or give this code an LLM of its own"
SERVED_ABORT = "this LLM is being served: its requests end when their clients go away, not by abort"


class OneRun:
    """Who runs the engine now. Another run while one holds it is a FastspecError at its first step, saying
    whether a stream or a server holds it."""

    def __init__(self):
        self._lock = threading.Lock()  # held by the run holding the engine, from its first step to its end
        self._state = threading.RLock()  # the fields below, read and written by several threads
        self._served = False  # the holder is a server's loop
        self._holder: int | None = None  # the thread running the holder's steps (a server's: its engine thread)
        self._wake: Callable | None = None  # a server's wake(): its loop's waiting poll returns
        self._calls: deque[tuple[Callable, Future, str]] = deque()  # other threads' calls: a server's next safe point
        self._aborted: set[int] = set()  # request ids `abort` named, taken by the run's next step
        self._pending = weakref.WeakSet()  # _Pending of the streams handed out and not started yet

    def stream(self, steps: Iterator) -> Iterator:
        """`steps` run as a stream: closed at exit if still open; aborts named before its first step are its own."""
        pending = _Pending()
        with self._state:
            self._pending.add(pending)
        guarded = self._holding(steps, pending=pending)
        OPEN_STREAMS.add(guarded)
        return guarded

    def serve(self, steps: Iterator, wake: Callable) -> Iterator:
        """`steps` run as a server's loop, which holds the engine until it stops (its thread stops it: not closed at
        exit); `wake()` makes its poll return when another thread's `call` waits for its next safe point."""
        return self._holding(steps, wake)

    def _holding(self, steps: Iterator, wake: Callable | None = None, pending: _Pending | None = None) -> Iterator:
        with self._state:
            if pending is not None:
                self._pending.discard(pending)
            if not self._lock.acquire(blocking=False):
                raise FastspecError(SERVED if self._served else BUSY)
            self._served, self._holder, self._wake = wake is not None, threading.get_ident(), wake
            self._aborted = set() if pending is None else pending.aborted
        try:
            with contextlib.closing(steps):  # (its own end hands the KV back, before another run may start)
                for step in steps:
                    yield step
                    with self._state:  # resumed: this thread steps it now (a stream may move to another thread)
                        self._holder = threading.get_ident()
        finally:
            with self._state:
                self._served, self._holder, self._wake = False, None, None
                self._aborted = set()  # (named for this run, too late for any step)
                left, self._calls = self._calls, deque()
                self._lock.release()
            for _, done, what in left:
                if done.set_running_or_notify_cancel():  # (not cancelled by its caller, who stopped waiting)
                    done.set_exception(RunEnded(f"the server stopped before running {what}"))

    def call(self, fn: Callable, what: str) -> Future:
        """fn() with no step running meanwhile, as a Future of its result: here between runs (none starts until it
        returns) or between the steps of this thread's own run (the thread that last stepped it); from another
        thread, a server's run queues it for its thread's next safe point (`run_calls`; RunEnded if the server stops
        first; a caller that stops waiting may cancel() it until it starts), another thread's stream refuses it (a
        FastspecError naming `what`: a stream steps only when its consumer asks, a wait could be forever)."""
        done = Future()
        with self._state:
            if self._holder in (None, threading.get_ident()):
                _run_into(done, fn)
                return done
            if not self._served:
                raise FastspecError(f"this LLM is running a generate or stream in another thread: {what} runs "
                                    "between runs, or in the thread running it")
            entry = (fn, done, what)
            self._calls.append(entry)
            wake = self._wake
        done.add_done_callback(lambda _: self._drop_cancelled(entry))
        wake()
        return done

    def _drop_cancelled(self, entry: tuple) -> None:
        """A queued call's caller cancelled it (it stopped waiting): out of the queue now, not at the next safe point
        (a stalled server would pile up its callers' retries, and a waiting call keeps the next round from running
        ahead)."""
        if entry[1].cancelled():
            with self._state:
                with contextlib.suppress(ValueError):  # (taken already: run_calls, or the run's end, skips it)
                    self._calls.remove(entry)

    @property
    def calls_waiting(self) -> bool:
        return bool(self._calls)

    def run_calls(self) -> None:
        """Run the calls other threads queued (`call`): the holder's thread, at a safe point."""
        while True:
            with self._state:
                if not self._calls:
                    return
                fn, done, _ = self._calls.popleft()
            _run_into(done, fn)

    def abort(self, rid: int) -> None:
        """Name request `rid` for the run's next step to abort (from any thread: a stream's consumer, a signal's
        handler, a watchdog); with no run holding the engine, for the first step of every stream handed out and not
        started yet (none: a no-op). A server's requests are its own (a FastspecError from another thread)."""
        with self._state:
            if self._served and self._holder != threading.get_ident():
                raise FastspecError(SERVED_ABORT)
            for aborted in [self._aborted] if self._holder is not None else [p.aborted for p in self._pending]:
                aborted.add(rid)

    def take_aborts(self) -> set[int]:
        """The request ids named since the last take (the holder's thread, before a step)."""
        with self._state:
            aborted, self._aborted = self._aborted, set()
        return aborted

    @contextlib.contextmanager
    def between_runs(self, what: str):
        """Change the engine (`what`: its policy, its tree shapes) with no run holding it, and none starting nor any
        `call` running meanwhile; a FastspecError while one holds it."""
        with self._state:
            if not self._lock.acquire(blocking=False):
                held = "this LLM is being served" if self._served else "this LLM is running a generate or stream"
                raise FastspecError(f"{held}: {what} may change only between runs (stop the server, or close the "
                                    "stream, first)")
            try:
                yield
            finally:
                self._lock.release()


class _Pending:
    """A stream handed out and not started yet: the request ids aborted meanwhile (its first step takes them)."""

    __slots__ = ("aborted", "__weakref__")

    def __init__(self):
        self.aborted: set[int] = set()


def _run_into(done: Future, fn: Callable) -> None:
    if not done.set_running_or_notify_cancel():  # its caller stopped waiting and cancelled it: it never runs
        return
    try:
        done.set_result(fn())
    except Exception as e:
        done.set_exception(e)


@atexit.register
def close_open_streams() -> None:
    """Close, at exit, the streams still open (one another thread is running is left to it)."""
    for steps in list(OPEN_STREAMS):
        if not steps.gi_running:
            steps.close()
