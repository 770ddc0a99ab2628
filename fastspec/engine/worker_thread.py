"""The worker's thread: under the overlap schedule what the engine submits to the worker (steps, releases, flushes)
runs in a thread of its own, in order, while the engine hands out the last step; without overlap it runs at once in
the caller's thread. Knows nothing of requests or scheduling: the engine (fastspec.engine.engine) decides what to
submit and when.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor, wait

from fastspec.engine.worker import Worker


class WorkerThread:
    def __init__(self, worker: Worker, overlap: bool):
        self.worker = worker
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fastspec-worker") if overlap else None
        self._last: Future | None = None  # the last thing submitted (a step or a release)

    def submit(self, fn, *args) -> Future:
        """Run `fn` in the worker's thread under overlap (in order, after what was submitted before), else now. At
        exit (fastspec.engine.streams) the interpreter has already run the thread's last task and ended it: now."""
        future = None
        if self._thread is not None:
            with contextlib.suppress(RuntimeError):  # (only "cannot schedule new futures after ... shutdown")
                future = self._thread.submit(fn, *args)
        if future is None:
            future = Future()
            future.set_result(fn(*args))
        self._last = future
        return future

    def result(self, step: Future, last: bool):
        """A step's StepResult. A round the worker launched ahead is finished by the next step it runs: when
        `step` is the `last` one submitted, the worker is asked to finish it (a flush) instead."""
        result = step.result()
        if isinstance(result, Future):
            if last and not result.done():
                self.submit(self.worker.flush)
            result = result.result()
        return result

    def drain(self, raise_errors: bool = True) -> None:
        """Wait for everything submitted to the worker's thread (steps and releases, run in order), the round
        it launched ahead finished."""
        if self._thread is not None:
            self.submit(self.worker.flush)
        if self._last is not None:
            wait([self._last])
            if raise_errors:
                self._last.result()
