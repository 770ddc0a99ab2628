"""Decode rounds of the worker (fastspec.worker): a plain round (one token per request) or a speculative round,
draft -> verify -> accept -> commit, then the draft extend. A mixin: the worker owns the models, pools, drafters,
graphs and policy these read, and the shared helpers (`_extend_slots`, `_sample`, `_produce`...) they call.
`_commit_round` is where a speculative round's lengths and KV slots advance.
"""

from __future__ import annotations

import time

import torch

from fastspec.attention import decode_metadata
from fastspec.config import SpecParams
from fastspec.memory.state_checkpoints import save_crossed
from fastspec.sampling import SamplingTensors, draw_uniforms
from fastspec.scheduler import Request
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.kv import plan_round_kv
from fastspec.speculative.packing import kv_width, pack_verify, prefix_view
from fastspec.speculative.tree import DraftTree, VerifyResult, verify_greedy, verify_sampling


class DecodeRounds:
    def _decode(self, reqs: list[Request]) -> tuple[list[list[int]], list[int] | None]:
        """One decode round: speculative when a drafter exists and the policy says it pays, else plain."""
        params = self.spec.params_for(len(reqs)) if self.drafter is not None else None
        speculate = params is not None and (self.policy is None or self.policy.speculate(len(reqs)))
        start = time.perf_counter()
        with self.times("round" if speculate else "plain_round"):  # "round" = speculative rounds only
            tokens, accepted = self.spec_round(reqs, params) if speculate else (self.plain_round(reqs), None)
        if self.policy is not None:
            emitted = sum(map(len, tokens)) / len(reqs)
            self.policy.record(len(reqs), speculate, emitted, time.perf_counter() - start)
        return tokens, accepted

    def plain_round(self, reqs: list[Request]) -> list[list[int]]:
        """One token per request. With an EAGLE drafter, the draft extends by that token too, so its state
        stays exact and the next round may speculate again."""
        ids = torch.tensor([r.produced[-1] for r in reqs], device=self.config.device)
        rows, prefix, ext, positions = self._extend_slots(reqs, [1] * len(reqs))
        if self.decode_graphs is not None:
            logits, features = self._decode_graph(reqs, ids, rows, prefix, positions)
        else:
            hidden = self._forward(ids, positions, decode_metadata(self.table.table, rows, prefix + 1), rows,
                                   [1] * len(reqs))
            logits, features = self.model.compute_logits(hidden.final), self._features(hidden)
        tokens = self._sample(reqs, self._controlled(reqs, logits))
        if self.drafter is not None and self.drafter.uses_extend:
            self.drafter.extend(ExtendBatch(tuple(r.rid for r in reqs), rows, prefix, ext,
                                            torch.tensor(tokens, device=ids.device), positions, features,
                                            max(r.seq_len for r in reqs)), decode_round=False)
        produced = self._commit(reqs, [1] * len(reqs), [[t] for t in tokens])
        self._record_logprobs(reqs, logits, [[b] for b in range(len(reqs))], produced)
        self._save_states(reqs, [1] * len(reqs))
        return produced

    def _decode_graph(self, reqs, ids, rows, prefix, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """A plain round's target forward as a one-node tree (its slot already in the table): (logits, features)."""
        width = kv_width(max(r.seq_len for r in reqs), self.decode_graphs.bucketed)
        prefix_slots, prefix_valid = prefix_view(self.table.table, rows, prefix, width)
        x = {"input_ids": ids, "positions": positions, "new_slots": self.table.table[rows, prefix].long()[:, None],
             "tree_mask": torch.ones(len(reqs), 1, 1, dtype=torch.bool, device=ids.device),
             "prefix_slots": prefix_slots, "prefix_valid": prefix_valid}
        out = self.decode_graphs(len(reqs), x, width)
        return out["logits"], out["features"]

    def spec_round(self, reqs: list[Request], params: SpecParams) -> tuple[list[list[int]], list[int]]:
        """One speculative round; per request (what it produced, how many draft tokens were accepted)."""
        batch = self._decode_batch(reqs)
        drafter = self.drafters[params]
        tree = drafter.draft(batch)                                            # draft
        verify_slots, out = self._verify(batch, tree)                          # verify
        logits = self._controlled(reqs, out["logits"], tree)
        result = self._accept(reqs, tree, logits)                              # accept
        runs, extend = self._commit_round(reqs, batch, tree, verify_slots, result, out["features"])  # commit
        if drafter.uses_extend:
            drafter.extend(extend, decode_round=True)                          # draft extend
        produced = [self._produce(r, run) for r, run in zip(reqs, runs)]
        if any(r.params.logprobs is not None for r in reqs):  # token j of a run came from accepted node j's row
            self._record_logprobs(reqs, out["logits"], result.accept_index.tolist(), produced)
        return produced, [len(run) - 1 for run in runs]

    def _decode_batch(self, reqs: list[Request]) -> DecodeBatch:
        device = self.config.device
        seq = tuple(r.seq_len for r in reqs)
        return DecodeBatch(tuple(r.rid for r in reqs), torch.tensor([r.row for r in reqs], device=device),
                           torch.tensor(seq, device=device), seq,
                           torch.tensor([r.produced[-1] for r in reqs], device=device),
                           tuple(r.history for r in reqs),
                           tuple(r.grammar for r in reqs) if any(r.grammar is not None for r in reqs) else None)

    def _verify(self, batch: DecodeBatch, tree: DraftTree):
        """Target forward over bs*N tree rows into N newly allocated slots per request."""
        n = tree.num_draft_tokens
        starts = list(batch.seq_lens_cpu)
        self._alloc_slots(batch.rows, batch.seq_lens, batch.seq_lens + n, (starts, [s + n for s in starts]))
        graphs = self.verify_graphs[n]
        width = kv_width(max(batch.seq_lens_cpu), graphs.bucketed)
        x = pack_verify(batch, tree, self.table.table, width)
        if self.states is not None:
            x["state_rows"] = self.states.state_rows(batch.rows)
        return x["new_slots"], graphs(batch.size, x, width)

    def _accept(self, reqs: list[Request], tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        if sampling.all_greedy:
            return verify_greedy(tree, logits)
        uniforms = draw_uniforms([r.generator for r in reqs], tree.num_draft_tokens + 1, logits.device)
        return verify_sampling(tree, logits, sampling.temperature, sampling.top_k, sampling.top_p, uniforms,
                               self.spec.accept_threshold_single, self.spec.accept_threshold_acc)

    # ---- commit -----------------------------------------------------------------------------------------

    def _commit_round(self, reqs, batch: DecodeBatch, tree: DraftTree, verify_slots, result: VerifyResult,
                      features: torch.Tensor) -> tuple[list[list[int]], ExtendBatch]:
        """Keep the KV of every accepted node (move / free the rest), advance lengths; (runs, draft extend), a run
        being the accepted draft tokens and the bonus token, root first. The whole run enters the KV, even past a
        stop: the request is done then, and released by the engine."""
        n = tree.num_draft_tokens
        accept_index, emitted = torch.stack([result.accept_index, result.emitted]).tolist()  # one read
        runs = [[t for t in row if t >= 0] for row in emitted]  # accepted draft tokens + bonus, root first
        kept_rows = [i for b, run in enumerate(runs) for i in accept_index[b][: len(run)]]  # flat verify rows
        kept_nodes = [[i - b * n for i in accept_index[b][: len(run)]] for b, run in enumerate(runs)]
        plan = plan_round_kv(verify_slots, kept_nodes, list(batch.seq_lens_cpu), self.config.page_size)
        self.allocator.free(plan.free_slots)
        if plan.move_src.numel():
            self.pool.move(plan.move_dst, plan.move_src)
        self.table.write(batch.rows, batch.seq_lens, plan.keep_lens, plan.table_slots)
        if self.states is not None:  # the state after the last kept node (the bonus token is the next root)
            self.states.keep_node(batch.rows, torch.tensor([nodes[-1] for nodes in kept_nodes],
                                                           device=batch.rows.device))
        for r, run, nodes in zip(reqs, runs, kept_nodes):
            r.seq_len += len(run)
            if self.track:  # the states its verify tracked along the kept nodes
                save_crossed(self.states, r, r.seq_len - len(run), nodes, self.config.mamba_track_interval)
        old = batch.seq_lens
        positions = torch.tensor([p for o, run in zip(batch.seq_lens_cpu, runs) for p in range(o, o + len(run))],
                                 device=old.device)
        return runs, ExtendBatch(batch.rids, batch.rows, old, plan.keep_lens,
                                 torch.tensor([t for run in runs for t in run], device=self.config.device),
                                 positions, features[torch.tensor(kept_rows, device=features.device)],
                                 max(batch.seq_lens_cpu))

