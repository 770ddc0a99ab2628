"""The drafter front: the `Drafter` protocol every drafter implements, and `build_drafters`, which gives an
algorithm its drafters.

EAGLE / EAGLE3 / STANDALONE share one drafter (`EagleDrafter`, differing only in the draft model and the target
feature it is fed); NGRAM proposes trees from each request's own tokens (`NgramTreeDrafter`); NONE has none.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from fastspec.graphs.step_graphs import GraphPlan
from fastspec.spec_config import SpecConfig, SpecParams
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.eagle_drafter import EagleDrafter
from fastspec.speculative.ngram import NgramTreeDrafter
from fastspec.speculative.tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """What a speculative round asks of a drafter. Per-request state (if any) is keyed by request id."""

    uses_extend: bool  # it keeps per-request state the draft extend advances (prefill chunks, each round)
    uses_scratch: bool  # draft() writes KV into scratch slots taken under an allocator backup

    def draft(self, batch: DecodeBatch) -> DraftTree:
        """The round's draft tree for every request in `batch`."""

    def extend(self, batch: ExtendBatch, decode_round: bool) -> None:
        """Run the draft over new positions (a prefill chunk's, or a round's accepted run) and keep its state."""

    def extend_round(self, rids: tuple[int, ...], rows: torch.Tensor, prefix_lens: torch.Tensor,
                     keep_lens: torch.Tensor,  # int64 [bs] each
                     input_ids: torch.Tensor, positions: torch.Tensor,  # int64 [bs*E], E = num_steps + 1
                     features: torch.Tensor) -> None:  # [bs*E, F]
        """A decode round's extend from rows padded on the device (row b*E + j real while j < keep_lens[b])."""

    def release(self, rid: int) -> None:
        """Forget a finished request."""


def build_drafters(spec: SpecConfig, draft: torch.nn.Module | None, draft_pool, table, allocator,
                   feature_width: int, plan: GraphPlan, times=None) -> dict[SpecParams, Drafter]:
    """{tree shape: drafter}: one entry, or one per tier of a batch-size schedule (sharing request states)."""
    if spec.algorithm == "NONE":
        return {}
    if spec.algorithm == "NGRAM":
        return {spec.params: NgramTreeDrafter(spec.ngram, spec.num_steps, spec.num_draft_tokens)}
    tiers = spec.tiers
    shared = {} if len(tiers) > 1 else None
    extend_topk = max(p.topk for p in tiers) if shared is not None else None
    return {p: EagleDrafter(draft, draft_pool, table, allocator, p.num_steps, p.topk, p.num_draft_tokens,
                            feature_width, plan, times, extend_topk, shared) for p in tiers}
