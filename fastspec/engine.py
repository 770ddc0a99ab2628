"""The engine: continuous batching over a worker (fastspec.worker), which owns the models, the KV pool and the
round functions. Each step admits what fits, preempts what must wait, asks the worker for a prefill chunk or a
decode round (speculative where a drafter exists and the measured policy says it pays), then emits what each
request produced: tokens up to a stop token or `max_new_tokens`, the rest dropped, and a finished request's KV
handed back. Tokenisation stays outside (fastspec.llm); the engine speaks token ids.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fastspec.config import EngineConfig, SpecConfig
from fastspec.errors import FastspecError
from fastspec.metrics import SpecMetrics
from fastspec.sampling import SamplingParams, make_generator
from fastspec.scheduler import Request, Scheduler
from fastspec.speculative.policy import SpecPolicy
from fastspec.worker import Worker

@dataclass(frozen=True)
class StepOutput:
    index: int  # the request's position in the submitted list
    new_ids: list[int]  # tokens emitted by this step (several per speculative round)
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: SpecMetrics


@dataclass(frozen=True)
class GenerateOutput:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    metrics: SpecMetrics


class Engine:
    def __init__(self, config: EngineConfig, spec: SpecConfig | None = None, on_prepare=None):
        """on_prepare(graph_name, bucket) is called before each graph bucket is captured / compiled."""
        self.config = config
        self.worker = Worker(config, spec, on_prepare)
        self.policy = SpecPolicy() if config.speculative_fallback and self.worker.spec.enabled else None
        self.preemptions = 0  # requests taken out of a running batch to make room (recomputed later)

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

    def use_schedule(self, schedule, on_prepare=None) -> None:
        """Switch to per-batch-size tree shapes between streams (`fastspec tune` tries candidates this way)."""
        self.worker.use_schedule(schedule, on_prepare)

    def check_kv(self, running: list[Request] = ()) -> None:
        """Leak check: free slots + slots held by `running` == capacity (AssertionError otherwise)."""
        self.worker.check_kv(running)

    # ---- public API -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerateOutput]:
        outputs = {i: [] for i in range(len(prompts))}
        final: dict[int, StepOutput] = {}
        for step in self.stream(prompts, params):
            for out in step:
                outputs[out.index].extend(out.new_ids)
                if out.finish_reason is not None:
                    final[out.index] = out
        return [GenerateOutput(list(p), outputs[i], final[i].finish_reason, final[i].metrics)
                for i, p in enumerate(prompts)]

    def stream(self, prompts: list[list[int]], params: list[SamplingParams]) -> Iterator[list[StepOutput]]:
        """Continuous batching; yields, after every prefill or decode round, the requests that progressed.
        Between yields the caller may `abort(index)` a request (a stop string, a closed terminal, Ctrl-C)."""
        reqs = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        scheduler = Scheduler(self.config.max_running_requests, self.config.page_size, self.worker.round_headroom())
        for r in reqs:
            scheduler.add(r)
        self._aborted: set[int] = set()
        try:
            while not scheduler.idle:
                with torch.inference_mode():
                    aborted = self._apply_aborts(scheduler)
                    scheduler.admit(self.worker.allocator.num_free())
                    if not any(r.prefilling for r in scheduler.running):
                        self._preempt_until_a_round_fits(scheduler)
                    prefilling = [r for r in scheduler.running if r.prefilling]
                    batch = prefilling or list(scheduler.running)
                    seen = {r.rid: len(r.output_ids) for r in batch}
                    if prefilling:
                        with self.times("prefill"):
                            self._emit_all(batch, self.worker.prefill(batch))
                    elif batch:
                        self._decode(batch)
                    scheduler.retire()
                yield aborted + [StepOutput(r.rid, r.output_ids[seen[r.rid]:], r.finish_reason, r.metrics)
                                 for r in batch]
        finally:  # the caller stopped iterating (an exception, a closed pipe): hand every slot back
            for r in scheduler.running:
                if r.row >= 0:
                    self.worker.release(r)

    def _preempt_until_a_round_fits(self, scheduler: Scheduler) -> None:
        """A decode round needs `headroom` free KV per request; preempt the newest requests until it has it."""
        while len(scheduler.running) > 1 and (self.worker.allocator.num_free()
                                              < self.worker.round_headroom() * len(scheduler.running)):
            req = scheduler.preempt()
            self.worker.release(req)
            req.seq_len = 0  # recomputed from its history when it is admitted again
            self.preemptions += 1

    def abort(self, index: int) -> None:
        """Finish request `index` of the current stream before its next step; its KV is released."""
        self._aborted.add(index)

    def _apply_aborts(self, scheduler: Scheduler) -> list[StepOutput]:
        done = []
        for r in [*scheduler.waiting, *scheduler.running]:
            if r.rid in self._aborted and not r.finished:
                r.finish_reason = "abort"
                if r.row >= 0:
                    self.worker.release(r)
                done.append(StepOutput(r.rid, [], "abort", r.metrics))
        scheduler.waiting = deque(r for r in scheduler.waiting if not r.finished)
        scheduler.retire()
        self._aborted.clear()
        return done

    def _make_request(self, rid: int, prompt: list[int], params: SamplingParams) -> Request:
        if not prompt:
            raise FastspecError("empty prompt")
        if len(prompt) + params.max_new_tokens > self.worker.max_context_len:
            raise FastspecError(f"prompt ({len(prompt)} tokens) + max-new-tokens ({params.max_new_tokens}) "
                                f"exceeds the context length {self.worker.max_context_len}")
        vocab = self.worker.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise FastspecError(f"input token ids must be in [0, {vocab})")
        request = Request(rid, list(prompt), params, make_generator(params.seed, self.config.device))
        if request.max_tokens(self.config.page_size, self.worker.round_headroom()) > self.worker.pool.capacity:
            raise FastspecError(f"a request of {len(prompt)} prompt + {params.max_new_tokens} new tokens does not "
                                f"fit in the KV pool of {self.worker.pool.capacity} tokens (raise --max-total-tokens)")
        return request

    # ---- decode rounds ----------------------------------------------------------------------------------

    def _decode(self, reqs: list[Request]) -> None:
        """One decode round: speculative when a drafter exists and the policy says it pays, else plain."""
        params = self.spec.params_for(len(reqs)) if self.drafter is not None else None
        speculate = params is not None and (self.policy is None or self.policy.speculate(len(reqs)))
        before, start = sum(len(r.output_ids) for r in reqs), time.perf_counter()
        with self.times("round" if speculate else "plain_round"):  # "round" = speculative rounds only
            if speculate:
                self._emit_all(reqs, self.worker.spec_round(reqs, params), speculative=True)
            else:
                self._emit_all(reqs, self.worker.plain_round(reqs))
        if self.policy is not None:
            emitted = sum(len(r.output_ids) for r in reqs) - before
            self.policy.record(len(reqs), speculate, emitted / len(reqs), time.perf_counter() - start)

    def _emit_all(self, reqs: list[Request], produced: list[list[int]], speculative: bool = False) -> None:
        """Emit what each request produced this step; a request that finishes hands its KV back."""
        for r, run in zip(reqs, produced):
            new = self._emit(r, run)
            if speculative:  # run = accepted draft tokens + the bonus token
                r.metrics = r.metrics.add_round(len(run) - 1, len(new))
            if r.finished:
                self.worker.release(r)

    def _emit(self, r: Request, run: list[int]) -> list[int]:
        """Append tokens until a stop condition; returns what was emitted (the rest is dropped)."""
        emitted = []
        for token in run:
            r.output_ids.append(token)
            emitted.append(token)
            r.finish_reason = self._finish_reason(r, token)
            if r.finished:
                break
        return emitted

    def _finish_reason(self, r: Request, token: int) -> str | None:
        if token in r.params.stop_token_ids or (token in self.worker.eos_ids and not r.params.ignore_eos):
            return "stop"
        if len(r.output_ids) >= r.params.max_new_tokens:
            return "length"
        return None

