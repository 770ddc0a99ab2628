"""The three static-shape functions of a speculative round, each captured / compiled per batch-size bucket:
the multi-step draft loop, the draft extend, and the target forward (a verify; with one node, a plain decode).

Each takes a dict of tensors whose shapes depend only on the batch bucket (never on a context length) and
contains no host sync and no data-dependent Python control flow, so the same code runs eagerly, under
torch.compile(fullgraph=True) and inside a CUDA graph. Attention is paged (fastspec.attention.paged): every request
sees its committed KV through its request->slot `table` row up to `prefix_lens` (device values, read by the
kernel) plus a block of keys under a static mask, so one graph serves every context length.
A STANDALONE draft's first-token key is written once per request by `draft_sink` (eager, before its first extend).
Host-side packing of these dicts lives in fastspec.speculative.packing; nothing here touches the allocator.
"""

from __future__ import annotations

import torch

from fastspec.attention import AttentionContext
from fastspec.attention.paged import PagedPlan, paged_block_plan
from fastspec.kernels import cpu_fused, fast_topk
from fastspec.kernels.cpu_attention import CpuPagedBackend
from fastspec.memory.state_pool import RecurrentView
from fastspec.models.recurrent import tree_parents
from fastspec.speculative.tree import DraftTree, build_tree, organize_draft_results, select_top_k, verify_predicted

TREE_FIELDS = ("draft_tokens", "positions", "tree_mask", "retrieve_index", "retrieve_next_token",
               "retrieve_next_sibling")

_BACKEND = CpuPagedBackend()


def draft_top_k(model, hot_token_id, normed: torch.Tensor, topk: int, allowed: torch.Tensor | None = None):
    """Draft logits -> (probs [T, topk] float32, target-vocabulary ids [T, topk]). `allowed` (bool [T, V] over
    the target vocabulary, a grammar's mask; eager drafting only): the top-k among the allowed tokens, their
    probabilities renormalised over the allowed ones (a row allowing none keeps probability 0 everywhere)."""
    probs = torch.softmax(model.compute_logits(normed), dim=-1)
    if allowed is not None:
        probs = probs * (allowed if hot_token_id is None else allowed[:, hot_token_id])
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    topk_p, index = fast_topk(probs, topk, -1)
    return topk_p, index if hot_token_id is None else hot_token_id[index]


def draft_extend(model, hot_token_id, pool, table, topk: int, x: dict) -> dict:
    """Draft forward over E new positions per request (causal) -> the top-k after each request's last row.

    x: input_ids, positions [bs*E] (row b*E + j real while j < extend_lens[b]); features [bs*E, F]; rows,
       prefix_lens, extend_lens int64 [bs] (table row, committed length before the extend, new tokens: their
       slots are read from the table at positions prefix_lens + j);
       a draft with a layer per step (D > 1) also prev_hidden [bs, D-1, H] and returns layer_hidden alike;
       a draft with a first-token sink also sink int64 [bs] (the slot of each request's t_0 key, seen by every row).
    """
    rows, lens = x["rows"], x["extend_lens"]
    bs, device = rows.shape[0], rows.device
    e = x["input_ids"].shape[0] // bs
    j = torch.arange(e, device=device)
    valid = j[None, :] < lens[:, None]  # [bs, E]
    cols = (x["prefix_lens"][:, None] + j[None, :]).clamp(max=table.shape[1] - 1)
    new_slots = torch.where(valid, table[rows[:, None], cols].to(torch.int64), 0)  # padded rows: dummy slot 0
    new_mask = torch.ones(e, e, dtype=torch.bool, device=device).tril() & valid[:, None, :]  # (+ the diagonal)
    plan = paged_block_plan(table, rows, x["prefix_lens"], new_slots, new_mask, x.get("sink"))
    attn = AttentionContext(_BACKEND, plan, pool)
    last = torch.arange(bs, device=device) * e + (lens - 1).clamp(min=0)  # each request's last real row
    if model.per_step_layers > 1:  # one layer per step: each reads the layer before at the position before
        out, layers = model.extend(x["input_ids"], x["positions"], x["features"], x["prev_hidden"], attn, e)
        extra = {"layer_hidden": layers[last]}  # [bs, D-1, H]: the next extend's `prev_hidden`
    else:
        out, extra = model(x["input_ids"], x["positions"], x["features"], attn), {}
    topk_p, topk_index = draft_top_k(model, hot_token_id, out.normed[last], topk)
    return {"topk_p": topk_p, "topk_index": topk_index, "hidden": out.carry[last], "normed": out.normed[last],
            **extra}


def draft_sink(model, pool, table, rows: torch.Tensor, sink: torch.Tensor,  # int64 [n] each: table row, slot
               first_ids: torch.Tensor) -> None:  # int64 [n]
    """A draft with a first-token sink (StandaloneDraft): write each request's t_0 K/V into its sink slot. It sees
    only itself (no prefix), so it depends on t_0 alone: cached draft KV of the same prefix attended the same key."""
    plan = paged_block_plan(table, rows, torch.zeros_like(rows), sink[:, None],
                            torch.ones(sink.shape[0], 1, 1, dtype=torch.bool, device=sink.device))
    model.sink(first_ids, AttentionContext(_BACKEND, plan, pool))


def draft_loop(model, hot_token_id, pool, table, topk: int, num_steps: int, num_draft_tokens: int, x: dict,
               allowed=None) -> dict:
    """select_top_k + num_steps-1 draft forwards over bs*topk rows + organize, with exact ancestry, then the
    verify tree (its tensors: TREE_FIELDS; `as_tree` makes the DraftTree).
    `allowed(paths int64 [R, depth]) -> bool [R, V]` (eager only: a host callback) masks each step's top-k by
    what may follow each row's draft path (structured output).

    x: topk_p [bs, topk] f32, topk_index [bs, topk] i64, hidden [bs, Hd], rows, seq_lens [bs] (table row,
       committed length), verified_id [bs] (the root tokens), scratch int64 [bs*topk, S] (row b*topk+k, step i);
       a draft with a first-token sink also sink int64 [bs] (as draft_extend's).
    Row r of forward i attends its request's prefix, the draft KV of its true ancestors (slots its ancestors
    wrote in earlier steps) and itself; unlike SGLang's per-branch-slot history this is exact for any topk.
    """
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        *draft_candidates(model, hot_token_id, pool, table, topk, num_steps, x, allowed), num_draft_tokens)
    tree = build_tree(x["verified_id"], parent_list, top_scores_index, draft_tokens, x["seq_lens"], topk, num_steps,
                      num_draft_tokens, in_graph=True)
    return {name: getattr(tree, name) for name in TREE_FIELDS}


def as_tree(out: dict, num_steps: int, topk: int) -> DraftTree:
    """draft_loop's outputs as the DraftTree verify takes."""
    return DraftTree(*(out[name] for name in TREE_FIELDS), num_steps, topk)


def draft_candidates(model, hot_token_id, pool, table, topk: int, num_steps: int, x: dict, allowed=None):
    """The draft loop before `organize`: per step, the candidates' scores, tokens and parents (lists of
    num_steps tensors; see select_top_k). A tree of fewer steps or fewer draft tokens is organised from a prefix
    of these lists, which is how `fastspec tune` replays every (num_steps, num_draft_tokens) from one run."""
    topk_p, topk_index, hidden = x["topk_p"], x["topk_index"], x["hidden"]
    table_rows = x["rows"].repeat_interleave(topk)  # [R]  every branch row reads its request's prefix
    positions = x["seq_lens"].repeat_interleave(topk)  # [R]  the prefix length; forward i sits at seq_len + i
    scratch = x["scratch"]
    shared = [] if "sink" not in x else [x["sink"].repeat_interleave(topk)[:, None]]  # [R, 1]  seen by every row
    rows = positions.shape[0]
    ancestors = scratch[:, :0]  # [R, i]  draft KV slots of each row's path
    scores, score_list, token_list, parents_list = None, [], [], []
    for step in range(num_steps):
        sel = select_top_k(step, topk_p, topk_index, hidden, scores, topk)
        score_list.append(sel.score_entry), token_list.append(sel.token_entry)
        parents_list.append(sel.parent_entry)
        if step == num_steps - 1:
            break
        layered = model.per_step_layers > 1  # each step its own layer: the ancestors' draft KV is another's
        if step > 0 and not layered:  # a row's path = its parent's path + the slot its parent wrote last step
            ancestors = torch.cat([ancestors[sel.parent_rows], scratch[sel.parent_rows, step - 1:step]], 1)
        if allowed is not None:  # each row's draft tokens so far
            token = sel.input_ids[:, None]
            paths = token if step == 0 else torch.cat([paths[sel.parent_rows], token], 1)  # noqa: F821 (set at 0)
        own = scratch[:, step:step + 1]  # the slot this forward writes; its ancestors' and its own KV as the block
        block = torch.cat([ancestors, own, *shared], 1)
        visible = torch.ones(rows, 1, block.shape[1], dtype=torch.bool, device=block.device)
        plan = PagedPlan(table, table_rows, positions, block, visible, own.flatten())
        attn = AttentionContext(_BACKEND, plan, pool)
        args = (sel.input_ids, positions + step, sel.hidden, attn)
        out = model(*args, step=step + 1) if layered else model(*args)  # the extend was step 0
        topk_p, topk_index = draft_top_k(model, hot_token_id, out.normed, topk,
                                         None if allowed is None else allowed(paths))
        hidden, scores = out.carry, sel.scores
    return score_list, token_list, parents_list


def target_forward(model, pool, table, feature: str, x: dict, states=None, accept: bool = False) -> dict:
    """Target forward over N tokens of every request under a tree mask: a verify of the draft tree, or with N = 1
    a plain decode step (the same function, so both capture alike). With `accept` (a speculative
    round) it first writes the new slots into the table at positions prefix_len.. (padded rows: the pad row), and
    also returns the greedy acceptance (verify_greedy over a depth of N-1: slice accept_index / emitted to the
    tree's num_steps+1), so a round neither writes the table nor walks the tree on the host.

    x: input_ids, positions [bs*N]; new_slots [bs, N]; tree_mask bool [bs, N, N] (ancestors + self);
       rows, prefix_lens [bs] (table row, committed length); with a hybrid target's `states` (a StatePool) also
       state_rows [bs], whose states every node starts from along its tree path (each node's state is tracked).
    With `accept` x also holds the tree's retrieve_index, retrieve_next_token, retrieve_next_sibling [bs, N].
    Returns logits [bs*N, V] f32 and features [bs*N, F] (and accept_index, accept_len, emitted).
    """
    if accept:
        n = x["new_slots"].shape[1]
        cols = x["prefix_lens"][:, None] + torch.arange(n, device=x["new_slots"].device)[None, :]
        table[x["rows"][:, None], cols] = x["new_slots"].to(table.dtype)
    plan = paged_block_plan(table, x["rows"], x["prefix_lens"], x["new_slots"], x["tree_mask"])
    view = None if states is None else RecurrentView(states, x["state_rows"], parents=tree_parents(x["tree_mask"]))
    hidden = model(x["input_ids"], x["positions"], AttentionContext(_BACKEND, plan, pool, view))
    features = hidden.aux if feature == "aux" else hidden.final
    out = {"logits": model.compute_logits(hidden.final), "features": features}
    if accept:
        n = x["new_slots"].shape[1]
        tree = DraftTree(x["input_ids"].view(-1, n), x["positions"], x["tree_mask"], x["retrieve_index"],
                         x["retrieve_next_token"], x["retrieve_next_sibling"], n - 1, 0)
        predict = cpu_fused.argmax(out["logits"])  # [bs*N]  (torch's inside a compiled graph)
        result = verify_predicted(tree, predict.view(-1, n), in_graph=True)
        # an accepted child's token is the target's argmax after its parent: every emitted token is an argmax
        # (read here, not from the walk's scattered `predicts`: compiled at batch 4 by Inductor on torch 2.13 those
        # came out wrong where eager was right)
        index = result.accept_index
        emitted = torch.where(index >= 0, predict[index.clamp(min=0)], -1)
        out |= {"accept_index": index, "accept_len": result.accept_len, "emitted": emitted}
    return out
