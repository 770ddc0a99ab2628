"""The engine: continuous batching over a worker (fastspec.engine.worker), which owns the models, the KV pool and the
round functions. Each step admits what fits, preempts what must wait, launches a worker step (a prefill chunk
or a decode round), hands out what each request produced and releases the requests that finished. With the
overlap schedule the worker runs in a thread of its own (fastspec.engine.worker_thread), one decode round ahead of
the hand-out, and launches each round on the device before reading the last (see `stream`).
Tokenisation stays outside (fastspec.llm); the engine speaks token ids.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from fastspec.config import EngineConfig
from fastspec.engine.intake import Intake
from fastspec.engine.outputs import EngineLoad, GenerateOutput, StepOutput, collect
from fastspec.engine.scheduler import Request, Scheduler
from fastspec.engine.streams import OneRun
from fastspec.engine.worker import Worker
from fastspec.engine.worker_thread import WorkerThread
from fastspec.models.sources import ModelSources
from fastspec.sampling.params import SamplingParams
from fastspec.spec_config import SpecConfig


class Engine:
    def __init__(self, config: EngineConfig, spec: SpecConfig | None = None, on_prepare=None,
                 sources: ModelSources | None = None):
        """on_prepare(graph_name, bucket) is called before each graph bucket is captured / compiled; `sources`: the
        models as start-up resolved them (see Worker)."""
        self.worker = Worker(config, spec, on_prepare, sources)
        self.config = config = self.worker.config  # its `auto` choices made
        self.preemptions = 0  # requests taken out of a running batch to make room (recomputed later)
        self.overlap = config.overlap
        self.thread = WorkerThread(self.worker, self.overlap)  # under overlap its own, else the caller's
        self._free_before = 0  # free KV in the pool before the step in flight (after the last one handed out)
        self._runs = OneRun()  # a stream or a server's loop, one at a time (see `run`), and the aborts it takes
        self.load = EngineLoad(0, 0, self.worker.available_kv())
        self.intake = Intake(self.worker, config.page_size)  # a request's checks before it runs

    # what the worker owns, read by the front ends, the tuner and the tests
    model_dir = property(lambda self: self.worker.model_dir)
    model = property(lambda self: self.worker.model)
    feature = property(lambda self: self.worker.feature)
    pool = property(lambda self: self.worker.pool)
    allocator = property(lambda self: self.worker.allocator)
    drafter = property(lambda self: self.worker.drafter)
    drafters = property(lambda self: self.worker.drafters)
    spec = property(lambda self: self.worker.spec)
    times = property(lambda self: self.worker.times)
    grammars = property(lambda self: self.intake.grammars)  # structured output

    @property
    def policy(self):
        return self.worker.policy

    @policy.setter
    def policy(self, policy) -> None:  # tests drive the fallback with a scripted policy
        with self._runs.between_runs("its speculation policy"):
            self.worker.use_policy(policy)

    def use_schedule(self, schedule, on_prepare=None) -> None:
        """Switch to per-batch-size tree shapes between runs (`fastspec tune` tries candidates this way): a run
        plans each round's KV with the shapes it started with."""
        with self._runs.between_runs("its tree shapes"):
            self.worker.use_schedule(schedule, on_prepare)

    def check_kv(self, running: list[Request] = ()) -> None:
        """Leak check: free slots + slots held by `running` and the prefix cache == capacity (AssertionError
        otherwise), as `call` runs it: under overlap in the worker's thread, after what was submitted before."""
        self.call(lambda: self.thread.submit(self.worker.check_kv, running).result(), "check_kv").result()

    def call(self, fn: Callable, what: str = "the call") -> Future:
        """fn() with no step running meanwhile, as a Future of its result (OneRun.call): from another thread while
        a server runs, run by its thread at the next safe point (`_run_calls`: no round in flight)."""
        return self._runs.call(fn, what)

    def flush_cache(self) -> None:
        """Empty the prefix cache (its unlocked entries' slots go back to the allocator), as `call` runs it; under
        overlap in the worker's thread, after what was submitted before and the round launched ahead finished
        (both may hand KV to the cache)."""
        self.call(lambda: self.thread.submit(self.worker.flush_cache).result(), "flush_cache").result()

    # ---- public API -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerateOutput]:
        with contextlib.closing(self.stream(prompts, params)) as steps:  # (however it ends: the KV and lock back)
            got = collect(steps, params)
        return [GenerateOutput(list(p), got.ids[i], got.final[i].finish_reason, got.final[i].metrics, got.logprobs[i],
                               got.prompt_logprobs[i]) for i, p in enumerate(prompts)]

    def stream(self, prompts: list[list[int]], params: list[SamplingParams]) -> Iterator[list[StepOutput]]:
        """Continuous batching; yields, after every prefill or decode step, the requests that progressed. The
        requests are checked here (a FastspecError now, not at the first step). The caller (between yields) or
        another thread may `abort(index)` a request (a stop string, a closed terminal, Ctrl-C), also before the
        first step: it ends at the next step.

        With the overlap schedule, the next decode round is launched (in the worker's thread) before the
        previous one's tokens are handed out, whenever that round needs nothing the previous one decides:
        no admission, no prefill, and KV for both rounds at their worst case (a round's headroom per request).
        The worker in turn launches that round on the device before it reads the previous one's accept result
        (fastspec.engine.overlap), so a request the previous round finished may run once more: its tokens are
        dropped, as an aborted one's are. Everything else waits for the round in flight (a drain) and runs as
        without overlap, so the output is the same token for token."""
        reqs = [self.request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        return self.run(reqs)

    def run(self, reqs: list[Request], poll: Callable[[bool], list[Request] | None] | None = None,
            wake: Callable | None = None) -> Iterator[list[StepOutput]]:
        """`stream` over Requests made by `request`; with `poll`, requests also arrive while it runs (a server):
        `poll(idle)` is called before every step and returns the requests that arrived (it may block while
        `idle`, nothing being left to run), or None to stop (what still runs is released); `wake()` makes a
        blocking poll return (another thread's `call` waits for the next safe point). Runs go one at a
        time: two would share the drafter's and `abort`'s request ids, so another while one is open (another
        thread's, a stream not yet finished or closed, or a server's: `poll`, held until it stops) is a
        FastspecError at its first step."""
        if poll is not None:
            return self._runs.serve(self._steps(reqs, poll), wake)
        return self._runs.stream(self._steps(reqs, None))

    def _steps(self, reqs: list[Request], poll) -> Iterator[list[StepOutput]]:
        scheduler = Scheduler(self.config.max_running_requests, self.config.page_size, self.worker.round_headroom())
        for r in reqs:
            scheduler.add(r)
        inflight = None  # (the running requests it was launched with, Future[StepResult]) under overlap
        try:
            while True:
                arrived = [] if poll is None else poll(inflight is None and scheduler.idle)
                if arrived is None:
                    break
                for r in arrived:
                    scheduler.add(r)
                if inflight is None and scheduler.idle:
                    if poll is None:
                        break
                    self._run_calls()
                    if not self.overlap:  # every release applied (under overlap: in the worker's thread)
                        self.load = EngineLoad(0, 0, self.worker.available_kv())
                    continue
                out = self._apply_aborts(scheduler)
                if inflight is not None and not self._may_run_ahead(scheduler, inflight[0]):
                    out += self._hand_out(scheduler, self.thread.result(inflight[1], last=True))
                    inflight = None
                if inflight is None:
                    self._run_calls()
                launched = self._launch(scheduler, ahead=inflight is not None)
                if inflight is not None:
                    out += self._hand_out(scheduler, self.thread.result(inflight[1], last=launched is None))
                inflight = launched
                if not self.overlap and inflight is not None:
                    out += self._hand_out(scheduler, self.thread.result(inflight[1], last=True))
                    inflight = None
                # free KV: read now with nothing in flight (under overlap once the worker's thread has applied the
                # releases: nothing runs then, so that wait is short), else as of the last hand-out
                if inflight is None:
                    self.thread.drain()
                    free = self.worker.available_kv()
                else:
                    free = self._free_before + self.worker.memory.room_to_grow
                self.load = EngineLoad(len(scheduler.running), len(scheduler.waiting), free)
                yield out
        finally:  # done, or the caller stopped iterating (an exception, a closed pipe): hand every slot back
            self.thread.drain(raise_errors=False)
            for r in scheduler.running:
                self.worker.release(r)
            self.load = EngineLoad(0, 0, self.worker.available_kv())  # (a stream left early read its last step's)

    def _launch(self, scheduler: Scheduler, ahead: bool):
        """Start the next step: a prefill chunk if a request is prefilling, else a decode round. Admission,
        preemption and the pool's growth read the allocator, so they run only with nothing in flight (`ahead`
        False)."""
        if not ahead:
            self.thread.drain()
            scheduler.admit(self.worker.available_kv())
            if not any(r.prefilling for r in scheduler.running):
                self._preempt_until_a_round_fits(scheduler)
            # what is admitted counts from now, not once the step is done (a long prefill read 0 running)
            self.load = EngineLoad(len(scheduler.running), len(scheduler.waiting), self.load.free_kv)
        prefilling = [r for r in scheduler.running if r.prefilling] if not ahead else []
        batch = prefilling or list(scheduler.running)
        if not batch:
            return None
        if not ahead:
            if self.worker.memory.room_to_grow:  # a static pool (CUDA, --max-total-tokens) skips the sum
                self.worker.grow_kv(self._kv_wanted(scheduler))
            self._free_before = self.worker.free_kv()
        return (None if prefilling else batch), self.thread.submit(self.worker.step, batch, bool(prefilling))

    def _kv_wanted(self, scheduler: Scheduler) -> int:
        """Free KV a growing pool should have before a step (nothing in flight): what the running requests have
        reserved, and under overlap a second round's headroom each, so the next round can run ahead."""
        ahead = self.worker.round_headroom() * len(scheduler.running) if self.overlap else 0
        return scheduler.reserved_kv() + ahead

    def _may_run_ahead(self, scheduler: Scheduler, launched_with) -> bool:
        """The next decode round can start before the one in flight is handed out: it is a decode round, no
        request can be admitted, no other thread's call waits (it runs with nothing in flight), and worst-case KV
        fits both rounds (each needs a round's headroom per request) in the pool as it is (it grows only with
        nothing in flight)."""
        if launched_with is None or not scheduler.running or self._runs.calls_waiting:
            return False
        if scheduler.waiting and len(scheduler.running) < scheduler.max_running and not scheduler.hold:
            return False
        headroom = self.worker.round_headroom()
        return self._free_before >= headroom * (len(launched_with) + len(scheduler.running))

    def _hand_out(self, scheduler: Scheduler, result) -> list[StepOutput]:
        """Emit what a step produced (a request finished or aborted since it was launched gets nothing);
        a request that finishes hands its KV back after the steps already launched."""
        outputs = []
        for b, (r, tokens) in enumerate(zip(result.reqs, result.tokens)):
            if r.finished:
                continue
            r.output_ids.extend(tokens)
            r.finish_reason = result.finish[b]
            if result.accepted is not None:
                r.metrics = r.metrics.add_round(result.accepted[b], len(tokens), result.max_depth)
            first = bool(tokens) and len(r.output_ids) == len(tokens) and r.params.prompt_logprobs is not None
            if r.finished:
                self.thread.submit(self.worker.release, r)
            logprobs = result.logprobs[b] if result.logprobs else None
            outputs.append(StepOutput(r.rid, list(tokens), r.finish_reason, r.metrics, logprobs,
                                      tuple(r.prompt_logprobs) if first else None))
        scheduler.retire()
        self._free_before = result.free_kv
        return outputs

    def _run_calls(self) -> None:
        """Run the calls other threads routed to this run (a server's: `call`) with nothing in flight: every step
        and release submitted done, the round launched ahead finished."""
        if self._runs.calls_waiting:
            self.thread.drain()
            self._runs.run_calls()

    def _preempt_until_a_round_fits(self, scheduler: Scheduler) -> None:
        """A decode round needs `headroom` free KV per request; preempt the newest requests until it has it."""
        while len(scheduler.running) > 1 and (self.worker.available_kv()
                                              < self.worker.round_headroom() * len(scheduler.running)):
            req = scheduler.preempt()
            self.worker.release(req)  # its KV is recomputed from its history when it is admitted again
            self.preemptions += 1

    def abort(self, index: int) -> None:
        """Finish request `index` of the current stream before its next step; its KV is released. From any thread
        (a stream's consumer, a watchdog): its next step takes it. A served engine's requests are the server's:
        only its thread aborts them (a FastspecError from another)."""
        self._runs.abort(index)

    def _apply_aborts(self, scheduler: Scheduler) -> list[StepOutput]:
        done, aborted = [], self._runs.take_aborts()
        for r in [*scheduler.waiting, *scheduler.running]:
            if r.rid in aborted and not r.finished:
                r.finish_reason = "abort"
                self.thread.submit(self.worker.release, r)  # after the step in flight, if any
                done.append(StepOutput(r.rid, [], "abort", r.metrics))
        scheduler.waiting = deque(r for r in scheduler.waiting if not r.finished)
        scheduler.retire()
        return done

    # a request's checks (fastspec.engine.intake): the front ends make their requests and name their fields by them
    def room_for(self, prompt_len: int) -> int:
        return self.intake.room_for(prompt_len)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        self.intake.check_length(prompt_len, max_new_tokens)

    def request(self, rid: int, prompt: list[int], params: SamplingParams) -> Request:
        return self.intake.request(rid, prompt, params)
