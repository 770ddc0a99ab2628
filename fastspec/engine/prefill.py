"""Chunked prefill: up to chunked_prefill_size prompt tokens per step, taken request by request, into the target's
KV (the draft's rows go into its backlog: the draft runs over them before it is used). A request whose prompt
completes here samples its first token. A request asking for prompt logprobs gets them from its chunks' rows."""

from __future__ import annotations

import torch

from fastspec.attention import extend_metadata
from fastspec.config import EngineConfig
from fastspec.engine.produce import Producer, RoundOutput
from fastspec.engine.scheduler import Request
from fastspec.engine.slots import BatchSlots
from fastspec.engine.target import Target
from fastspec.memory.state_checkpoints import prefill_budget
from fastspec.sampling.logprobs import token_logprobs
from fastspec.speculative.backlog import DraftBacklog
from fastspec.utils.transfer import to_device


class Prefill:
    def __init__(self, target: Target, slots: BatchSlots, producer: Producer, backlog: DraftBacklog | None,
                 config: EngineConfig):
        """backlog: where an extending drafter's rows go (its catch-up runs them before the draft is used), or
        None."""
        self.target, self.slots, self.producer, self.backlog, self.config = target, slots, producer, backlog, config

    def __call__(self, reqs: list[Request]) -> RoundOutput:
        """One chunk. The draft extend of a non-final chunk ends with the next prompt token instead of a sampled
        one (draft position p pairs t_{p+1} with h_p). Requests past the chunk's budget produce nothing."""
        skipped = len(reqs)
        reqs, chunks = self._take_chunks(reqs)
        skipped -= len(reqs)
        lens = [len(c) for c in chunks]
        page = self.config.page_size
        self.slots.make_room(sum(-(-n // page) * page + page for n in lens))
        complete = [r.seq_len + n == len(r.prefill_ids) for r, n in zip(reqs, lens)]
        ids = to_device([t for c in chunks for t in c], self.config.device)
        rows, prefix, ext, positions = self.slots.extend(reqs, lens)
        if self.target.states is not None:  # a sequence's first chunk starts from zero states
            self.target.states.reset(rows[prefix == 0])
        hidden = self.target.forward(ids, positions, extend_metadata(self.slots.table.table, rows, prefix, ext),
                                     rows, lens)
        last = torch.cumsum(ext, 0) - 1
        self._prompt_logprobs(reqs, lens, hidden.final)
        finals = [b for b, c in enumerate(complete) if c and not reqs[b].produced]  # recomputes know their token
        first_logits = self.target.model.compute_logits(hidden.final[last[finals]])
        final_reqs = [reqs[b] for b in finals]
        first = self.producer.sample(final_reqs, self.producer.controlled(final_reqs, first_logits))
        tails = [r.history[r.seq_len + n] if r.seq_len + n < len(r.history) else None for r, n in zip(reqs, lens)]
        for b, token in zip(finals, first):
            tails[b] = token
        if self.backlog is not None:
            shifted = torch.roll(ids, -1)  # t_{p+1} at position p; each chunk's tail: see above
            shifted[last] = to_device(tails, ids.device)
            self.backlog.defer([r.rid for r in reqs], [r.seq_len for r in reqs], lens, shifted,
                               self.target.features(hidden))
        produced = self.producer.commit(reqs, lens, [[tails[b]] if b in finals else [] for b in range(len(reqs))])
        logprobs = self.producer.logprobs(reqs, first_logits,
                                          [[finals.index(b)] if b in finals else [] for b in range(len(reqs))],
                                          produced)
        for r, n in zip(reqs, lens):
            self.producer.save_states(r, r.seq_len - n)
        return RoundOutput(produced + [[]] * skipped, logprobs=logprobs)

    def _prompt_logprobs(self, reqs: list[Request], lens: list[int],
                         final: torch.Tensor) -> None:  # [T, H]  the chunk's rows, request by request
        """Each request asking for them: the target's logprobs of the prompt tokens this chunk's rows predict (row p
        predicts token p + 1; a recompute after preemption has them already)."""
        for b, (r, n) in enumerate(zip(reqs, lens)):
            if r.params.prompt_logprobs is None:
                continue
            start, end = max(r.seq_len, len(r.prompt_logprobs)), min(r.seq_len + n, len(r.prompt_ids) - 1)
            if start < end:
                first_row = sum(lens[:b]) - r.seq_len  # the row position 0 would have
                logits = self.target.model.compute_logits(final[first_row + start: first_row + end])
                r.prompt_logprobs.extend(token_logprobs(logits, r.prompt_ids[start + 1: end + 1],
                                                       r.params.prompt_logprobs))

    def _take_chunks(self, reqs: list[Request]) -> tuple[list[Request], list[list[int]]]:
        """The requests this chunk reaches (a table row and the prefix cache's reuse for a new one) and the prompt
        tokens it takes of each."""
        chunks, budget = [], self.config.chunked_prefill_size
        track = self.producer.track_interval
        for r in reqs:
            if budget <= 0:
                break
            if r.row < 0:
                r.row = self.slots.table.alloc()
                if self.slots.cache is not None:
                    self.slots.cache.reuse(r)
            take = budget if track is None else min(budget, prefill_budget(r.seq_len, track))
            chunks.append(r.prefill_ids[r.seq_len: r.seq_len + take])
            budget -= len(chunks[-1])
        return reqs[: len(chunks)], chunks
