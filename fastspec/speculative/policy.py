"""When to speculate: per batch size, the measured token rate of speculative rounds against plain rounds.

Speculation only pays when tau outgrows the extra cost of drafting and verifying N tokens; on a CPU or at a
large batch it often does not. Each mode's per-request tokens/second is an exponential moving average per batch
size; the faster one runs, and the other is re-measured every `probe_every` rounds because acceptance drifts
with the content. Decisions never change tokens (both modes are exact), only speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Rates:
    spec: float | None = None  # per-request tokens / second, EMA
    plain: float | None = None
    rounds: int = 0


@dataclass
class SpecPolicy:
    probe_every: int = 32
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
        probe = r.rounds % self.probe_every == 0  # re-measure the losing mode now and then
        return spec_wins != probe

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
