"""Decode rounds of the worker (fastspec.worker): a plain round (one token per request) or a speculative round,
draft -> verify -> accept -> commit, then the draft extend. A mixin: the worker owns the models, pools, drafters,
graphs and policy these read, and the shared helpers (`_extend_slots`, `_sample`, `_produce`...) they call.

A speculative round is launched (`_launch_round`: everything on the device, its commit included, no read) and
then finished (`_finish_round`: one read of the accept result; the host frees what was not kept and hands out
tokens). Serially the one follows the other; under the overlap schedule the worker launches the next round
between them (fastspec.worker). `_commit_on_device` and `_finish_round` are where a round's lengths and KV
slots advance.
"""

from __future__ import annotations

import time

import torch

from fastspec.attention import decode_metadata
from fastspec.config import SpecParams
from fastspec.errors import FastspecError
from fastspec.memory.state_checkpoints import save_crossed
from fastspec.sampling import SamplingTensors, draw_uniforms
from fastspec.scheduler import Request
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.future import PendingRound, start_readback
from fastspec.speculative.kv import DeviceKV, plan_round_kv_on_device, round_free_slots
from fastspec.speculative.packing import kv_width, pack_verify, prefix_view
from fastspec.speculative.tree import DraftTree, VerifyResult, verify_greedy, verify_sampling
from fastspec.transfer import to_device


class DecodeRounds:
    def _round_params(self, reqs: list[Request]) -> SpecParams | None:
        """The next round's tree shape, or None for a plain round (no drafter, or the policy says it does not pay)."""
        params = self.spec.params_for(len(reqs)) if self.drafter is not None else None
        return params if params is not None and (self.policy is None or self.policy.speculate(len(reqs))) else None

    def _decode(self, reqs: list[Request], params: SpecParams | None) -> tuple[list[list[int]], list[int] | None]:
        """One decode round, launched and finished: speculative with `params`, else plain."""
        start = time.perf_counter()
        with self.times("round" if params is not None else "plain_round"):  # "round" = speculative rounds only
            tokens, accepted = self.spec_round(reqs, params) if params is not None else (self.plain_round(reqs), None)
        self._record_rate(reqs, params is not None, tokens, start)
        return tokens, accepted

    def _record_rate(self, reqs: list[Request], speculative: bool, tokens: list[list[int]], start: float) -> None:
        if self.policy is not None:
            emitted = sum(map(len, tokens)) / len(reqs)
            self.policy.record(len(reqs), speculative, emitted, time.perf_counter() - start)

    def plain_round(self, reqs: list[Request]) -> list[list[int]]:
        """One token per request. With an EAGLE drafter, the draft extends by that token too, so its state
        stays exact and the next round may speculate again."""
        ids = to_device([r.produced[-1] for r in reqs], self.config.device)
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
                                            to_device(tokens, ids.device), positions, features,
                                            max(r.seq_len for r in reqs), 1), decode_round=False)
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
        """One speculative round, launched and finished; per request (what it produced, accepted draft tokens)."""
        return self._finish_round(self._launch_round(reqs, params, None))

    def _launch_round(self, reqs: list[Request], params: SpecParams, before: PendingRound | None) -> PendingRound:
        """Draft -> verify -> accept -> commit on the device (table, moves, lengths and root into the future maps)
        -> draft extend; nothing is read back. `before`: the round in flight over these requests, whose lengths
        and roots only the device knows yet (the overlap schedule): they come from the future maps, and the host
        sizes graphs and KV for the longest they can be."""
        start = time.perf_counter()
        batch = self._decode_batch(reqs, before)
        drafter = self.drafters[params]
        tree = drafter.draft(batch)                                            # draft
        free_before = self.allocator.num_free()
        verify_slots, spare, out = self._verify(batch, tree, exact=before is None)  # verify
        logits = self._controlled(reqs, out["logits"], tree)
        result = self._accept(reqs, tree, logits)                              # accept
        kv = self._commit_on_device(batch, tree, verify_slots, result)         # commit (device part)
        if drafter.uses_extend:                                                # draft extend
            self._extend_round(drafter, batch, result, kv, out["features"])
        host, ready = start_readback(result.accept_index, result.emitted)
        keep_logits = out["logits"] if any(r.params.logprobs is not None for r in reqs) else None
        return PendingRound(tuple(reqs), params, verify_slots, host, ready, free_before - self.allocator.num_free(),
                            spare, keep_logits, start)

    def _finish_round(self, p: PendingRound) -> tuple[list[list[int]], list[int]]:
        """The host part of a round's commit, once its accept result is read: free the verify KV it did not keep
        (and reserved pages it did not reach), advance lengths, hand out up to a stop. A request an earlier round
        finished (it ran once more under overlap) produces nothing."""
        accept_index, emitted = p.read()  # the round's one read
        n = p.verify_slots.shape[1]
        runs = [[t for t in row if t >= 0] for row in emitted]  # accepted draft tokens + bonus, root first
        kept_nodes = [[i - b * n for i in accept_index[b][: len(run)]] for b, run in enumerate(runs)]
        seq_lens = [r.seq_len for r in p.reqs]  # exact: every round before this one is finished
        self.allocator.free(round_free_slots(p.verify_slots, kept_nodes, seq_lens, self.config.page_size))
        if p.spare_pages is not None:
            self.allocator.free(self.allocator.unused_pages(p.spare_pages, seq_lens, n))
        produced = []
        for r, run, nodes in zip(p.reqs, runs, kept_nodes):
            r.seq_len += len(run)  # the whole run entered the KV, even past a stop (the request is done then)
            if self.track:  # the states its verify tracked along the kept nodes
                save_crossed(self.states, r, r.seq_len - len(run), nodes, self.config.mamba_track_interval)
            produced.append(self._produce(r, run) if r.done is None else [])
        if p.logits is not None:  # token j of a run came from accepted node j's row
            self._record_logprobs(list(p.reqs), p.logits, accept_index, produced)
        return produced, [len(run) - 1 for run in runs]

    def _decode_batch(self, reqs: list[Request], before: PendingRound | None = None) -> DecodeBatch:
        device = self.config.device
        rows = to_device([r.row for r in reqs], device)
        if before is None:
            seq = tuple(r.seq_len for r in reqs)
            seq_lens, roots = to_device(seq, device), to_device([r.produced[-1] for r in reqs], device)
        else:  # the round in flight wrote them: the host knows only that they grew by at most its N tokens
            seq_lens, roots = self.futures.resolve(rows)
            seq = tuple(r.seq_len + before.verify_slots.shape[1] for r in reqs)
        return DecodeBatch(tuple(r.rid for r in reqs), rows, seq_lens, seq, roots, tuple(r.history for r in reqs),
                           tuple(r.grammar for r in reqs) if any(r.grammar is not None for r in reqs) else None)

    def _verify(self, batch: DecodeBatch, tree: DraftTree, exact: bool):
        """Target forward over bs*N tree rows into N newly allocated slots per request; (slots [bs, N], pages
        reserved past what the host can size (paged, lengths unknown: see PagedAllocator.reserve_extend), out)."""
        n, spare = tree.num_draft_tokens, None
        if exact:
            starts = list(batch.seq_lens_cpu)
            self._alloc_slots(batch.rows, batch.seq_lens, batch.seq_lens + n, (starts, [s + n for s in starts]))
        else:
            last_loc = self._last_loc(batch.rows, batch.seq_lens)
            reserved = self.allocator.reserve_extend(batch.seq_lens, n, last_loc)
            if reserved is None:
                raise FastspecError("KV pool exhausted")  # unreachable: the engine checked two rounds' headroom
            slots, spare = reserved
            self.table.write(batch.rows, batch.seq_lens, torch.full_like(batch.rows, n), slots)
        graphs = self.verify_graphs[n]
        width = kv_width(max(batch.seq_lens_cpu), graphs.bucketed)
        x = pack_verify(batch, tree, self.table.table, width)
        if self.states is not None:
            x["state_rows"] = self.states.state_rows(batch.rows)
        return x["new_slots"], spare, graphs(batch.size, x, width)

    def _accept(self, reqs: list[Request], tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        if sampling.all_greedy:
            return verify_greedy(tree, logits)
        uniforms = draw_uniforms([r.generator for r in reqs], tree.num_draft_tokens + 1, logits.device)
        return verify_sampling(tree, logits, sampling.temperature, sampling.top_k, sampling.top_p, uniforms,
                               self.spec.accept_threshold_single, self.spec.accept_threshold_acc)

    # ---- commit -----------------------------------------------------------------------------------------

    def _commit_on_device(self, batch: DecodeBatch, tree: DraftTree, verify_slots: torch.Tensor,
                          result: VerifyResult) -> DeviceKV:
        """The device part of the commit: every accepted node's KV at positions seq_len.. (a table remap, or
        KV moves when paged), the target's recurrent state at the last kept node, and the next round's
        lengths and root into the future maps. The slots it does not keep are freed by `_finish_round`."""
        chain = tree.topk == 1  # node j at depth j: its KV already sits at position seq_len + j
        kv = plan_round_kv_on_device(verify_slots, result.accept_index, self.config.page_size, chain)
        if kv.move_src is not None:
            self.pool.move(kv.move_dst, kv.move_src)
        elif not chain:
            cols = batch.seq_lens[:, None] + torch.arange(kv.nodes.shape[1], device=batch.rows.device)
            self.table.table[batch.rows[:, None], cols] = kv.table_slots.to(self.table.table.dtype)
        if self.states is not None:  # the state after the last kept node (the bonus token is the next root)
            self.states.keep_node(batch.rows, kv.nodes.gather(1, (kv.keep_lens - 1)[:, None]).squeeze(1))
        self.futures.write(batch.rows, batch.seq_lens + kv.keep_lens, result.bonus_token)
        return kv

    def _extend_round(self, drafter, batch: DecodeBatch, result: VerifyResult, kv: DeviceKV,
                      features: torch.Tensor) -> None:
        """The draft extend over each request's accepted run (num_steps + 1 padded rows): position seq_len + j
        pairs emitted token j with the target feature of kept node j."""
        index = result.accept_index  # [bs, E]  flat verify rows, -1 past the run
        kept = index >= 0
        e = index.shape[1]
        positions = torch.where(kept, batch.seq_lens[:, None] + torch.arange(e, device=index.device), 0)
        rows = features[index.clamp(min=0).flatten()]  # [bs*E, F]
        drafter.extend_round(batch.rids, batch.rows, batch.seq_lens, kv.keep_lens,
                             torch.where(kept, result.emitted, 0).flatten(), positions.flatten(),
                             torch.where(kept.flatten()[:, None], rows, 0), max(batch.seq_lens_cpu))
