"""What a launched speculative round leaves on the device for the next one (its future maps), and the
round itself until the host has read it (PendingRound).

With the overlap schedule the worker launches round K+1 before it reads round K's accept result: K+1's draft
reads each request's committed KV length and verified id (the bonus token, the next root) from FutureMaps,
which K's commit wrote on the device; the draft input (top-k, hidden state) is what K's draft extend left in
the drafter. SGLang indexes its maps with a circular counter because its batches are rebuilt every step; a
request keeps its request->slot table row for its whole run, so here the row is the index: a batch filtered of
finished requests keeps its rows, and a row's entry is only read by the round after the one that wrote it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from fastspec.spec_config import SpecParams


class FutureMaps:
    """Per table row, on the device: the committed KV length and the verified id the last round wrote."""

    def __init__(self, num_rows: int, device):
        self.seq_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows]
        self.verified_id = torch.zeros(num_rows, dtype=torch.int64, device=device)  # [rows]

    def write(self, rows: torch.Tensor, seq_lens: torch.Tensor, verified_id: torch.Tensor) -> None:
        # rows, seq_lens, verified_id: int64 [bs]
        self.seq_lens.index_put_((rows,), seq_lens)
        self.verified_id.index_put_((rows,), verified_id)

    def resolve(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_lens, verified_id) int64 [bs] of `rows`, as the rounds before wrote them (no host read)."""
        return self.seq_lens[rows], self.verified_id[rows]


@dataclass(frozen=True)
class PendingRound:
    """A launched speculative round: everything it does on the device is enqueued (commit and draft extend
    included); what the host still does with it (hand out tokens, free the KV it did not keep) waits for its
    accept result, copied to the host without blocking on a GPU."""

    reqs: tuple  # the Requests it runs, in batch order
    params: SpecParams
    verify_slots: torch.Tensor  # int64 [bs, N]  the slots verify wrote (positions seq_len .. seq_len+N-1)
    readback: torch.Tensor  # int64 [2, bs, E]  accept_index, emitted (host memory once `ready` has passed)
    ready: object  # a torch.cuda.Event recorded after the copy, or None (CPU: already there)
    reserved: int  # KV slots verify took from the allocator (given back in part by finish)
    spare_pages: torch.Tensor | None  # paged, lengths unknown at launch: int64 [bs, W] pages reserved per request
    logits: torch.Tensor | None  # [bs*N, V] verify logits, kept when a request asks for logprobs
    started: float  # perf_counter at launch
    done: Future = field(default_factory=Future)  # the StepResult, set when the round is finished

    @property
    def rids(self) -> set[int]:
        return {r.rid for r in self.reqs}

    def read(self) -> tuple[list[list[int]], list[list[int]]]:
        """(accept_index, emitted) as host lists: the round's one wait for the device."""
        if self.ready is not None:
            self.ready.synchronize()
        accept_index, emitted = self.readback.tolist()
        return accept_index, emitted


def start_readback(accept_index: torch.Tensor, emitted: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Copy a round's accept result to the host without waiting for it: (host tensor, event to wait on)."""
    both = torch.stack([accept_index, emitted])  # [2, bs, E]
    if both.device.type != "cuda":
        return both, None
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
    host.copy_(both, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
