"""The draft's backlog: what prefill chunks and plain decode rounds did not run through the draft.

A prefill chunk or a plain round (the schedule or the measured fallback chose not to speculate) leaves the draft
where it was and keeps, per request, the (token, target feature, position) rows the draft extend would have
taken. Before the next speculative round over a request the draft catches up: one draft extend over all its missed
rows, batched over the requests that have some. Plain decoding thus costs what decoding without a draft costs; the
draft pays only when it is about to be used, and for each token once, as before. A request whose backlog reaches
max_rows catches up at once (bounded memory: rows x feature width). A request leaving for the prefix cache catches
up first (the cache keeps draft KV for later requests to speculate from); one freed without it drops its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastspec.speculative.batch import ExtendBatch
from fastspec.utils.transfer import to_device


@dataclass
class _Missed:
    start: int  # the first missed position (the draft's KV holds the positions before it)
    tokens: list[torch.Tensor] = field(default_factory=list)  # int64 [k] pieces: t_{p+1} for p = start, ...
    features: list[torch.Tensor] = field(default_factory=list)  # [k, F] pieces: h_p
    rows: int = 0

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n missed rows (tokens, features), removed."""
        tokens, features = torch.cat(self.tokens), torch.cat(self.features)
        self.tokens, self.features = [tokens[n:]], [features[n:]]
        self.start, self.rows = self.start + n, self.rows - n
        return tokens[:n], features[:n]


class DraftBacklog:
    def __init__(self, max_rows: int):
        """max_rows: rows per catch-up extend (a long backlog runs in several, like prefill chunks), and the most a
        request keeps waiting (past it, `full` says to catch up now: memory stays bounded)."""
        self.max_rows = max_rows
        self._missed: dict[int, _Missed] = {}

    def defer(self, rids: list[int], starts: list[int], lens: list[int], tokens: torch.Tensor,
              features: torch.Tensor) -> None:
        """Rows the draft did not run: request rids[b] has lens[b] of them from position starts[b] (its KV length
        before them), their tokens t_{p+1} and target features h_p consecutive in `tokens` [T] / `features` [T, F]
        (copied: graph outputs are reused)."""
        tokens, features = tokens.clone(), features.clone()
        offset = 0
        for rid, start, n in zip(rids, starts, lens):
            missed = self._missed.setdefault(rid, _Missed(start))
            assert missed.start + missed.rows == start, "draft backlog rows must be contiguous"
            missed.tokens.append(tokens[offset:offset + n])
            missed.features.append(features[offset:offset + n])
            missed.rows += n
            offset += n

    def behind(self, rid: int) -> int:
        """Rows request `rid` has missed."""
        missed = self._missed.get(rid)
        return missed.rows if missed is not None else 0

    def full(self, reqs: list) -> list:
        """Those of `reqs` whose backlog reached max_rows."""
        return [r for r in reqs if self.behind(r.rid) >= self.max_rows]

    def catch_up(self, drafter, reqs: list, device) -> None:
        """Run the draft over every missed row of `reqs` (those with none are left out), in extends of at most
        max_rows rows."""
        while True:
            todo = [r for r in reqs if self.behind(r.rid)]
            if not todo:
                return
            budget, batch = self.max_rows, []
            for r in todo:
                if budget <= 0:
                    break
                missed = self._missed[r.rid]
                start, n = missed.start, min(missed.rows, budget)
                batch.append((r, start, *missed.take(n)))
                budget -= n
                if not missed.rows:
                    del self._missed[r.rid]
            drafter.extend(_extend_batch(batch, device), decode_round=False)

    def drop(self, rid: int) -> None:
        self._missed.pop(rid, None)


def _extend_batch(batch: list, device) -> ExtendBatch:
    """One extend over the batch's rows; host values reach the device without a sync (to_device)."""
    lens = [len(tokens) for _, _, tokens, _ in batch]
    positions = [start + j for (_, start, _, _), n in zip(batch, lens) for j in range(n)]
    return ExtendBatch(tuple(r.rid for r, *_ in batch), to_device([r.row for r, *_ in batch], device),
                       to_device([start for _, start, _, _ in batch], device), to_device(lens, device),
                       torch.cat([tokens for _, _, tokens, _ in batch]), to_device(positions, device),
                       torch.cat([features for *_, features in batch]), max_extend=max(lens),
                       first_ids=to_device([r.prompt_ids[0] for r, *_ in batch], device))
