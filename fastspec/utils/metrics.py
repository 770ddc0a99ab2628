"""Acceptance metrics as immutable values: per request, summed per batch.

tau = mean tokens emitted per verify round (accepted drafts + the bonus); `tau_no_bonus` counts accepted
draft tokens only; `acceptance_by_depth[d-1]` = fraction of rounds whose accepted path reached depth d.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecMetrics:
    verify_rounds: int = 0
    accepted_tokens: int = 0  # accepted draft tokens (as verified, before stop truncation)
    emitted_tokens: int = 0  # tokens emitted by verify rounds (bonus included, after stop truncation)
    depth_counts: tuple[int, ...] = ()  # [d-1] = rounds with accept_len >= d, for d up to the deepest tree drafted

    def add_round(self, accept_len: int, emitted: int, max_depth: int = 0) -> SpecMetrics:
        """`max_depth`: the most draft tokens the round could accept (depths it never reached count as 0)."""
        depths = list(self.depth_counts) + [0] * max(0, max(accept_len, max_depth) - len(self.depth_counts))
        for d in range(accept_len):
            depths[d] += 1
        return SpecMetrics(self.verify_rounds + 1, self.accepted_tokens + accept_len,
                           self.emitted_tokens + emitted, tuple(depths))

    def __add__(self, other: SpecMetrics) -> SpecMetrics:
        n = max(len(self.depth_counts), len(other.depth_counts))
        pad = lambda c: list(c) + [0] * (n - len(c))  # noqa: E731
        depths = tuple(a + b for a, b in zip(pad(self.depth_counts), pad(other.depth_counts)))
        return SpecMetrics(self.verify_rounds + other.verify_rounds, self.accepted_tokens + other.accepted_tokens,
                           self.emitted_tokens + other.emitted_tokens, depths)

    @property
    def tau(self) -> float:
        return self.emitted_tokens / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def tau_no_bonus(self) -> float:
        return self.accepted_tokens / self.verify_rounds if self.verify_rounds else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        return [c / self.verify_rounds for c in self.depth_counts] if self.verify_rounds else []

    def as_dict(self) -> dict:
        return {"verify_rounds": self.verify_rounds, "accepted_draft_tokens": self.accepted_tokens,
                "tau": round(self.tau, 4), "tau_no_bonus": round(self.tau_no_bonus, 4),
                "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_depth]}


# The phases timed inside a speculative round. catch_up: the draft running over what prefill chunks and plain rounds
# left it, before the round (fastspec.speculative.backlog): a cost per prompt or plain-decoded token, timed apart from
# the round's own draft extend so that neither it nor host work (tune's cost per round) carries it.
ROUND_PHASES = ("draft", "verify", "draft_extend", "catch_up")


class PhaseTimes:
    """Wall time per round phase, accumulated: `with times("verify"): ...`. On CUDA the device is synchronised
    at both ends so the time is the phase's, not its launch's (only when `sync_cuda` is set: benchmarks; every
    synchronisation stalls the launch queue, so a serving engine leaves it off)."""

    def __init__(self, sync_cuda: bool = False):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.sync_cuda = sync_cuda

    @contextlib.contextmanager
    def __call__(self, name: str, count: bool = True):
        """count=False: more time for a call counted elsewhere (the overlap schedule counts a speculative round
        where it launches it; it finishes it, and may catch the draft up for it, in other calls)."""
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.counts[name] = self.counts.get(name, 0) + int(count)

    def reset(self) -> None:
        self.seconds, self.counts = {}, {}

    def synced_split(self, run, device: str) -> dict[str, float]:
        """The split of `run()` alone, on CUDA with the device synchronised at every phase boundary (otherwise
        the phases' times are their launches'). The syncs stall the launch queue: do not time `run` for tok/s."""
        self.reset()
        self.sync_cuda = device.startswith("cuda")
        try:
            run()
        finally:
            self.sync_cuda = False
        return self.split()

    def split(self) -> dict[str, float]:
        """Seconds per phase; `host` = speculative rounds minus the ROUND_PHASES timed inside them (plain rounds are
        timed apart as `plain_round`), so a round's phases and host sum to `round`."""
        rounds = self.seconds.get("round", 0.0)
        inner = sum(self.seconds.get(k, 0.0) for k in ROUND_PHASES)
        return {**{k: v for k, v in self.seconds.items() if k != "round"}, "host": max(rounds - inner, 0.0),
                "round": rounds}
