"""The EAGLE drafter (EAGLE, EAGLE-3 and STANDALONE): draft extend and multi-step top-k tree drafting.

Owns the draft model, its own static KV pool (same slot ids as the target's: one allocator, one
request->slot table) and, per request, the state the last draft extend left: top-k probabilities, top-k
tokens (target ids) and the draft hidden state. Drafting writes draft KV only into scratch slots taken
under an allocator backup and handed back by restore_state, so it never consumes pool capacity.
Does not verify, accept or commit (the engine does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.attention import AttentionContext, draft_decode_metadata, extend_metadata, with_ancestor_slots
from fastspec.kernels import fast_topk
from fastspec.models.eagle import DraftHidden
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.tree import DraftTree, build_tree, organize_draft_results, select_top_k


@dataclass(frozen=True)
class DraftState:
    """Per request: what the last draft extend predicts for the next token."""

    topk_p: torch.Tensor  # float32 [topk]
    topk_index: torch.Tensor  # int64 [topk]  target-vocabulary ids
    hidden: torch.Tensor  # [Hd]  the draft hidden state of the last extended position


class StandaloneDraft(torch.nn.Module):
    """A full small LM as the draft (STANDALONE): same interface as the EAGLE heads, features ignored."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, input_ids, positions, hidden, attn) -> DraftHidden:
        h = self.lm(input_ids, positions, attn).final
        return DraftHidden(h, h)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm.compute_logits(normed)

    def hot_token_map(self) -> None:
        return None


class EagleDrafter:
    uses_extend = True

    def __init__(self, model, pool, backend, table, allocator, num_steps: int, topk: int, num_draft_tokens: int):
        self.model, self.pool, self.backend = model, pool, backend
        self.table, self.allocator = table, allocator
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.hot_token_id = model.hot_token_map()  # [Vd] draft id -> target id, or None
        self.states: dict[int, DraftState] = {}

    @property
    def uses_scratch(self) -> bool:
        return self.num_steps > 1

    # ---- draft extend (prefill chunks and after each verify) ---------------------------------------------

    def extend(self, batch: ExtendBatch) -> None:
        """Run the draft over new positions (KV into the slots the target used); keep each request's top-k."""
        meta = extend_metadata(self.table.table, batch.rows, batch.prefix_lens, batch.extend_lens)
        out = self.model(batch.input_ids, batch.positions, batch.features, self._ctx(meta))
        last = batch.last_rows
        topk_p, topk_index = self._top_k(self.model.compute_logits(out.normed[last]))
        hidden = out.carry[last]
        for b, rid in enumerate(batch.rids):
            self.states[rid] = DraftState(topk_p[b], topk_index[b], hidden[b])

    def release(self, rid: int) -> None:
        self.states.pop(rid, None)

    # ---- multi-step drafting -----------------------------------------------------------------------------

    def draft(self, batch: DecodeBatch) -> DraftTree:
        """num_steps-1 draft forwards over bs*topk rows; the best num_draft_tokens-1 candidates as a tree.

        Unlike SGLang (whose row k attends branch k's scratch KV even after top-k selection moved a child of
        another branch into row k), every row attends the draft KV of its true ancestors: exact for any topk.
        """
        states = [self.states[rid] for rid in batch.rids]
        topk_p = torch.stack([s.topk_p for s in states])  # [bs, topk]
        topk_index = torch.stack([s.topk_index for s in states])  # [bs, topk]
        hidden = torch.stack([s.hidden for s in states])  # [bs, Hd]
        scratch = self._assign_scratch_slots(batch) if self.num_steps > 1 else None  # [bs*topk, S]
        row_seq = batch.seq_lens.repeat_interleave(self.topk)  # [bs*topk]  draft forward i sits at seq_len + i
        scores, ancestors, score_list, token_list, parents_list = None, None, [], [], []
        for step in range(self.num_steps):
            sel = select_top_k(step, topk_p, topk_index, hidden, scores, self.topk)
            score_list.append(sel.score_entry), token_list.append(sel.token_entry)
            parents_list.append(sel.parent_entry)
            if step == self.num_steps - 1:
                break
            meta = draft_decode_metadata(self.table.table, batch.rows, batch.seq_lens, self.topk, self.num_steps, step)
            if step > 0:  # each row's path: its parent's path + the slot its parent wrote last step
                parent_slot = scratch[sel.parent_rows, step - 1, None]
                ancestors = parent_slot if ancestors is None else torch.cat([ancestors[sel.parent_rows], parent_slot], 1)
                meta = with_ancestor_slots(meta, row_seq, ancestors)
            out = self.model(sel.input_ids, row_seq + step, sel.hidden, self._ctx(meta))
            topk_p, topk_index = self._top_k(self.model.compute_logits(out.normed))
            hidden, scores = out.carry, sel.scores
        parent_list, top_scores_index, draft_tokens = organize_draft_results(
            score_list, token_list, parents_list, self.num_draft_tokens)
        return build_tree(batch.verified_id, parent_list, top_scores_index, draft_tokens, batch.seq_lens,
                          self.topk, self.num_steps, self.num_draft_tokens, sum(batch.seq_lens_cpu))

    def _assign_scratch_slots(self, batch: DecodeBatch) -> torch.Tensor:
        """Scratch draft KV slots at table[row, seq_len + k*num_steps + i], taken and handed straight back.

        The slots are logically free again before the draft forwards run: nothing allocates until verify,
        which may reuse them (harmless: scratch draft KV is dead once the tree is built). With page_size > 1
        whole fresh pages are taken; every attention backend here addresses KV per token, so scratch slots
        need no alignment with the request's last partial page.
        """
        per_request = self.topk * self.num_steps
        n = batch.size * per_request
        page = self.allocator.page_size
        state = self.allocator.backup_state()
        slots = self.allocator.alloc(-(-n // page) * page)
        self.allocator.restore_state(state)
        if slots is None:
            raise RuntimeError("no free KV slots for draft scratch (admission should have reserved them)")
        lens = torch.full_like(batch.seq_lens, per_request)
        self.table.write(batch.rows, batch.seq_lens, lens, slots[:n])
        return slots[:n].view(batch.size * self.topk, self.num_steps)  # [bs*topk, S]: row b*topk+k, step i

    # ---- helpers -----------------------------------------------------------------------------------------

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, Vd] -> (probs [T, topk] float32, target-vocabulary ids [T, topk])."""
        topk_p, index = fast_topk(torch.softmax(logits, dim=-1), self.topk, -1)
        return topk_p, index if self.hot_token_id is None else self.hot_token_id[index]

    def _ctx(self, meta) -> AttentionContext:
        return AttentionContext.build(self.backend, meta, self.pool)
