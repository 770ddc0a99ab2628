"""The overlap schedule inside the worker (fastspec.worker, a mixin): launch speculative round K+1 before
finishing round K, so the host's part of round K (its read, freeing the KV it did not keep, handing out tokens
up to a stop) runs while the device runs round K+1.

Round K+1 reads each request's length and root from the future maps K's commit wrote on the device
(fastspec.speculative.future) and reserves verify KV for the longest those can be. A request round K finished
runs once more in K+1 (its tokens dropped, its KV returned after K+1); one released meanwhile is released after
the round in flight. Anything the host must decide from round K's tokens (NGRAM drafting, grammars, penalties,
logprobs, recurrent-state checkpoints, a plain round, a prefill, a new request) finishes round K first.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from fastspec.controls import active as controls_active
from fastspec.scheduler import Request
from fastspec.speculative.future import PendingRound


class OverlapRounds:
    def _may_launch_ahead(self, reqs: list[Request]) -> bool:
        """Nothing the host decides from a round's tokens feeds this one: an EAGLE-family drafter (NGRAM drafts
        from the tokens themselves), no recurrent target state, no grammar, penalties or logprobs; every request
        is in the round in flight, if any (a new one needs its prefill's lengths), and not all of them may end in
        it by their token budget."""
        if self.drafter is None or not self.drafter.uses_extend or self.states is not None:
            return False
        live = [r for r in reqs if r.done is None]
        if any(r.grammar is not None or controls_active(r.params) or r.params.logprobs is not None for r in live):
            return False
        if self._pending is None:
            return True
        if not {r.rid for r in live} <= self._pending.rids:
            return False
        # a round launched now would be wasted if the round in flight may end every request by its token budget
        most = self._pending.params.num_steps + 1  # the most tokens a round emits per request
        return any(r.tokens_left > most for r in live)

    def _step_ahead(self, reqs: list[Request]) -> Future:
        """Launch a speculative round, then finish the one in flight. A plain round (the policy's choice) runs
        after the one in flight is finished, its Future already set."""
        if self._pending is not None:  # one token left: the round in flight ends it (by length) for sure
            reqs = [r for r in reqs if r.tokens_left > 1]
        params = self._round_params(reqs) if reqs else None
        if params is None:
            self.flush()
            done = Future()
            done.set_result(self._step_now(reqs, False, None))
            return done
        self._make_room(self.round_headroom() * len(reqs))
        before = self._pending
        with self.times("round"):
            self._pending = self._launch_round(reqs, params, before)
            if before is not None:
                self._finish_pending(before)
        return self._pending.done

    def flush(self) -> None:
        """Finish the round in flight, if any (its Future gets its StepResult)."""
        if self._pending is not None:
            with torch.inference_mode(), self.times("round"):
                self._finish_pending(self._pending)

    def _finish_pending(self, p: PendingRound) -> None:
        try:
            if self._pending is p:
                self._pending = None
            self._logprobs = {}
            live = [b for b, r in enumerate(p.reqs) if r.done is None]  # the others finished in the round before
            tokens, accepted = self._finish_round(p)
            # a round's time under overlap: from the later of its launch and the last finish (one round apart)
            self._record_rate(list(p.reqs), True, tokens, max(p.started, self._finished_at))
            self._finished_at = time.perf_counter()
            later = self._pending.reserved if self._pending is not None else 0
            p.done.set_result(self._result([p.reqs[b] for b in live], [tokens[b] for b in live],
                                           [accepted[b] for b in live], later))
        except BaseException as error:
            p.done.set_exception(error)
            raise
        for r in [r for r in self._release_after if r in p.reqs]:  # released while this round was in flight
            self._release_after.remove(r)
            self.release(r)
