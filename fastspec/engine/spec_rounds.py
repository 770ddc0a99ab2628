"""Speculative decode rounds: draft -> verify -> accept -> commit, then the draft extend.

A round is launched (`launch`: everything on the device, its commit included, no read) and then finished
(`finish`: one read of the accept result; the host frees what was not kept and hands out tokens). Serially the
one follows the other (`run`); under the overlap schedule (fastspec.engine.overlap) the next round is launched
between them. `_commit_on_device` and `finish` are where a round's lengths and KV slots advance.
"""

from __future__ import annotations

import time

import torch

from fastspec.engine.produce import Producer, RoundOutput
from fastspec.engine.scheduler import Request
from fastspec.engine.slots import BatchSlots
from fastspec.engine.target import Target
from fastspec.errors import FastspecError
from fastspec.graphs.step_graphs import StepGraphs
from fastspec.sampling.draw import SamplingTensors, position_uniforms
from fastspec.spec_config import SpecConfig, SpecParams
from fastspec.speculative.batch import DecodeBatch
from fastspec.speculative.drafter import Drafter
from fastspec.speculative.future import FutureMaps, PendingRound, start_readback
from fastspec.speculative.kv import DeviceKV, plan_round_kv_on_device, round_free_slots
from fastspec.speculative.packing import pack_verify
from fastspec.speculative.tree import (DraftTree, VerifyResult, select_rows, verify_greedy, verify_sampling,
                                       verify_sampling_thresholds)
from fastspec.utils.transfer import to_device


class SpecRounds:
    def __init__(self, target: Target, slots: BatchSlots, producer: Producer, drafters: dict[SpecParams, Drafter],
                 verify_graphs: dict[int, StepGraphs], futures: FutureMaps, spec: SpecConfig, page_size: int):
        """drafters: SpecParams -> drafter (one per tree shape); verify_graphs: num_draft_tokens -> graphs."""
        self.target, self.slots, self.producer = target, slots, producer
        self.drafters, self.verify_graphs, self.futures = drafters, verify_graphs, futures
        self.spec, self.page_size = spec, page_size

    def run(self, reqs: list[Request], params: SpecParams) -> RoundOutput:
        """One round, launched and finished."""
        return self.finish(self.launch(reqs, params, None))

    def launch(self, reqs: list[Request], params: SpecParams, before: PendingRound | None) -> PendingRound:
        """Draft -> verify -> accept -> commit on the device (table, moves, lengths and root into the future maps)
        -> draft extend; nothing is read back. `before`: the round in flight over these requests, whose lengths
        and roots only the device knows yet (the overlap schedule): they come from the future maps, and the host
        sizes graphs and KV for the longest they can be."""
        start = time.perf_counter()
        batch = self._decode_batch(reqs, before)
        drafter = self.drafters[params]
        tree = drafter.draft(batch)                                            # draft
        free_before = self.slots.allocator.num_free()
        verify_slots, spare, out = self._verify(batch, tree, exact=before is None)  # verify
        logits = self.producer.controlled(reqs, out["logits"], tree)
        result = self._accept(reqs, tree, logits, out)                         # accept
        kv = self._commit_on_device(batch, tree, verify_slots, result)         # commit (device part)
        if drafter.uses_extend:                                                # draft extend
            self._extend(drafter, batch, result, kv, out["features"])
        host, ready = start_readback(result.accept_index, result.emitted)
        keep_logits = out["logits"].clone() if any(r.params.logprobs is not None for r in reqs) else None
        return PendingRound(tuple(reqs), params, verify_slots, host, ready,
                            free_before - self.slots.allocator.num_free(), spare, keep_logits, start)

    def finish(self, p: PendingRound) -> RoundOutput:
        """The host part of a round's commit, once its accept result is read: free the verify KV it did not keep
        (and reserved pages it did not reach), advance lengths, hand out up to a stop. A request an earlier round
        finished (it ran once more under overlap) produces nothing."""
        accept_index, emitted = p.read()  # the round's one read
        n = p.verify_slots.shape[1]
        runs = [[t for t in row if t >= 0] for row in emitted]  # accepted draft tokens + bonus, root first
        kept_nodes = [[i - b * n for i in accept_index[b][: len(run)]] for b, run in enumerate(runs)]
        seq_lens = [r.seq_len for r in p.reqs]  # exact: every round before this one is finished
        allocator = self.slots.allocator
        allocator.free(round_free_slots(p.verify_slots, kept_nodes, seq_lens, self.page_size))
        if p.spare_pages is not None:
            allocator.free(allocator.unused_pages(p.spare_pages, seq_lens, n))
        produced = []
        for r, run, nodes in zip(p.reqs, runs, kept_nodes):
            r.seq_len += len(run)  # the whole run entered the KV, even past a stop (the request is done then)
            self.producer.save_states(r, r.seq_len - len(run), nodes)  # the states verify tracked along `nodes`
            produced.append(self.producer.produce(r, run) if r.done is None else [])
        # token j of a run came from accepted node j's row
        logprobs = {} if p.logits is None else self.producer.logprobs(list(p.reqs), p.logits, accept_index, produced)
        return RoundOutput(produced, [len(run) - 1 for run in runs], logprobs, p.params.max_depth)

    def _decode_batch(self, reqs: list[Request], before: PendingRound | None = None) -> DecodeBatch:
        device = self.slots.device
        if before is None:  # rows, lengths and roots in one copy
            seq = tuple(r.seq_len for r in reqs)
            rows, seq_lens, roots = to_device([[r.row for r in reqs], seq, [r.produced[-1] for r in reqs]], device)
        else:  # the round in flight wrote them: the host knows only that they grew by at most its N tokens
            rows = to_device([r.row for r in reqs], device)
            seq_lens, roots = self.futures.resolve(rows)
            seq = tuple(r.seq_len + before.verify_slots.shape[1] for r in reqs)
        return DecodeBatch(tuple(r.rid for r in reqs), rows, seq_lens, seq, roots, tuple(r.history for r in reqs),
                           tuple(r.grammar for r in reqs) if any(r.grammar is not None for r in reqs) else None)

    def _verify(self, batch: DecodeBatch, tree: DraftTree, exact: bool):
        """Target forward over bs*N tree rows into N newly allocated slots per request; (slots [bs, N], pages
        reserved past what the host can size (paged, lengths unknown: see PagedAllocator.reserve_extend), out)."""
        n, spare, allocator = tree.num_draft_tokens, None, self.slots.allocator
        last_loc = self.slots.last_loc(batch.rows, batch.seq_lens)
        if exact:
            starts = list(batch.seq_lens_cpu)
            slots = allocator.alloc_extend(batch.seq_lens, batch.seq_lens + n, last_loc,
                                           (starts, [s + n for s in starts]))
        else:
            slots, spare = allocator.reserve_extend(batch.seq_lens, n, last_loc) or (None, None)
        if slots is None:
            raise FastspecError("KV pool exhausted")  # unreachable: the engine checked the rounds' headroom
        x = pack_verify(batch, tree, slots.view(batch.size, n))  # verify writes them into the table
        if self.target.states is not None:
            x["state_rows"] = self.target.states.state_rows(batch.rows)
        return x["new_slots"], spare, self.verify_graphs[n](batch.size, x)

    def _accept(self, reqs: list[Request], tree: DraftTree, logits: torch.Tensor, out: dict) -> VerifyResult:
        """Greedy rounds over unchanged logits take the verify graph's own acceptance (it walks N-1 levels: an
        EAGLE tree is no deeper than its num_steps, so its result is cut to those; an arbitrary tree deeper than
        its num_steps, NGRAM's, walks here); any other round walks the tree here. Lossy thresholds relax only the
        sampled rows: a greedy row beside them takes the exact walk (its output is the target's own)."""
        if all(r.params.greedy for r in reqs):
            bounded = tree.topk > 0 or tree.num_steps >= tree.num_draft_tokens - 1
            if logits is out["logits"] and bounded:
                e = tree.num_steps + 1
                return VerifyResult(out["accept_index"][:, :e], out["accept_len"], out["emitted"][:, :e])
            return verify_greedy(tree, logits)
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        seeds, n = to_device([r.seed for r in reqs], logits.device), tree.num_draft_tokens
        drawn = tree.positions.view(-1, n) + 1  # [bs, N]: node i draws the token at its position + 1
        thresholds = (self.spec.accept_threshold_single, self.spec.accept_threshold_acc)
        if thresholds == (1.0, 1.0):
            return verify_sampling(tree, logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                   position_uniforms(seeds, drawn))
        uniforms = position_uniforms(seeds, drawn[:, :1] + torch.arange(n + 1, device=drawn.device))
        relaxed = verify_sampling_thresholds(tree, logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                             uniforms, *thresholds)
        if not any(r.params.greedy for r in reqs):
            return relaxed
        # threshold_single 0 accepts even a draft of target probability 0 (a greedy row's q is one-hot)
        greedy = sampling.top_k == 1  # [bs]: greedy rows carry top_k 1, and a sampled row with top_k 1 is greedy
        return select_rows(greedy, verify_greedy(tree, logits), relaxed)

    def _commit_on_device(self, batch: DecodeBatch, tree: DraftTree, verify_slots: torch.Tensor,
                          result: VerifyResult) -> DeviceKV:
        """The device part of the commit: every accepted node's KV at positions seq_len.. (a table remap, or
        KV moves when paged), the target's recurrent state at the last kept node, and the next round's
        lengths and root into the future maps. The slots it does not keep are freed by `finish`."""
        chain = tree.topk == 1  # node j at depth j: its KV already sits at position seq_len + j
        kv = plan_round_kv_on_device(verify_slots, result.accept_index, self.page_size, chain)
        if kv.move_src is not None:
            self.target.pool.move(kv.move_dst, kv.move_src)
        elif not chain:
            table = self.slots.table.table
            cols = batch.seq_lens[:, None] + torch.arange(kv.nodes.shape[1], device=batch.rows.device)
            table[batch.rows[:, None], cols] = kv.table_slots.to(table.dtype)
        if self.target.states is not None:  # the state after the last kept node (the bonus token is the next root)
            self.target.states.keep_node(batch.rows, kv.nodes.gather(1, (kv.keep_lens - 1)[:, None]).squeeze(1))
        self.futures.write(batch.rows, batch.seq_lens + kv.keep_lens, result.bonus_token)
        return kv

    def _extend(self, drafter, batch: DecodeBatch, result: VerifyResult, kv: DeviceKV, features: torch.Tensor):
        """The draft extend over each request's accepted run (num_steps + 1 padded rows): position seq_len + j
        pairs emitted token j with the target feature of kept node j."""
        index = result.accept_index  # [bs, E]  flat verify rows, -1 past the run
        kept = index >= 0
        e = index.shape[1]
        positions = torch.where(kept, batch.seq_lens[:, None] + torch.arange(e, device=index.device), 0)
        rows = features[index.clamp(min=0).flatten()]  # [bs*E, F]
        drafter.extend_round(batch.rids, batch.rows, batch.seq_lens, kv.keep_lens,
                             torch.where(kept, result.emitted, 0).flatten(), positions.flatten(),
                             torch.where(kept.flatten()[:, None], rows, 0))
