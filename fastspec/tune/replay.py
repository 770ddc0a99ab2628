"""Acceptance by replay: tau of every (num_steps, topk, num_draft_tokens) from one draft pass per topk.

Why it is exact for greedy decoding: the greedy output is the same for every configuration (speculation is
lossless), and the draft's state when a round starts after n committed tokens depends only on n (its KV rows
0..n-1 are each fed (token p+1, target feature p)). So for every possible round start n we run the draft loop
once per topk with the deepest num_steps, keep its candidates (`draft_candidates`), and then, offline, organise
any smaller tree from a prefix of them, accept it against the known greedy continuation, and walk the rounds a
configuration would take. No target forward beyond one prefill of each recorded sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.attention import AttentionContext, TorchAttnBackend
from fastspec.attention.torch_backend import block_plan
from fastspec.memory import KVPool
from fastspec.spec_config import SpecParams
from fastspec.speculative.steps import draft_candidates, draft_top_k
from fastspec.speculative.tree import build_tree, organize_draft_results, verify_predicted
from fastspec.train.data import PackedCausalAttention

_BACKEND = TorchAttnBackend()


@dataclass(frozen=True)
class Recorded:
    """One greedy sequence: accept_len of every configuration at every round start."""
    prompt_len: int
    output_len: int  # tokens the engine emitted (the first from prefill)
    accept: dict[SpecParams, list[int]]  # params -> accept_len for round start n = prompt_len + i


def candidate_params(max_steps: int, topks: tuple[int, ...], max_draft_tokens: int) -> list[SpecParams]:
    """Every feasible configuration: topk 1 is a chain (N = S + 1); otherwise 2 <= N <= the nodes drafted."""
    out = []
    for k in topks:
        for s in range(1, max_steps + 1):
            nodes = k + (s - 1) * k * k
            ns = [s + 1] if k == 1 else range(2, min(nodes, max_draft_tokens - 1) + 2)
            out += [SpecParams(s, k, n) for n in ns]
    return out


@torch.inference_mode()
def record(target, draft, hot_token_id, feature: str, prompt_ids: list[int], output_ids: list[int],
           params: list[SpecParams], chunk: int = 64) -> Recorded:
    """Replay one (prompt, greedy output) for every configuration in `params`, on the models' device (every
    tensor made here and in the functions it calls: `fastspec tune` on CUDA replays its engine's CUDA models)."""
    device = next(target.parameters()).device
    with torch.device(device):
        return _record(target, draft, hot_token_id, feature, prompt_ids, output_ids, params, chunk, device)


def _record(target, draft, hot_token_id, feature, prompt_ids, output_ids, params, chunk, device) -> Recorded:
    seq = torch.tensor(prompt_ids + output_ids)
    L, P = seq.numel(), len(prompt_ids)
    attn = PackedCausalAttention(torch.zeros(L, dtype=torch.long), target.config.hybrid)
    hidden = target(seq, torch.arange(L), attn)
    features = hidden.aux if feature == "aux" else hidden.final
    starts = list(range(P, P + len(output_ids) - 1))  # committed length n at each possible round start
    max_steps, max_k = max(p.num_steps for p in params), max(p.topk for p in params)
    c = draft.config
    dtype = next(draft.parameters()).dtype
    layers, heads, dim, separate_v = c.kv_layout
    pool = KVPool(layers, heads, dim, L + chunk * max_k * max_steps, 1, dtype, device, separate_v=separate_v)
    rows, _ = draft_prefill(draft, pool, seq, features[:-1])  # row p: (token p+1, feature p) in slot p + 1
    accept = {p: [] for p in params}
    for i in range(0, len(starts), chunk):
        n = torch.tensor(starts[i:i + chunk])
        for k in sorted({p.topk for p in params}):
            lists = round_candidates(draft, hot_token_id, pool, rows, n, k, max_steps, L)
            for p in (p for p in params if p.topk == k):
                accept[p] += _accept_lens(lists, n, seq, p).tolist()
    return Recorded(P, len(output_ids), accept)


def draft_prefill(draft, pool, seq: torch.Tensor, features: torch.Tensor):
    """Draft forward over one sequence's rows p = 0..e-1 (token t_{p+1} of seq [>e], target feature h_p [e, F]),
    causal, KV into slots 1..e (a draft with a first-token sink: t_0's key in slot 0). Returns (its DraftHidden [e],
    and for a draft with a layer per step the other layers' outputs [e, D-1, H], else None)."""
    e = features.shape[0]
    tokens, sink = seq[1:e + 1], torch.zeros(1, int(draft.first_token_sink), dtype=torch.long)  # [1, 0 or 1]
    if draft.first_token_sink:  # t_0's key in slot 0, seen by every row
        none, one = torch.zeros(1, 0, dtype=torch.long), torch.ones(1, 1, 1, dtype=torch.bool)
        draft.sink(seq[:1], AttentionContext(_BACKEND, block_plan(none, none.bool(), sink, one), pool))
    causal = torch.ones(1, e, e, dtype=torch.bool).tril()
    plan = block_plan(sink, torch.ones_like(sink, dtype=torch.bool), torch.arange(1, e + 1)[None], causal)
    attn = AttentionContext(_BACKEND, plan, pool)
    if draft.per_step_layers > 1:  # every layer's KV, each reading the layer before one position back
        prev = features.new_zeros(1, draft.per_step_layers - 1, draft.config.hidden_size)
        return draft.extend(tokens, torch.arange(e), features, prev, attn, e)
    return draft(tokens, torch.arange(e), features, attn), None


def round_candidates(draft, hot_token_id, pool, rows, n, topk: int, steps: int, L: int):
    """draft_candidates for round starts n [B] over draft_prefill's pool and rows: the root row is n - 1, the prefix
    slots 1..n (a first-token sink: slot 0), scratch slots from L on (the pool holds L + B * topk * steps)."""
    B = n.numel()
    topk_p, topk_index = draft_top_k(draft, hot_token_id, rows.normed[n - 1], topk)
    table = torch.arange(1, int(n.max()) + 1, dtype=torch.int32).expand(B, -1).contiguous()  # position p: slot p + 1
    scratch = L + torch.arange(B * topk * steps).view(B * topk, steps)
    x = {"topk_p": topk_p, "topk_index": topk_index, "hidden": rows.carry[n - 1], "rows": torch.arange(B),
         "seq_lens": n, "scratch": scratch} | ({"sink": torch.zeros_like(n)} if draft.first_token_sink else {})
    return draft_candidates(draft, hot_token_id, pool, table, topk, steps, x)


def _accept_lens(lists, n: torch.Tensor, seq: torch.Tensor, p: SpecParams) -> torch.Tensor:
    """accept_len [B] of configuration p's tree at every round start n against the known continuation."""
    scores, tokens, parents = (lst[:p.num_steps] for lst in lists)
    parent_list, top_index, draft_tokens = organize_draft_results(scores, tokens, parents, p.num_draft_tokens)
    tree = build_tree(seq[n], parent_list, top_index, draft_tokens, n, p.topk, p.num_steps, p.num_draft_tokens)
    after = tree.positions.view(n.numel(), -1) + 1  # the target's token after node i sits at position + 1
    predict = torch.where(after < seq.numel(), seq[after.clamp(max=seq.numel() - 1)], -1)
    return verify_predicted(tree, predict).accept_len


def replay_tau(recorded: list[Recorded], p: SpecParams) -> tuple[int, int]:
    """(verify rounds, tokens they emit) of configuration p over the recorded sequences, walking the rounds
    exactly as the engine does: round at n accepts a drafts and emits min(a + 1, tokens still to come)."""
    rounds = emitted = 0
    for r in recorded:
        left, i = r.output_len - 1, 0  # the first token came from prefill
        while left > 0:
            take = min(r.accept[p][i] + 1, left)
            rounds, emitted, left, i = rounds + 1, emitted + take, left - take, i + take
    return rounds, emitted
