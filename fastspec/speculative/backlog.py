"""The draft's backlog: what plain decode rounds did not run through the draft.

A plain round (the schedule or the measured fallback chose not to speculate) leaves the draft where it was and
keeps, per request, the (token, target feature, position) rows the draft extend would have taken. Before the next
speculative round over a request the draft catches up: one draft extend over all its missed rows, batched over
the requests that have some. Plain decoding thus costs what decoding without a draft costs; the draft pays only
when it is about to be used, and for each token once, as before. A request leaving for the prefix cache catches up
first (the cache keeps draft KV for later requests to speculate from); one freed without it drops its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastspec.speculative.batch import ExtendBatch


@dataclass
class _Missed:
    start: int  # the first missed position (the draft's KV holds the positions before it)
    tokens: list[int] = field(default_factory=list)  # t_{p+1} for p = start, start + 1, ...
    features: list[torch.Tensor] = field(default_factory=list)  # h_p, [F] each


class DraftBacklog:
    def __init__(self, max_rows: int):
        """max_rows: rows per catch-up extend (a long backlog runs in several, like prefill chunks)."""
        self.max_rows = max_rows
        self._missed: dict[int, _Missed] = {}

    def defer(self, rids: list[int], positions: list[int], tokens: list[int], features: torch.Tensor) -> None:
        """A plain round's rows: request rids[b] got tokens[b] at position positions[b] (its KV length before the
        round), the target's feature there being features[b] (copied: graph outputs are reused)."""
        features = features.clone()
        for b, rid in enumerate(rids):
            missed = self._missed.setdefault(rid, _Missed(positions[b]))
            assert missed.start + len(missed.tokens) == positions[b], "draft backlog rows must be contiguous"
            missed.tokens.append(tokens[b])
            missed.features.append(features[b])

    def behind(self, rid: int) -> int:
        """Rows request `rid` has missed."""
        missed = self._missed.get(rid)
        return len(missed.tokens) if missed is not None else 0

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
                n = min(len(missed.tokens), budget)
                batch.append((r, missed.start, missed.tokens[:n], missed.features[:n]))
                budget -= n
            drafter.extend(_extend_batch(batch, device), decode_round=False)
            for r, start, tokens, _ in batch:
                missed = self._missed[r.rid]
                del missed.tokens[: len(tokens)], missed.features[: len(tokens)]
                missed.start += len(tokens)
                if not missed.tokens:
                    del self._missed[r.rid]

    def drop(self, rid: int) -> None:
        self._missed.pop(rid, None)


def _extend_batch(batch: list, device) -> ExtendBatch:
    lens = [len(tokens) for _, _, tokens, _ in batch]
    positions = [start + j for (_, start, tokens, _) in batch for j in range(len(tokens))]
    as_long = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return ExtendBatch(tuple(r.rid for r, *_ in batch), as_long([r.row for r, *_ in batch]),
                       as_long([start for _, start, _, _ in batch]), as_long(lens),
                       as_long([t for _, _, tokens, _ in batch for t in tokens]), as_long(positions),
                       torch.stack([f for *_, features in batch for f in features]), max_extend=max(lens))
