"""The EAGLE drafter (EAGLE, EAGLE-3 and STANDALONE): draft extend and multi-step top-k tree drafting.

Owns the draft model, its own static KV pool (same slot ids as the target's: one allocator, one
request->slot table) and, per request, the state the last draft extend left: top-k probabilities, top-k
tokens (target ids) and the draft hidden state. A STANDALONE draft also attends each request's first token t_0:
its K/V (`draft_sink`) in the slot of the request's table row past the pool's token slots (KVPool.row_slot),
written on the request's first extend, before the draft sees any of its rows. The draft loop and the decode-round
draft extend run as static step functions (fastspec.speculative.steps) through StepGraphs. Drafting writes draft KV
only into scratch slots taken under an allocator backup and handed back by restore_state, so it never consumes
pool capacity. Does not verify, accept or commit (the engine does).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from fastspec.graphs import StaticInput
from fastspec.graphs.step_graphs import GraphPlan, StepGraphs
from fastspec.memory import KVPool, ReqToTokenTable, SlotAllocator
from fastspec.sampling.grammar import draft_masks
from fastspec.speculative.batch import DecodeBatch, ExtendBatch
from fastspec.speculative.packing import pack_draft, pack_extend, pack_extend_padded, prefix_specs
from fastspec.speculative.steps import as_tree, draft_extend, draft_loop, draft_sink, draft_top_k
from fastspec.speculative.tree import DraftTree
from fastspec.utils.transfer import to_device


@dataclass(frozen=True)
class DraftState:
    """Per request: what the last draft extend predicts for the next token."""

    topk_p: torch.Tensor  # float32 [topk]
    topk_index: torch.Tensor  # int64 [topk]  target-vocabulary ids
    hidden: torch.Tensor  # [Hd]  the draft hidden state of the last extended position
    layers: torch.Tensor | None = None  # [D-1, Hd]  a draft with a layer per step: layers 1..D-1's, alike
    normed: torch.Tensor | None = None  # [Hd]  what the top-k was scored from (a grammar re-scores it masked)


class EagleDrafter:
    uses_extend = True

    def __init__(self, model, pool: KVPool, table: ReqToTokenTable, allocator: SlotAllocator, num_steps: int,
                 topk: int, num_draft_tokens: int, feature_width: int, plan: GraphPlan, times=None,
                 extend_topk: int | None = None, states: dict | None = None):
        """`extend_topk` >= topk and a shared `states` dict let drafters of several tree shapes (a batch-size
        schedule) take turns on the same requests: the extend keeps the top extend_topk, each draft slices it."""
        self.model, self.pool, self.table, self.allocator = model, pool, table, allocator
        self.num_steps, self.topk, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.hot_token_id = model.hot_token_map()  # [Vd] draft id -> target id, or None
        self.states: dict[int, DraftState] = {} if states is None else states
        self.extend_topk = extend_topk or topk
        self.sinks = model.first_token_sink
        if self.sinks and pool.row_slots < table.table.shape[0]:
            raise ValueError("a draft with a first-token sink needs a KV pool with a row slot per table row")
        self._extend_fn = partial(draft_extend, model, self.hot_token_id, pool, table.table, self.extend_topk)
        self._loop = loop = partial(draft_loop, model, self.hot_token_id, pool, table.table, topk, num_steps,
                                    num_draft_tokens)
        name = "draft loop" if extend_topk is None else f"draft loop {num_steps}/{topk}/{num_draft_tokens}"
        dtype = next(model.parameters()).dtype
        # module functions, not bound methods: a method here would make a drafter <-> graphs reference cycle
        # that keeps a dropped engine's weights alive until the garbage collector happens to run
        loop_inputs = loop_specs(topk, num_steps, model.config.hidden_size, dtype, table.pad_row, self.sinks)
        self.loop_graphs = StepGraphs(name, loop, loop_inputs, plan, times, "draft", persist=())  # verify reads it
        extend_inputs = extend_specs(num_steps, dtype, feature_width, model.per_step_layers - 1,
                                     model.config.hidden_size, table.pad_row, self.sinks)
        self.extend_graphs = StepGraphs("draft extend", self._extend_fn, extend_inputs, plan, times, "draft_extend")

    @property
    def uses_scratch(self) -> bool:
        return self.num_steps > 1

    # ---- draft extend (prefill chunks and after each verify) ---------------------------------------------

    def extend(self, batch: ExtendBatch, decode_round: bool) -> None:
        """Run the draft over new positions (KV into the slots the target used); keep each request's top-k.

        Decode rounds extend by at most num_steps+1 tokens per request and run as a static graph; prefill
        chunks have arbitrary lengths and run eagerly at exact shapes (as SGLang does)."""
        graphs = self.extend_graphs if decode_round else None
        rows = self.num_steps + 1 if decode_round else (batch.max_extend or int(batch.extend_lens.max()))
        self._run_extend(batch.rids, pack_extend(batch, rows), graphs, batch.first_ids)

    def extend_round(self, rids: tuple[int, ...], rows, prefix_lens, keep_lens,  # int64 [bs] each
                     input_ids, positions,  # int64 [bs*E], E = num_steps + 1 rows per request
                     features: torch.Tensor) -> None:  # [bs*E, F]
        """A decode round's draft extend from rows already padded on the device (row b*E + j real while
        j < keep_lens[b]): no host value is needed."""
        x = pack_extend_padded(rows, prefix_lens, keep_lens, input_ids, positions, features)
        self._run_extend(rids, x, self.extend_graphs)

    def _run_extend(self, rids: tuple[int, ...], x: dict, graphs, first_ids: torch.Tensor | None = None) -> None:
        """first_ids int64 [bs]: each request's t_0, for a draft with a first-token sink (needed for requests new
        to it; a decode round's requests are not)."""
        if self.sinks:
            self._write_sinks(rids, x["rows"], first_ids)
            x["sink"] = self.pool.row_slot(x["rows"])
        layered = self.model.per_step_layers > 1
        if layered:  # what each layer after the first reads at the position before this extend's first row
            x["prev_hidden"] = torch.stack([self._layers_before(rid, x["features"]) for rid in rids])
        out = graphs(len(rids), x) if graphs else self._extend_fn(x)
        for b, rid in enumerate(rids):
            layers = out["layer_hidden"][b].clone() if layered else None
            self.states[rid] = DraftState(out["topk_p"][b], out["topk_index"][b], out["hidden"][b], layers,
                                          out["normed"][b])

    def _write_sinks(self, rids: tuple[int, ...], rows: torch.Tensor, first_ids: torch.Tensor | None) -> None:
        """The t_0 key of each request not extended before (a new request, or one re-admitted after preemption:
        `release` forgot it), into its table row's slot."""
        new = [b for b, rid in enumerate(rids) if rid not in self.states]
        if new:
            assert first_ids is not None, "a request's first draft extend needs its first token"
            index = to_device(new, rows.device)
            draft_sink(self.model, self.pool, self.table.table, rows[index], self.pool.row_slot(rows[index]),
                       first_ids[index])

    def _layers_before(self, rid: int, like: torch.Tensor) -> torch.Tensor:
        """[D-1, Hd]: the last extend's per-layer outputs, zeros before a sequence's first position."""
        state = self.states.get(rid)
        if state is not None:
            return state.layers
        return like.new_zeros(self.model.per_step_layers - 1, self.model.config.hidden_size)

    def release(self, rid: int) -> None:
        self.states.pop(rid, None)

    # ---- multi-step drafting -----------------------------------------------------------------------------

    def draft(self, batch: DecodeBatch) -> DraftTree:
        """num_steps-1 draft forwards over bs*topk rows; the best num_draft_tokens-1 candidates as a tree."""
        states = [self.states[rid] for rid in batch.rids]
        topk_p = torch.stack([s.topk_p[:self.topk] for s in states])  # [bs, topk] (sorted: a prefix is the top-k)
        topk_index = torch.stack([s.topk_index[:self.topk] for s in states])  # [bs, topk]
        hidden = torch.stack([s.hidden for s in states])  # [bs, Hd]
        scratch = self._assign_scratch_slots(batch) if self.num_steps > 1 else None
        if batch.grammars is not None:  # structured output: every step's top-k masked, eagerly (host callbacks)
            normed = torch.stack([s.normed for s in states])
            root = draft_masks(batch.grammars, batch.verified_id.new_zeros(batch.size, 0))
            topk_p, topk_index = draft_top_k(self.model, self.hot_token_id, normed, self.topk, root)
        x = pack_draft(batch, topk_p, topk_index, hidden, scratch, self.topk)
        if self.sinks:
            x["sink"] = self.pool.row_slot(batch.rows)
        if batch.grammars is None:
            out = self.loop_graphs(batch.size, x)
        else:
            with self.loop_graphs.times("draft"):
                out = self._loop(x, partial(draft_masks, batch.grammars))
        return as_tree(out, self.num_steps, self.topk)

    def _assign_scratch_slots(self, batch: DecodeBatch) -> torch.Tensor:
        """Scratch draft KV slots [bs*topk, S] (row b*topk+k, step i), taken and handed straight back.

        The slots are logically free again before the draft forwards run: nothing allocates until verify,
        which may reuse them (harmless: scratch draft KV is dead once the tree is built). With page_size > 1
        whole fresh pages are taken; every attention backend here addresses KV per token, so scratch slots
        need no alignment with the request's last partial page.
        """
        n = batch.size * self.topk * self.num_steps
        page = self.allocator.page_size
        state = self.allocator.backup_state()
        slots = self.allocator.alloc(-(-n // page) * page)
        self.allocator.restore_state(state)
        if slots is None:
            raise RuntimeError("no free KV slots for draft scratch (admission should have reserved them)")
        return slots[:n].view(batch.size * self.topk, self.num_steps)

    # ---- static input layouts ------------------------------------------------------------------------------


def loop_specs(topk: int, num_steps: int, hidden_size: int, dtype: torch.dtype, pad_row: int,
               sink: bool = False) -> list[StaticInput]:
    """The draft loop's static inputs per request (seq_lens: the committed length its table row holds; with `sink`
    the slot of its first-token key, padded rows: the dummy slot)."""
    return [StaticInput("topk_p", (topk,), torch.float32), StaticInput("topk_index", (topk,), torch.int64),
            StaticInput("hidden", (hidden_size,), dtype), StaticInput("seq_lens", (), torch.int64),
            StaticInput("rows", (), torch.int64, pad_value=pad_row), StaticInput("verified_id", (), torch.int64),
            StaticInput("scratch", (max(num_steps, 1),), torch.int64, rows_per_request=topk), *sink_specs(sink)]


def extend_specs(num_steps: int, dtype: torch.dtype, feature_width: int, extra_layers: int, hidden_size: int,
                 pad_row: int, sink: bool = False) -> list[StaticInput]:
    """The draft extend's static inputs: num_steps + 1 padded rows per request (and, for a draft with a layer
    per step, the extra layers' outputs before the first row; with `sink`, as loop_specs)."""
    e = num_steps + 1
    layered = [StaticInput("prev_hidden", (extra_layers, hidden_size), dtype)] if extra_layers else []
    return [StaticInput("input_ids", (), torch.int64, e), StaticInput("positions", (), torch.int64, e),
            StaticInput("features", (feature_width,), dtype, e), *prefix_specs(pad_row),
            StaticInput("extend_lens", (), torch.int64),
            *layered, *sink_specs(sink)]


def sink_specs(sink: bool) -> list[StaticInput]:
    """A first-token sink's static input: the slot of each request's t_0 key (padded rows: the dummy slot)."""
    return [StaticInput("sink", (), torch.int64)] if sink else []
