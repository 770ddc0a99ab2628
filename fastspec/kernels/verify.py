"""Tree verification ops: pure-torch twins of sgl_kernel's `verify_tree_greedy` and
`tree_speculative_sampling_target_only`.

Glossary (one verify round, per request):
  draft token    -- a non-root node of the tree, proposed by the drafter.
  accepted token -- a draft token the target keeps: greedy, it equals the target's argmax after its parent;
                    sampling, it passes the rejection test below. `accept_token_num` counts them (accept_len).
  bonus token    -- the token the target emits after the last accepted node: its argmax (greedy) or a draw
                    from its probabilities with the rejected children's mass removed (vLLM's "recovered"
                    token when a child was rejected). Always emitted: a round emits accept_len + 1 tokens.
  predicts[x]    -- the token emitted AFTER node x (flat verify row x = retrive_index[b, node]).
Owns: walking the tree and writing predicts / accept_index / accept_token_num in place (sgl_kernel
signatures, `retrive_` spelling at this boundary). Does not own: temperature / top-k / top-p (applied to
target_probs before) or committing tokens and KV. Vectorised over requests; the only loop is over depth.
"""

from __future__ import annotations

import torch

from fastspec.kernels.tree_build import _jump_rounds


def tree_links(retrieve_next_token: torch.Tensor,    # int64 [bs, N]  first child, -1 = leaf
               retrieve_next_sibling: torch.Tensor,  # int64 [bs, N]  next sibling, -1 = last
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent [bs, N], rank [bs, N]): each node's parent position (-1: root or unreachable) and its index in
    its parent's sibling list (0 = first child), by pointer jumping over the reversed sibling links."""
    bs, n = retrieve_next_token.shape
    nodes = torch.arange(n, device=retrieve_next_token.device).expand(bs, n)
    prev = torch.full((bs, n + 1), -1, dtype=torch.int64, device=nodes.device)  # column n absorbs the -1 links
    prev.scatter_(1, retrieve_next_sibling.where(retrieve_next_sibling >= 0, n).to(torch.int64), nodes)
    first_child_of = torch.full_like(prev, -1)
    first_child_of.scatter_(1, retrieve_next_token.where(retrieve_next_token >= 0, n).to(torch.int64), nodes)
    prev, first_child_of = prev[:, :n], first_child_of[:, :n]
    jump = torch.where(prev >= 0, prev, nodes)  # list heads point to themselves
    rank = (prev >= 0).to(torch.int64)
    for _ in range(_jump_rounds(n)):
        rank = rank + rank.gather(1, jump)
        jump = jump.gather(1, jump)
    return first_child_of.gather(1, jump), rank


class _Walk:
    """State of the batched walk down the tree (tensors [bs]); accepted nodes are written to the outputs."""

    def __init__(self, predicts, accept_index, retrieve_index):
        self.predicts, self.accept_index, self.retrieve_index = predicts, accept_index, retrieve_index
        bs = retrieve_index.shape[0]
        self.cur = torch.zeros(bs, dtype=torch.int64, device=retrieve_index.device)  # node position
        self.last = retrieve_index[:, 0].to(torch.int64)                               # its flat verify row
        self.alive = torch.ones(bs, dtype=torch.bool, device=retrieve_index.device)
        self.num_accepted = torch.zeros_like(self.cur)
        accept_index[:, 0] = self.last.to(accept_index.dtype)

    def advance(self, step: int, found: torch.Tensor, child: torch.Tensor, token: torch.Tensor) -> None:
        """Requests with `found` accept `child` (carrying `token`); the others stop for good."""
        found = found & self.alive
        child_row = self.retrieve_index.gather(1, child[:, None]).squeeze(1).to(torch.int64)
        self.predicts[self.last] = torch.where(found, token.to(self.predicts.dtype), self.predicts[self.last])
        col = self.accept_index[:, step]
        self.accept_index[:, step] = torch.where(found, child_row.to(col.dtype), col)
        self.num_accepted += found.to(torch.int64)
        self.last = torch.where(found, child_row, self.last)
        self.cur = torch.where(found, child, self.cur)
        self.alive = found


def verify_tree_greedy(predicts: torch.Tensor,          # out int32 [bs*N]
                       accept_index: torch.Tensor,      # out int32 [bs, S+1]  pre-filled -1; width sets S
                       accept_token_num: torch.Tensor,  # out int32 [bs]
                       candidates: torch.Tensor,        # int64 [bs, N]  node tokens, column 0 = root
                       retrive_index: torch.Tensor,     # int64 [bs, N]  (sgl_kernel spelling)
                       retrive_next_token: torch.Tensor,    # int64 [bs, N]
                       retrive_next_sibling: torch.Tensor,  # int64 [bs, N]
                       target_predict: torch.Tensor,    # int64 [bs, N]  read flat by verify row
                       ) -> None:
    """Accept the first child (in sibling order) whose token equals the target's argmax after the current
    node, up to S levels; the bonus is the target's argmax after the last accepted node."""
    num_steps = accept_index.shape[1] - 1
    parent, rank = tree_links(retrive_next_token, retrive_next_sibling)
    target_flat = target_predict.reshape(-1)
    walk = _Walk(predicts, accept_index, retrive_index)
    for step in range(1, num_steps + 1):
        want = target_flat[walk.last]  # [bs] the target's token after the current node
        match = (parent == walk.cur[:, None]) & (candidates == want[:, None])
        child = torch.where(match, rank, rank.shape[1]).argmin(-1)  # first match in sibling order
        walk.advance(step, match.any(-1), child, want)
    accept_token_num.copy_(walk.num_accepted)
    predicts[walk.last] = target_flat[walk.last].to(predicts.dtype)  # bonus token


def _children_in_sibling_order(parent, rank, cur, alive):
    """order [bs, N]: node positions with cur's children first, in sibling order; is_child [bs, N] along it."""
    children = (parent == cur[:, None]) & alive[:, None]
    order = torch.where(children, rank, rank.shape[1]).argsort(dim=-1, stable=True)
    return order, children.gather(1, order)


def _record_rejected(draft_probs, cur, candidates, rejected, q) -> None:
    """draft_probs[b, cur, token] = target q of each rejected child: removed from the bonus distribution."""
    bs, vocab = draft_probs.shape[0], draft_probs.shape[-1]
    rows = torch.arange(bs, device=cur.device)
    padded = torch.cat([draft_probs[rows, cur], draft_probs.new_zeros(bs, 1)], 1)  # column V: sink for no-ops
    padded.scatter_(1, torch.where(rejected, candidates, vocab), torch.where(rejected, q, 0.0))
    draft_probs[rows, cur] = padded[:, :vocab]


def sample_from_weights(weights: torch.Tensor,  # float [bs, V]  non-negative, unnormalised
                        uniform: torch.Tensor,  # float [bs]  in [0, 1)
                        ) -> torch.Tensor:      # int64 [bs]
    """Inverse CDF: first i with cumsum(w)[i] > u * sum(w). If rounding leaves no such i, the last token with
    positive weight (V-1 for an all-zero row, like sgl_kernel's default)."""
    cdf = weights.cumsum(-1)
    idx = (cdf <= (uniform * cdf[:, -1])[:, None]).sum(-1)
    vocab = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, vocab, -1).amax(-1)
    fallback = torch.where(last_positive >= 0, last_positive, weights.shape[-1] - 1)
    return torch.where(idx < weights.shape[-1], idx, fallback)


def _try_children(walk, parent, rank, candidates, coin, target_probs, draft_probs, threshold_single,
                  threshold_acc):
    """One level of rejection sampling below walk.cur: (found [bs], child [bs]); records rejected children."""
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    q = target_probs[rows, walk.cur].gather(1, candidates)  # [bs, N] target prob of each node's token
    order, is_child = _children_in_sibling_order(parent, rank, walk.cur, walk.alive)
    q_sorted = q.gather(1, order) * is_child
    prob_acc = q_sorted.cumsum(-1)  # running sum over the siblings tried so far
    # accept child k iff u <= (q_1 + ... + q_k) / threshold_acc, or q_k >= threshold_single:
    # with thresholds 1 the k-th child is accepted with probability exactly q_k
    accept = is_child & ((coin[:, None] <= prob_acc / threshold_acc) | (q_sorted >= threshold_single))
    found, first = accept.any(-1), accept.to(torch.int8).argmax(-1)
    n = candidates.shape[1]
    tried = is_child & (torch.arange(n, device=order.device) < torch.where(found, first, n)[:, None])
    _record_rejected(draft_probs, walk.cur, candidates, torch.zeros_like(tried).scatter(1, order, tried), q)
    return found, order.gather(1, first[:, None]).squeeze(1)


def tree_speculative_sampling_target_only(
        predicts: torch.Tensor,          # out int32 [bs*N]
        accept_index: torch.Tensor,      # out int32 [bs, S+1]  pre-filled -1
        accept_token_num: torch.Tensor,  # out int32 [bs]
        candidates: torch.Tensor,        # int64 [bs, N]
        retrive_index: torch.Tensor,     # int64 [bs, N]  (sgl_kernel spelling)
        retrive_next_token: torch.Tensor,    # int64 [bs, N]
        retrive_next_sibling: torch.Tensor,  # int64 [bs, N]
        uniform_samples: torch.Tensor,   # float32 [bs, N]  one coin per parent node
        uniform_samples_for_final_sampling: torch.Tensor,  # float32 [bs]
        target_probs: torch.Tensor,      # float32 [bs, N, V]  row of node x = distribution after x
        draft_probs: torch.Tensor,       # float32 [bs, N, V]  in/out: rejected children's q are written here
        threshold_single: float = 1.0, threshold_acc: float = 1.0, deterministic: bool = True) -> None:
    """Target-only tree rejection sampling (the draft is treated as proposing each child deterministically).
    Lossless with thresholds 1: emitted tokens follow target_probs exactly. `deterministic` is accepted for
    signature compatibility (this twin is always deterministic given the uniforms)."""
    if not (0.0 <= threshold_single <= 1.0 and 0.0 <= threshold_acc <= 1.0):
        raise ValueError(f"thresholds must be in [0, 1], got {threshold_single}, {threshold_acc}")
    threshold_acc = max(threshold_acc, 1e-9)
    num_steps = accept_index.shape[1] - 1
    parent, rank = tree_links(retrive_next_token, retrive_next_sibling)
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    walk = _Walk(predicts, accept_index, retrive_index)
    for step in range(1, num_steps + 1):
        coin = uniform_samples[rows, walk.cur]  # [bs] one uniform per parent node
        found, child = _try_children(walk, parent, rank, candidates, coin, target_probs, draft_probs,
                                     threshold_single, threshold_acc)
        walk.advance(step, found, child, candidates.gather(1, child[:, None]).squeeze(1))
    accept_token_num.copy_(walk.num_accepted)
    # bonus ~ relu(q - q of rejected children) after the last accepted node; at full depth none was tried
    full_depth = (walk.num_accepted == num_steps)[:, None]
    residual = target_probs[rows, walk.cur] - torch.where(full_depth, 0.0, draft_probs[rows, walk.cur])
    bonus = sample_from_weights(residual.clamp(min=0.0), uniform_samples_for_final_sampling)
    predicts[walk.last] = bonus.to(predicts.dtype)
