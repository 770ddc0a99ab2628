"""Requests and admission: which waiting requests may start, given the KV capacity left.

A request is admitted only when its whole budget (prompt + max_new_tokens, rounded up to pages) fits beside
the budgets of the running requests, so a running batch can always grow. The scheduler never touches KV
slots or tensors; the engine's `commit` is the one place request state advances.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from fastspec.metrics import SpecMetrics
from fastspec.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    row: int = -1  # request->slot table row while running
    seq_len: int = 0  # tokens whose KV is in the pool (the last emitted token is not, yet)
    finish_reason: str | None = None  # "stop" | "length"
    metrics: SpecMetrics = SpecMetrics()

    @property
    def history(self) -> list[int]:
        """Prompt + output tokens; the last one is the pending token (not yet in the KV)."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the KV yet (chunked prefill)."""
        return self.seq_len < len(self.prompt_ids)

    def budget(self, page_size: int, headroom: int = 0) -> int:
        """KV tokens this request may hold at once: prompt + output (whole pages) + a round's headroom."""
        tokens = len(self.prompt_ids) + self.params.max_new_tokens
        return -(-tokens // page_size) * page_size + headroom


class Scheduler:
    def __init__(self, capacity: int, max_running: int, page_size: int, headroom: int = 0):
        self.capacity, self.max_running, self.page_size = capacity, max_running, page_size
        self.headroom = headroom  # per running request: verify slots and draft scratch inside one round
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests (in order) to running while their budgets fit."""
        reserved = sum(r.budget(self.page_size, self.headroom) for r in self.running)
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            need = self.waiting[0].budget(self.page_size, self.headroom)
            if reserved + need > self.capacity:
                break
            reserved += need
            admitted.append(self.waiting.popleft())
            self.running.append(admitted[-1])
        return admitted

    def retire(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
