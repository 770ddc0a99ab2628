"""When to speculate: per batch size and context length, the measured token rate of speculative rounds against plain
rounds.

Speculation only pays when tau outgrows the extra cost of drafting and verifying N tokens; on a CPU, at a large batch
or over a long context (a verify attends N tokens to it) it often does not. Each mode's per-request tokens/second is
an exponential moving average per batch size and context bucket (a power of two of the requests' mean length, from
256 tokens: 0-511, 512-1023, ...); a new bucket starts from a neighbour measured at its batch size. The faster
mode runs, and the other is re-measured now and then because acceptance drifts with the content:
`probe_every` rounds after the lead changes, then twice as long after each probe that still loses, up to
`max_probe_every` (a mode that keeps losing costs fewer and fewer probes). Decisions never change tokens (both
modes are exact), only speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace


@dataclass
class _Rates:
    spec: float | None = None  # per-request tokens / second, EMA
    plain: float | None = None
    rounds: int = 0
    leader: bool | None = None  # whether speculation led at the last decision
    interval: int = 0  # rounds between probes of the losing mode now
    next_probe: int = 0  # the round that probes it


@dataclass
class SpecPolicy:
    probe_every: int = 32
    max_probe_every: int = 512
    alpha: float = 0.3
    warmup_rounds: int = 2  # speculative rounds measured before the first plain probe
    _rates: dict[tuple[int, int], _Rates] = field(default_factory=dict)  # (batch size, context bucket) -> rates

    def speculate(self, bs: int, context: int = 0) -> bool:
        """Whether the next round at batch size `bs` speculates; context: the requests' mean length in tokens."""
        r = self._of(bs, context)
        r.rounds += 1
        if r.spec is None or r.rounds <= self.warmup_rounds:
            return True
        if r.plain is None:
            return False
        spec_wins = r.spec >= r.plain
        if spec_wins != r.leader:  # a new leader: probe the other mode soon again
            r.leader, r.interval, r.next_probe = spec_wins, self.probe_every, r.rounds + self.probe_every
        if r.rounds < r.next_probe:
            return spec_wins
        r.interval = min(2 * r.interval, self.max_probe_every)  # the probe is now; the next one waits longer
        r.next_probe = r.rounds + r.interval
        return not spec_wins

    def record(self, bs: int, speculative: bool, tokens_per_request: float, seconds: float, context: int = 0) -> None:
        r = self._of(bs, context)
        rate = tokens_per_request / max(seconds, 1e-9)
        old = r.spec if speculative else r.plain
        new = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        if speculative:
            r.spec = new
        else:
            r.plain = new

    def rates(self, bs: int, context: int = 0) -> tuple[float | None, float | None]:
        r = self._rates.get((bs, bucket(context)), _Rates())
        return r.spec, r.plain

    def _of(self, bs: int, context: int) -> _Rates:
        """The rates of (bs, context's bucket). A new bucket next to a measured one at this batch size (the shorter
        first) starts as its copy, so a growing context crosses into it without warm-up rounds: the mode not running
        keeps its rate from the shorter context (optimistic: rates fall as contexts grow), so it is soon tried and
        measured anew."""
        b = bucket(context)
        if (bs, b) not in self._rates:
            near = next((self._rates[bs, n] for n in (b - 1, b + 1) if (bs, n) in self._rates), None)
            self._rates[bs, b] = replace(near) if near is not None else _Rates()
        return self._rates[bs, b]


def bucket(context: int) -> int:
    """A context length's bucket: log2, from 256 tokens (0-511 -> 9, 512-1023 -> 10, 1024-2047 -> 11, ...)."""
    return max(context, 256).bit_length()


def mean_length(reqs) -> int:
    """The requests' mean sequence length (tokens in their KV): the context a round's rates are kept for."""
    return sum(r.seq_len for r in reqs) // max(len(reqs), 1)


def record_round(policy, speculative: bool, tokens: list[list[int]], start: float, context: int = 0) -> None:
    """Tell `policy` (its `record`) of a round that produced tokens[b] for each of its requests, from perf_counter
    `start` until now, at the requests' mean length `context`."""
    policy.record(len(tokens), speculative, sum(map(len, tokens)) / len(tokens), time.perf_counter() - start, context)
