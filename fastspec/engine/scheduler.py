"""Requests, admission and preemption: which requests run, given the KV the pool has free right now.

Admission is optimistic (as SGLang's): a request starts when its prompt plus one round of headroom fits in
the free KV beside one round of headroom for every running request. When a running batch cannot grow, the
engine preempts the most recently admitted request: its KV is freed and it waits at the front of the queue,
to be recomputed (its prompt + output so far prefilled again) when it fits. The scheduler never touches KV
slots or tensors; the worker's commit advances KV lengths, the engine emits tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fastspec.sampling.params import SamplingParams
from fastspec.utils.metrics import SpecMetrics


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0  # every draw's uniform is a hash of (seed, position) (fastspec.sampling.draw.position_uniforms)
    # the worker's (written only by the step that runs the request; with overlap, a step ahead of the engine)
    row: int = -1  # request->slot table row while running
    seq_len: int = 0  # tokens whose KV is in the pool (the last produced token is not, yet)
    produced: list[int] = field(default_factory=list)  # every token produced, up to the one that finished it
    done: str | None = None  # why the worker stopped producing: "stop" | "length"
    cached_len: int = 0  # leading positions whose KV the prefix cache owns (and this request has locked)
    cached_node: object = None  # the prefix cache's node it locked (fastspec.memory.radix.RadixNode)
    checkpoints: list = field(default_factory=list)  # hybrid targets: (length, state checkpoint) saved so far
    grammar: object = None  # structured output: its matcher at `produced` (fastspec.sampling.grammar.Grammar)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of prompt tokens 1.. so far (when asked for)
    # the engine's: what the caller has been given
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    metrics: SpecMetrics = SpecMetrics()

    @property
    def history(self) -> list[int]:
        """Prompt + produced tokens; the last one is the pending token (not yet in the KV)."""
        return self.prompt_ids + self.produced

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill must put in the KV: the prompt, or after preemption the whole history but the
        pending token (which is fed by the next decode round, as always)."""
        return self.prompt_ids + self.produced[:-1]

    @property
    def prefilling(self) -> bool:
        """Part of prefill_ids is not in the KV yet (chunked prefill, or recompute after preemption)."""
        return self.seq_len < len(self.prompt_ids) + max(len(self.produced) - 1, 0)

    @property
    def tokens_left(self) -> int:
        """What max_new_tokens still allows it to produce."""
        return self.params.max_new_tokens - len(self.produced)


class Scheduler:
    def __init__(self, max_running: int, page_size: int, headroom: int = 0):
        self.max_running, self.page_size = max_running, page_size
        self.headroom = headroom  # KV one round may add per running request: verify slots, draft scratch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.hold = False  # after a preemption, admit nothing until a request finishes (no thrashing)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self, free_tokens: int) -> list[Request]:
        """Move waiting requests (in order) to running while their prefill and a round of headroom fit."""
        available = free_tokens - self.reserved_kv()
        admitted = []
        while self.waiting and len(self.running) < self.max_running and not (self.hold and self.running):
            need = self._pages(len(self.waiting[0].prefill_ids)) + self.headroom
            if need > available:
                break
            available -= need
            admitted.append(self.waiting.popleft())
            self.running.append(admitted[-1])
        return admitted

    def reserved_kv(self) -> int:
        """KV the running requests may take before the next admission: the rest of their prefills (whole pages)
        and a round's headroom each."""
        pending = sum(self._pages(len(r.prefill_ids)) - r.seq_len for r in self.running if r.prefilling)
        return pending + self.headroom * len(self.running)

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def preempt(self) -> Request:
        """Take the most recently admitted request out of the running batch; it is recomputed later, first."""
        req = self.running.pop()
        self.waiting.appendleft(req)
        self.hold = True
        return req

    def retire(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        self.hold = self.hold and not done
        return done

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
