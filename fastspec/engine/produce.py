"""What a step makes of the target's logits: the logits under each request's controls and grammar, sampled
tokens, the tokens handed out up to a stop (the only writes to a request's `produced` and `done`), their
logprobs, and a hybrid target's saved states. Prefill and both kinds of decode round share one Producer.

A round returns a RoundOutput; the worker turns it into the StepResult the engine hands out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastspec.engine.scheduler import Request
from fastspec.memory.state_checkpoints import save_crossed
from fastspec.memory.state_pool import StatePool
from fastspec.sampling.controls import active as controls_active
from fastspec.sampling.controls import apply_controls
from fastspec.sampling.draw import sample
from fastspec.sampling.grammar import mask_logits, verify_paths
from fastspec.sampling.logprobs import TokenLogprob, token_logprobs
from fastspec.speculative.tree import DraftTree
from fastspec.utils.transfer import to_device


@dataclass(frozen=True)
class RoundOutput:
    tokens: list[list[int]]  # per request, what it produced, up to a stop
    accepted: list[int] | None = None  # speculative rounds: accepted draft tokens per request (before a stop)
    logprobs: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)  # rid -> per produced token
    max_depth: int = 0  # speculative rounds: the most draft tokens the round's tree could have accepted


@dataclass(frozen=True)
class StepResult:
    reqs: tuple[Request, ...]  # the requests the step ran (those already done are skipped)
    tokens: tuple[tuple[int, ...], ...]  # per request, what it produced, up to a stop
    finish: tuple[str | None, ...]  # per request, "stop" | "length" once this step finished it
    accepted: tuple[int, ...] | None  # speculative rounds: accepted draft tokens per request (before a stop)
    free_kv: int  # free KV slots after the step
    logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()  # per request asking for them, aligned with tokens
    max_depth: int = 0  # speculative rounds: the most draft tokens the round's tree could have accepted

    @classmethod
    def of(cls, reqs: list[Request], out: RoundOutput, free_kv: int) -> StepResult:
        return cls(tuple(reqs), tuple(map(tuple, out.tokens)), tuple(r.done for r in reqs),
                   None if out.accepted is None else tuple(out.accepted), free_kv,
                   tuple(out.logprobs.get(r.rid) for r in reqs), out.max_depth)


class Producer:
    def __init__(self, eos_ids, states: StatePool | None, track_interval: int | None,
                 reclaim_state: Callable[[], bool] | None):
        """track_interval: a hybrid target with the prefix cache saves its states every that many tokens, taking
        a checkpoint back from the cache with `reclaim_state()` when none is free."""
        self.eos_ids, self.states, self.track_interval = eos_ids, states, track_interval
        self.reclaim_state = reclaim_state

    def controlled(self, reqs: list[Request], logits: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """The logits under each request's grammar mask (fastspec.sampling.grammar) and penalties / bias / min_p
        (fastspec.sampling.controls), at every position: a verify node with the draft tokens on its path as
        output. The mask comes first so that min_p is relative to the most likely token the grammar allows (the
        penalties and bias leave a masked -inf at -inf): taken over every token, it could drop all the allowed ones."""
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            logits = mask_logits(logits, grammars, verify_paths(tree) if tree is not None else [[[]]] * len(reqs))
        if any(controls_active(r.params) for r in reqs):
            logits = apply_controls(logits, reqs, *(() if tree is None else (tree.tree_mask, tree.draft_tokens)))
        return logits

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        return sample(logits, [r.params for r in reqs], [r.seed for r in reqs],
                      [len(r.prompt_ids) + len(r.produced) for r in reqs]).tolist()  # (the drawn token's position)

    def commit(self, reqs: list[Request], fed: list[int], tokens: list[list[int]]) -> list[list[int]]:
        """Plain rounds and prefill: `fed[b]` tokens entered the KV, `tokens[b]` were produced."""
        for r, n in zip(reqs, fed):
            r.seq_len += n
        return [self.produce(r, new) for r, new in zip(reqs, tokens)]

    def produce(self, r: Request, run: list[int]) -> list[int]:
        """Append tokens until a stop condition (the request is done then); returns what was kept."""
        kept = []
        for token in run:
            r.produced.append(token)
            if r.grammar is not None:
                r.grammar.advance(token)
            kept.append(token)
            r.done = self._finish_reason(r, token)
            if r.done:
                break
        return kept

    def _finish_reason(self, r: Request, token: int) -> str | None:
        if token in r.params.stop_token_ids or (token in self.eos_ids and not r.params.ignore_eos):
            return "stop"
        if len(r.produced) >= r.params.max_new_tokens:
            return "length"
        return None

    def logprobs(self, reqs: list[Request], logits: torch.Tensor, rows: list[list[int]],
                 produced: list[list[int]]) -> dict[int, tuple[TokenLogprob, ...]]:
        """The target's logprobs of what each request asking for them produced; rows[b][j]: the logits row that
        produced its j-th token."""
        out = {}
        for b, r in enumerate(reqs):
            if r.params.logprobs is not None and produced[b]:
                picked = logits[to_device(rows[b][: len(produced[b])], logits.device)]
                out[r.rid] = token_logprobs(picked, produced[b], r.params.logprobs)
        return out

    def save_states(self, r: Request, old_len: int, nodes: list[int] | None = None) -> None:
        """A hybrid target with the prefix cache: save the row's state at each interval boundary it crossed since
        `old_len` (a speculative round's verify tracked the states along its kept `nodes`)."""
        if self.track_interval is not None:
            save_crossed(self.states, r, old_len, nodes, self.track_interval, self.reclaim_state)
