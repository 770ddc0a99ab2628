"""The overlap schedule inside the worker: launch speculative round K+1 before finishing round K, so the host's
part of round K (its read, freeing the KV it did not keep, handing out tokens up to a stop) runs while the device
runs round K+1.

Round K+1 reads each request's length and root from the future maps K's commit wrote on the device
(fastspec.speculative.future) and reserves verify KV for the longest those can be. A request round K finished
runs once more in K+1 (its tokens dropped, its KV returned after K+1); the worker releases one released
meanwhile after the round in flight (`in_flight`). Anything the host must decide from round K's tokens (NGRAM
drafting, grammars, penalties, logprobs, recurrent-state checkpoints, a plain round, a prefill, a new request)
finishes round K first (`flush`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from fastspec.engine.produce import RoundOutput, StepResult
from fastspec.engine.scheduler import Request
from fastspec.engine.spec_rounds import SpecRounds
from fastspec.sampling.controls import active as controls_active
from fastspec.spec_config import SpecParams
from fastspec.speculative.future import PendingRound
from fastspec.speculative.policy import SpecPolicy, mean_length, record_round
from fastspec.utils.metrics import PhaseTimes


class OverlapSchedule:
    def __init__(self, rounds: SpecRounds, may_speculate_ahead: bool, policy: SpecPolicy | None,
                 times: PhaseTimes, free_kv: Callable[[], int]):
        """may_speculate_ahead: the drafter drafts from the device alone (an EAGLE-family drafter: NGRAM drafts
        from the tokens) and the target keeps no recurrent state; free_kv() -> KV slots free now."""
        self.rounds, self.may_speculate_ahead, self.policy, self.times = rounds, may_speculate_ahead, policy, times
        self.free_kv = free_kv
        self.pending: PendingRound | None = None  # the round launched ahead, not finished yet
        self._finished_at = 0.0  # perf_counter when the last round launched ahead was finished

    def in_flight(self, r: Request) -> bool:
        return self.pending is not None and r in self.pending.reqs

    def may_launch_ahead(self, reqs: list[Request]) -> bool:
        """Nothing the host decides from a round's tokens feeds this one: no grammar, penalties or logprobs;
        every request is in the round in flight, if any (a new one needs its prefill's lengths), and not all of
        them may end in it by their token budget."""
        if not self.may_speculate_ahead:
            return False
        live = [r for r in reqs if r.done is None]
        if any(r.grammar is not None or controls_active(r.params) or r.params.logprobs is not None for r in live):
            return False
        if self.pending is None:
            return True
        if not {r.rid for r in live} <= self.pending.rids:
            return False
        # a round launched now would be wasted if the round in flight may end every request by its token budget
        most = self.pending.params.num_steps + 1  # the most tokens a round emits per request
        return any(r.tokens_left > most for r in live)

    def runnable(self, reqs: list[Request]) -> list[Request]:
        """Those of `reqs` a round launched now serves: with one token left, the round in flight ends a request
        (by length) for sure."""
        return reqs if self.pending is None else [r for r in reqs if r.tokens_left > 1]

    def launch(self, reqs: list[Request], params: SpecParams) -> Future:
        """Launch a round, then finish the one in flight; the Future of the new round's StepResult is set when a
        later `launch` or `flush` finishes it."""
        before = self.pending
        with self.times("round"):
            self.pending = self.rounds.launch(reqs, params, before)
            if before is not None:
                self._finish(before)
        return self.pending.done

    def flush(self) -> None:
        """Finish the round in flight, if any (its Future gets its StepResult)."""
        if self.pending is not None:
            with torch.inference_mode(), self.times("round", count=False):  # (counted at its launch)
                self._finish(self.pending)

    def _finish(self, p: PendingRound) -> None:
        try:
            if self.pending is p:
                self.pending = None
            live = [b for b, r in enumerate(p.reqs) if r.done is None]  # the others finished in the round before
            out = self.rounds.finish(p)
            if self.policy is not None:  # a round's time: from the later of its launch and the last finish
                record_round(self.policy, True, out.tokens, max(p.started, self._finished_at), mean_length(p.reqs))
            self._finished_at = time.perf_counter()
            # KV the round launched since took counts as free: the engine plans from the KV free before it
            later = self.pending.reserved if self.pending is not None else 0
            out = RoundOutput([out.tokens[b] for b in live], [out.accepted[b] for b in live], out.logprobs,
                              out.max_depth)
            p.done.set_result(StepResult.of([p.reqs[b] for b in live], out, self.free_kv() + later))
        except BaseException as error:
            p.done.set_exception(error)
            raise
