"""The draft tree as values: top-k expansion during drafting, the `DraftTree` handed to verify and the
`VerifyResult` handed to commit.

Glossary (one round, per request):
  root           -- node 0: the last emitted token, not yet in the target KV (position seq_len).
  draft token    -- a non-root node; depth d sits at position seq_len + d.
  accepted token -- a draft token the target keeps: it is the target's token after its parent (greedy: its
                    argmax; sampling: its draw with the position's uniform). accept_len counts them.
  bonus token    -- the one token the target emits after the last accepted node; always emitted, so a
                    round emits accept_len + 1 tokens: emitted = accepted drafts, then the bonus.
Owns: shapes and meaning of these values, and turning target logits into a VerifyResult. Does not own:
running models, attention metadata, or committing tokens / KV slots (commit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.errors import FastspecError
from fastspec.kernels import (
    TreeMaskMode,
    ancestor_mask,
    build_tree_kernel_efficient,
    cpu_fused,
    cpu_tree,
    fast_topk,
    full_tree_mask,
    reconstruct_indices_from_tree_mask,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)
from fastspec.kernels import tree_build as tree_twins
from fastspec.kernels import verify as verify_twins
from fastspec.sampling.draw import sample_from_probs, target_probs
from fastspec.utils.transfer import to_device


@dataclass(frozen=True)
class SelectResult:
    """One draft step's choice. Candidate ids ("global"): step 0 uses [0, topk), step i >= 1 uses
    topk + topk^2 (i-1) + r topk + c for child c of kept leaf r."""

    input_ids: torch.Tensor     # int64 [bs*topk]  tokens of the kept leaves, row b*topk + k (next draft input)
    hidden: torch.Tensor        # [bs*topk, Hd]  the draft hidden state of each kept leaf's parent row
    scores: torch.Tensor        # float32 [bs, topk]  path probability of the kept leaves
    score_entry: torch.Tensor   # float32 [bs, 1, topk] (step 0) or [bs, topk, topk]: all candidates' scores
    token_entry: torch.Tensor   # int64 [bs, topk] (step 0) or [bs, topk*topk]: all candidates' tokens
    parent_entry: torch.Tensor  # int64 [bs, topk+1] = [-1, 0..topk-1] (step 0) or [bs, topk]: kept leaf ids
    parent_rows: torch.Tensor | None  # int64 [bs*topk]  previous-step row each new row descends from (None at 0)


def select_top_k(step: int, topk_p: torch.Tensor,  # float32 [bs, topk] (step 0) / [bs*topk, topk]
                 topk_index: torch.Tensor,          # int64, same shape as topk_p (target-vocab ids)
                 hidden: torch.Tensor,              # [bs, Hd] (step 0) / [bs*topk, Hd]
                 scores: torch.Tensor | None,       # float32 [bs, topk] from the previous step (None at 0)
                 topk: int) -> SelectResult:
    """Keep the topk most probable paths. Scores are products of probabilities (not log-probs)."""
    if step == 0:
        bs = topk_p.shape[0]
        parents = torch.arange(-1, topk, device=topk_p.device).expand(bs, topk + 1)
        return SelectResult(topk_index.flatten(), hidden.repeat_interleave(topk, 0), topk_p,
                            topk_p[:, None, :], topk_index, parents, None)
    bs = topk_p.shape[0] // topk
    expand = scores[:, :, None] * topk_p.view(bs, topk, topk)  # [bs, leaf r, child c]: path probability
    kept_p, kept = fast_topk(expand.view(bs, topk * topk), topk, -1)
    flat_tokens = topk_index.view(bs, topk * topk)
    parent_rows = (kept // topk + topk * torch.arange(bs, device=kept.device)[:, None]).flatten()  # topk 2: c=3 -> r=1
    return SelectResult(flat_tokens.gather(1, kept).flatten(), hidden[parent_rows], kept_p,
                        expand, flat_tokens, kept + topk * topk * (step - 1) + topk, parent_rows)


def organize_draft_results(score_list: list[torch.Tensor], token_list: list[torch.Tensor],
                           parents_list: list[torch.Tensor], num_draft_tokens: int,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parent_list [bs, topk*(S-1)+1], top_scores_index [bs, N-1] ascending, draft_tokens [bs, N-1]):
    the N-1 best candidates over all steps, in ascending candidate id (depth-major, parent before child)."""
    scores = torch.cat(score_list, 1).flatten(1)  # [bs, topk + (S-1) topk^2], indexed by candidate id
    tokens = torch.cat(token_list, 1)
    if num_draft_tokens - 1 > scores.shape[1]:
        raise FastspecError(f"num_draft_tokens={num_draft_tokens} exceeds the {scores.shape[1] + 1} tree nodes "
                            f"that num_steps and topk can draft")
    top_scores_index = torch.topk(scores, num_draft_tokens - 1, dim=-1).indices.sort(-1).values
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], 1)
    else:  # one step: every node's parent is the root, the list is never read
        parent_list = torch.empty(scores.shape[0], 0, dtype=torch.int64, device=scores.device)
    return parent_list, top_scores_index, tokens.gather(1, top_scores_index)


@dataclass(frozen=True)
class DraftTree:
    """What drafting hands to verify. Node order: parent position < child position; siblings are visited
    in ascending position (for EAGLE trees: descending draft probability)."""

    draft_tokens: torch.Tensor           # int64 [bs, N]  column 0 = root
    positions: torch.Tensor              # int64 [bs*N]  seq_len + depth
    tree_mask: torch.Tensor              # bool [bs, N, N]  row i sees the root, i's ancestors and i
    retrieve_index: torch.Tensor         # int64 [bs, N]  flat verify row b*N + i of node i
    retrieve_next_token: torch.Tensor    # int64 [bs, N]  first child position, -1 for leaves
    retrieve_next_sibling: torch.Tensor  # int64 [bs, N]  next sibling position, -1 for the last one
    num_steps: int                       # max draft depth (accept_index has num_steps + 1 columns)
    topk: int                            # branching of the top-k expansion (0: arbitrary tree)

    @property
    def num_draft_tokens(self) -> int:
        return self.draft_tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.draft_tokens.shape[0]

    def full_mask(self, seq_lens: torch.Tensor, seq_lens_sum: int) -> torch.Tensor:
        """The FULL_MASK layout flashinfer's verify plan takes: bool [seq_lens_sum*N + bs*N*N]."""
        return full_tree_mask(self.tree_mask, seq_lens.to(torch.int64), seq_lens_sum)


def _retrieve_buffers(bs: int, n: int, device) -> torch.Tensor:  # int64 [3, bs, N] filled with -1
    return torch.full((3, bs, n), -1, dtype=torch.int64, device=device)


def build_tree(verified_id: torch.Tensor,       # int64 [bs]  root tokens
               parent_list: torch.Tensor,       # int64 [bs, topk*(S-1)+1]
               top_scores_index: torch.Tensor,  # int64 [bs, N-1]
               draft_tokens: torch.Tensor,      # int64 [bs, N-1]
               seq_lens: torch.Tensor,          # int64 [bs]  committed lengths
               topk: int, num_steps: int, num_draft_tokens: int, in_graph: bool = False) -> DraftTree:
    """Build the verify inputs of an EAGLE tree (no host sync): eagerly on CPU one C call (cpu_tree), else, with
    `in_graph` (inside a round function), always the torch twin (the compiler fuses it into the captured graph;
    sgl_kernel's op is for eager rounds)."""
    bs, n, device = verified_id.shape[0], num_draft_tokens, verified_id.device
    tokens = torch.cat([verified_id.to(torch.int64)[:, None], draft_tokens.to(torch.int64)], 1)
    built = cpu_tree.eagle_tree(parent_list, top_scores_index, seq_lens, topk, n)  # eager CPU: one C call
    if built is not None:
        tree_mask, positions, retrieve_index, next_token, next_sibling = built
        return DraftTree(tokens, positions, tree_mask, retrieve_index, next_token, next_sibling, num_steps, topk)
    tree_mask = torch.zeros(bs * n * n, dtype=torch.bool, device=device)
    positions = torch.empty(bs * n, dtype=torch.int64, device=device)
    retrieve = _retrieve_buffers(bs, n, device)
    build = tree_twins.build_tree_kernel_efficient if in_graph else build_tree_kernel_efficient
    build(parent_list, top_scores_index, seq_lens.to(torch.int64), tree_mask, positions,
          retrieve[0], retrieve[1], retrieve[2], topk, num_steps, n, TreeMaskMode.QLEN_ONLY)
    return DraftTree(tokens, positions, tree_mask.view(bs, n, n), retrieve[0], retrieve[1], retrieve[2],
                     num_steps, topk)


def chain_tree(verified_id: torch.Tensor,   # int64 [bs]
               draft_tokens: torch.Tensor,  # int64 [bs, S]  one proposed continuation per request
               seq_lens: torch.Tensor,      # int64 [bs]
               ) -> DraftTree:
    """topk = 1: node d is the d-th draft token, parent_list = [-1, 0, ..., S-2], candidate ids 0..S-1."""
    bs, steps = draft_tokens.shape
    device = draft_tokens.device
    parent_list = torch.arange(-1, steps - 1, device=device).expand(bs, steps)
    selected = torch.arange(steps, device=device).expand(bs, steps)
    return build_tree(verified_id, parent_list, selected, draft_tokens, seq_lens, 1, steps, steps + 1)


def tree_from_parents(verified_id: torch.Tensor,  # int64 [bs]
                      tokens: torch.Tensor,       # int64 [bs, N-1]  nodes 1..N-1
                      parents: torch.Tensor,      # int64 [bs, N-1]  parent POSITION of node 1..N-1, 0 = root
                      seq_lens: torch.Tensor,     # int64 [bs]
                      num_steps: int, topk: int = 0) -> DraftTree:
    """An arbitrary tree (NGRAM, test drafters) on verified_id's device. Requires parent position < own position
    (checked where `parents` lives: free for host tensors such as NGRAM's, a device sync otherwise). Nodes
    deeper than num_steps are never accepted."""
    bs, n = tokens.shape[0], tokens.shape[1] + 1
    own = torch.arange(1, n, device=parents.device)
    if bool(((parents < 0) | (parents >= own)).any()):
        raise ValueError("tree_from_parents: every parent position must lie in [0, own position)")
    tokens, parents = to_device(tokens, verified_id.device), to_device(parents, verified_id.device)
    parent_pos = torch.cat([parents.new_full((bs, 1), -1), parents.to(torch.int64)], 1)
    qlen_mask = ancestor_mask(parent_pos)  # [bs, N, N]
    positions = torch.empty(bs * n, dtype=torch.int64, device=tokens.device)
    retrieve = _retrieve_buffers(bs, n, tokens.device)
    seq_lens = seq_lens.to(torch.int64)
    reconstruct_indices_from_tree_mask(qlen_mask.reshape(-1), seq_lens, positions, retrieve[0], retrieve[1],
                                       retrieve[2], bs, n)
    draft_tokens = torch.cat([verified_id.to(torch.int64)[:, None], tokens.to(torch.int64)], 1)
    return DraftTree(draft_tokens, positions, qlen_mask, retrieve[0], retrieve[1], retrieve[2], num_steps, topk)


@dataclass(frozen=True)
class VerifyResult:
    """What accept hands to commit."""

    accept_index: torch.Tensor  # int64 [bs, num_steps+1]  flat verify rows of accepted nodes, root first, -1 pad
    accept_len: torch.Tensor    # int64 [bs]  accepted DRAFT tokens (bonus not counted)
    emitted: torch.Tensor       # int64 [bs, num_steps+1]  accepted drafts then the bonus, -1 pad

    @property
    def bonus_token(self) -> torch.Tensor:  # int64 [bs]
        return self.emitted.gather(1, self.accept_len[:, None]).squeeze(1)


def select_rows(take: torch.Tensor,  # bool [bs]
                chosen: VerifyResult, other: VerifyResult) -> VerifyResult:
    """Request b's row of `chosen` where take[b], else of `other` (both of one tree: [bs, num_steps+1] each);
    no host sync."""
    rows = take[:, None]
    return VerifyResult(torch.where(rows, chosen.accept_index, other.accept_index),
                        torch.where(take, chosen.accept_len, other.accept_len),
                        torch.where(rows, chosen.emitted, other.emitted))


def _verify_buffers(tree: DraftTree):
    bs, n, device = tree.batch_size, tree.num_draft_tokens, tree.draft_tokens.device
    predicts = torch.zeros(bs * n, dtype=torch.int32, device=device)  # predicts[x] = token emitted after x
    accept_index = torch.full((bs, tree.num_steps + 1), -1, dtype=torch.int32, device=device)
    return predicts, accept_index, torch.zeros(bs, dtype=torch.int32, device=device)


def _result(predicts, accept_index, accept_num) -> VerifyResult:
    accept_index = accept_index.to(torch.int64)
    emitted = torch.where(accept_index >= 0, predicts.to(torch.int64)[accept_index.clamp(min=0)], -1)
    return VerifyResult(accept_index, accept_num.to(torch.int64), emitted)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor,  # logits [bs*N, V]
                  in_graph: bool = False) -> VerifyResult:
    """Accept the longest path whose tokens equal the target's argmax; bonus = argmax after it. `in_graph`:
    inside a round function, the torch twin (fused into the captured graph)."""
    predict = cpu_fused.argmax(target_logits)  # (torch's inside a compiled graph)
    return verify_predicted(tree, predict.view(tree.batch_size, tree.num_draft_tokens), in_graph)


def verify_predicted(tree: DraftTree, target_predict: torch.Tensor,  # int64 [bs, N]
                     in_graph: bool = False) -> VerifyResult:
    """verify_greedy given the target's next token after every node (`fastspec tune` replays known ones): eagerly
    on CPU one C call (cpu_tree), else as verify_greedy's `in_graph` says."""
    walked = cpu_tree.greedy_walk(tree.draft_tokens, tree.retrieve_index, tree.retrieve_next_token,
                                  tree.retrieve_next_sibling, target_predict, tree.num_steps)  # eager CPU: one C call
    if walked is not None:
        return VerifyResult(*walked)
    predicts, accept_index, accept_num = _verify_buffers(tree)
    verify = verify_twins.verify_tree_greedy if in_graph else verify_tree_greedy
    verify(predicts, accept_index, accept_num, tree.draft_tokens, tree.retrieve_index, tree.retrieve_next_token,
           tree.retrieve_next_sibling, target_predict)
    return _result(predicts, accept_index, accept_num)


def verify_sampling(tree: DraftTree, target_logits: torch.Tensor,  # [bs*N, V]
                    temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,  # [bs] each
                    uniforms: torch.Tensor,  # float32 [bs, N] in [0, 1): node i's (its position's + 1)
                    ) -> VerifyResult:
    """Every node's next token drawn from the processed target distribution by inverse CDF at the node's uniform,
    then the greedy walk over those draws: the longest path whose tokens are the draws after their parents,
    bonus = the draw after its last node. Lossless: the token emitted at depth d is the target's draw after the
    path's node at depth d - 1 with a uniform independent of how that node was reached. It accepts a node's
    children with probability sum_c p(c), as target-only rejection sampling does; and where every node at one
    depth shares its position's uniform (position_uniforms), it emits exactly what plain sampling with those
    uniforms emits, token for token."""
    bs, n = tree.batch_size, tree.num_draft_tokens
    probs = target_probs(target_logits, temperature, top_k, top_p, n)
    return verify_predicted(tree, sample_from_probs(probs, uniforms.flatten()).view(bs, n))


def verify_sampling_thresholds(tree: DraftTree, target_logits: torch.Tensor,  # [bs*N, V]
                               temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,  # [bs] each
                               uniforms: torch.Tensor,  # float32 [bs, N+1]: N acceptance coins, then the bonus draw
                               threshold_single: float, threshold_acc: float) -> VerifyResult:
    """SGLang's target-only tree rejection sampling with its acceptance thresholds (below 1: more accepted, no
    longer the target's distribution), for `--speculative-accept-threshold-*`."""
    bs, n = tree.batch_size, tree.num_draft_tokens
    probs = target_probs(target_logits, temperature, top_k, top_p, n).view(bs, n, -1)
    # coins in (0, 1]: `u <= q` then accepts with probability exactly q, and never accepts q = 0
    coins = 1.0 - uniforms[:, :n]
    predicts, accept_index, accept_num = _verify_buffers(tree)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, tree.draft_tokens, tree.retrieve_index, tree.retrieve_next_token,
        tree.retrieve_next_sibling, coins.contiguous(), uniforms[:, n].contiguous(), probs,
        torch.zeros_like(probs), threshold_single, threshold_acc)
    return _result(predicts, accept_index, accept_num)
