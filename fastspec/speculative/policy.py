"""When to speculate: per batch size, the measured token rate of speculative rounds against plain rounds.

Speculation only pays when tau outgrows the extra cost of drafting and verifying N tokens; on a CPU or at a
large batch it often does not. Each mode's per-request tokens/second is an exponential moving average per batch
size; the faster one runs, and the other is re-measured now and then because acceptance drifts with the content:
`probe_every` rounds after the lead changes, then twice as long after each probe that still loses, up to
`max_probe_every` (a mode that keeps losing costs fewer and fewer probes). Decisions never change tokens (both
modes are exact), only speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
    _rates: dict[int, _Rates] = field(default_factory=dict)

    def speculate(self, bs: int) -> bool:
        r = self._rates.setdefault(bs, _Rates())
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

    def record(self, bs: int, speculative: bool, tokens_per_request: float, seconds: float) -> None:
        r = self._rates.setdefault(bs, _Rates())
        rate = tokens_per_request / max(seconds, 1e-9)
        old = r.spec if speculative else r.plain
        new = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        if speculative:
            r.spec = new
        else:
            r.plain = new

    def rates(self, bs: int) -> tuple[float | None, float | None]:
        r = self._rates.get(bs, _Rates())
        return r.spec, r.plain


def record_round(policy, speculative: bool, tokens: list[list[int]], start: float) -> None:
    """Tell `policy` (its `record`) of a round that produced tokens[b] for each of its requests, from perf_counter
    `start` until now."""
    policy.record(len(tokens), speculative, sum(map(len, tokens)) / len(tokens), time.perf_counter() - start)
