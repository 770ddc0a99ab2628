"""Plain decode rounds: one token per request, through the target's decode step function (a one-node verify:
captured, compiled, or eager on CPU) where there is one, else the target's forward over decode metadata. With an
EAGLE-family drafter the round leaves the draft alone and puts the token and its target feature in the draft's
backlog (fastspec.speculative.backlog): the draft catches up before it is next used, so a plain round costs what it
costs without a draft."""

from __future__ import annotations

import torch

from fastspec.attention import decode_metadata
from fastspec.engine.produce import Producer, RoundOutput
from fastspec.engine.scheduler import Request
from fastspec.engine.slots import BatchSlots
from fastspec.engine.target import Target
from fastspec.graphs.step_graphs import StepGraphs
from fastspec.speculative.backlog import DraftBacklog
from fastspec.utils.transfer import to_device


class PlainRounds:
    def __init__(self, target: Target, slots: BatchSlots, producer: Producer, graphs: StepGraphs | None,
                 backlog: DraftBacklog | None):
        """graphs: the decode step graphs (None: the forward over decode metadata); backlog: where an extending
        drafter's missed rows go, or None."""
        self.target, self.slots, self.producer, self.graphs, self.backlog = target, slots, producer, graphs, backlog

    def __call__(self, reqs: list[Request]) -> RoundOutput:
        ones = [1] * len(reqs)
        ids = to_device([r.produced[-1] for r in reqs], self.slots.device)
        rows, prefix, ext, positions = self.slots.extend(reqs, ones)
        if self.graphs is not None:
            logits, features = self._graph_forward(reqs, ids, rows, prefix, positions)
        else:
            hidden = self.target.forward(ids, positions, decode_metadata(self.slots.table.table, rows, prefix + 1),
                                         rows, ones)
            logits, features = self.target.model.compute_logits(hidden.final), self.target.features(hidden)
        tokens = self.producer.sample(reqs, self.producer.controlled(reqs, logits))
        if self.backlog is not None:
            self.backlog.defer([r.rid for r in reqs], [r.seq_len for r in reqs], ones, to_device(tokens, ids.device),
                               features)
        produced = self.producer.commit(reqs, ones, [[t] for t in tokens])
        for r in reqs:
            self.producer.save_states(r, r.seq_len - 1)
        return RoundOutput(produced, logprobs=self.producer.logprobs(reqs, logits, [[b] for b in range(len(reqs))],
                                                                      produced))

    def _graph_forward(self, reqs, ids, rows, prefix, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward as a one-node tree (its slot already in the table): (logits, features)."""
        table = self.slots.table.table
        x = {"input_ids": ids, "positions": positions, "new_slots": table[rows, prefix].long()[:, None],
             "tree_mask": torch.ones(len(reqs), 1, 1, dtype=torch.bool, device=ids.device),
             "rows": rows, "prefix_lens": prefix}
        out = self.graphs(len(reqs), x)
        return out["logits"], out["features"]
