"""The frozen values drafters receive from the engine each round (no drafter mutates engine state).

Glossary: `seq_len` = tokens of a request whose KV is in the pool; the root / `verified_id` = the last
emitted token, not yet in the KV (it is fed at position seq_len). Draft KV position p holds the pair
(token t_{p+1}, target feature h_p): the draft input is the target input shifted left by one (a STANDALONE draft,
fed no feature that has seen t_0, also attends a key holding t_0: fastspec.models.eagle.StandaloneDraft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeBatch:
    """A decode round's running requests."""

    rids: tuple[int, ...]
    rows: torch.Tensor  # int64 [bs]  request->slot table rows
    seq_lens: torch.Tensor  # int64 [bs]  committed KV lengths
    seq_lens_cpu: tuple[int, ...]  # the same on the host; under the overlap schedule, launched before the round
    #                                that decides them is read: an upper bound (sizes reservations, never a position)
    verified_id: torch.Tensor  # int64 [bs]  the last emitted token (tree root)
    histories: tuple[list[int], ...]  # prompt + output tokens so far (read-only), last = root
    grammars: tuple | None = None  # per request its fastspec.sampling.grammar.Grammar or None; None: no request has one

    @property
    def size(self) -> int:
        return len(self.rids)


@dataclass(frozen=True)
class ExtendBatch:
    """New KV positions for the draft: prefill chunks, or the accepted tokens of a round (draft extend).

    Row j of request b sits at position prefix_lens[b] + j and pairs input token t_{p+1} with feature h_p.
    """

    rids: tuple[int, ...]
    rows: torch.Tensor  # int64 [bs]
    prefix_lens: torch.Tensor  # int64 [bs]  KV length before this extend
    extend_lens: torch.Tensor  # int64 [bs]
    input_ids: torch.Tensor  # int64 [T]  shifted tokens (t_{p+1} at position p)
    positions: torch.Tensor  # int64 [T]
    features: torch.Tensor  # [T, F]  target features h_p (final hidden for EAGLE, aux for EAGLE-3)
    max_extend: int | None = None  # max(extend_lens), likewise
    first_ids: torch.Tensor | None = None  # int64 [bs]  each request's t_0 (a STANDALONE draft's first-token key)
