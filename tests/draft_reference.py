"""The draft's state pinned against a reference that takes none of the engine's paths.

Before every round an EAGLE-style drafter drafts from (a) its KV at the committed positions 0..n-1, built by
prefill chunks, backlog catch-ups, decode-round extends, the prefix cache and re-prefills after preemption, and
(b) the state its last extend left (top-k, hidden, normed, per-layer outputs). The reference builds both from
the committed tokens alone: one packed causal target forward (no pool, no table), one draft prefill over the
whole sequence into a fresh pool and the draft loop over it (the tuner's replay code). The tree is also checked
against an oracle that shares no code with the draft loop (`oracle_paths`: each path drafted on its own, one
forward per node over its true ancestors, the best paths kept by the EAGLE rule). `DraftChecker` hooks an
engine's drafters and, at every draft, compares the KV of every layer, the state and the proposed tree, and
walks the tree against the known greedy continuation, so acceptance is pinned exactly too.

Tolerance: float32, the engine's batched, paged and padded forwards against one packed forward differ by
rounding (~1e-6 here); TOL is two orders above that and far below what a wrong row, position or feature
changes (O(0.1)). A tree is compared token for token unless the reference sees a near-tie (two candidate
probabilities or scores within a relative TIE of each other) that rounding could order either way; such trees
are counted, and a test asserts they are rare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.attention import AttentionContext, TorchAttnBackend
from fastspec.attention.torch_backend import block_plan
from fastspec.memory import KVPool
from fastspec.speculative.steps import draft_top_k
from fastspec.speculative.tree import DraftTree, build_tree, organize_draft_results, verify_predicted
from fastspec.train.data import PackedCausalAttention
from fastspec.tune.replay import draft_prefill, round_candidates

TOL = dict(atol=1e-4, rtol=1e-4)
TIE = 1e-4


@dataclass(frozen=True)
class Reference:
    kv: list[torch.Tensor]  # per pool tensor (k, then v if any): [layers, n, heads, dim] for positions 0..n-1
    topk_p: torch.Tensor  # [topk]
    topk_index: torch.Tensor  # [topk]
    hidden: torch.Tensor  # [Hd]
    normed: torch.Tensor  # [Hd]
    layers: torch.Tensor | None  # [D-1, Hd]  a draft with a layer per step
    tree: DraftTree  # bs 1
    paths: frozenset  # the oracle's tree: each node as the tuple of draft tokens from the root to it
    margin: float  # the smallest gap between candidates the tree's choice depends on


class _Recording(torch.nn.Module):
    """The draft as the reference's draft loop sees it, keeping every probability row it scores."""

    def __init__(self, draft):
        super().__init__()
        self.draft, self.probs = draft, []
        self.per_step_layers, self.config = draft.per_step_layers, draft.config
        self.first_token_sink = draft.first_token_sink

    def forward(self, *args, **kwargs):
        return self.draft(*args, **kwargs)

    def compute_logits(self, normed):
        logits = self.draft.compute_logits(normed)
        self.probs.append(torch.softmax(logits.float(), -1))
        return logits


@torch.inference_mode()
def reference(engine, drafter, tokens: list[int]) -> Reference:
    """The draft's KV, state and next tree after the committed tokens t_0..t_{n-1}, with root t_n = tokens[n]."""
    target, draft = engine.model, drafter.model
    seq, n = torch.tensor(tokens), len(tokens) - 1
    hidden = target(seq[:n], torch.arange(n), PackedCausalAttention(torch.zeros(n, dtype=torch.long),
                                                                    target.config.hybrid))
    features = hidden.aux if engine.feature == "aux" else hidden.final
    layers, heads, dim, separate_v = draft.config.kv_layout
    topk, steps = drafter.topk, drafter.num_steps
    pool = KVPool(layers, heads, dim, n + 1 + 2 * topk * max(steps, 1), 1, features.dtype, separate_v=separate_v)
    rows, layer_rows = draft_prefill(draft, pool, seq, features)  # position p in slot p + 1 (t_0's key: slot 0)
    recording = _Recording(draft)
    topk_p, topk_index = draft_top_k(draft, drafter.hot_token_id, rows.normed[n - 1:n], drafter.extend_topk)
    scores, token_list, parents = round_candidates(recording, drafter.hot_token_id, pool, rows, torch.tensor([n]),
                                                   topk, steps, n + 1)
    parent_list, top_index, draft_tokens = organize_draft_results(scores, token_list, parents,
                                                                  drafter.num_draft_tokens)
    tree = build_tree(seq[n:], parent_list, top_index, draft_tokens, torch.tensor([n]), topk, steps,
                      drafter.num_draft_tokens)
    kv = [t[:, 1:n + 1].clone() for t in (pool.k, pool.v) if t is not None]
    paths, oracle_margin = oracle_paths(draft, drafter, pool, n, topk_p[0, :topk], topk_index[0, :topk],
                                        rows.carry[n - 1])
    margin = _margin(recording.probs, torch.cat(scores, 1).flatten(), topk, drafter.num_draft_tokens)
    return Reference(kv, topk_p[0], topk_index[0], rows.carry[n - 1], rows.normed[n - 1],
                     None if layer_rows is None else layer_rows[n - 1], tree, paths, min(margin, oracle_margin))


def oracle_paths(draft, drafter, pool, n: int, root_p, root_tokens, root_carry) -> tuple[frozenset, float]:
    """The EAGLE tree from first principles: the root's top-k are the first candidates and beams; each step every
    beam (a path of draft tokens) is drafted on its own, at position n + depth - 1, from its last token and its
    parent's carry, seeing the committed KV (slots 1..n; a first-token sink: slot 0 too) and the KV its own ancestors
    wrote (a draft with a layer per step: the committed KV of its step's layer only); its top-k children score beam
    score x probability, the best k of all children are the next beams; the tree is the best N-1 candidates of every
    step. Returns the tree as a set of paths, and the smallest relative gap those choices depend on."""
    topk, layered = drafter.topk, draft.per_step_layers > 1
    beams = [(float(p), (int(t),)) for p, t in zip(root_p, root_tokens)]
    candidates, gaps = list(beams), []
    carry, slot = {(): root_carry}, {(): None}
    free = iter(range(n + 1 + topk * drafter.num_steps, pool.num_slots))
    for step in range(1, drafter.num_steps):
        children = []
        for score, path in beams:
            slot[path] = next(free)
            ancestors = [] if layered else [slot[path[:i]] for i in range(1, len(path))]
            prefix = torch.tensor([list(range(1 - draft.first_token_sink, n + 1)) + ancestors])
            plan = block_plan(prefix, torch.ones_like(prefix, dtype=torch.bool), torch.tensor([[slot[path]]]),
                              torch.ones(1, 1, 1, dtype=torch.bool))
            args = (torch.tensor(path[-1:]), torch.tensor([n + len(path) - 1]), carry[path[:-1]][None],
                    AttentionContext(TorchAttnBackend(), plan, pool))
            out = draft(*args, step=step) if layered else draft(*args)
            carry[path] = out.carry[0]
            probs = torch.softmax(draft.compute_logits(out.normed).float(), -1)[0]
            gaps.append(_relative_gaps(probs.sort(descending=True).values[:topk + 1]))
            p, tokens = draft_top_k(draft, drafter.hot_token_id, out.normed, topk)
            children += [(score * float(q), path + (int(t),)) for q, t in zip(p[0], tokens[0])]
        candidates += children
        children.sort(key=lambda c: -c[0])
        gaps.append(_relative_gaps(torch.tensor([c[0] for c in children[:topk + 1]])))
        beams = children[:topk]
    candidates.sort(key=lambda c: -c[0])
    gaps.append(_relative_gaps(torch.tensor([c[0] for c in candidates[:drafter.num_draft_tokens]])))
    margin = min((float(g.min()) for g in gaps if g.numel()), default=float("inf"))
    return frozenset(path for _, path in candidates[:drafter.num_draft_tokens - 1]), margin


def tree_paths(tree: DraftTree) -> frozenset:
    """A bs-1 tree's nodes as paths of draft tokens from the root (a node's ancestors precede it)."""
    tokens, mask = tree.draft_tokens[0].tolist(), tree.tree_mask[0]
    return frozenset(tuple(tokens[j] for j in range(1, i + 1) if mask[i, j]) for i in range(1, len(tokens)))


def _margin(probs: list[torch.Tensor], scores: torch.Tensor, topk: int, num_draft_tokens: int) -> float:
    """The smallest relative gap the tree depends on (rounding errors are relative): between consecutive
    top-(topk+1) probabilities of every scored row (their order numbers the candidates) and between consecutive
    top-N scores (organize keeps the best N-1)."""
    gaps = [_relative_gaps(p.sort(-1, descending=True).values[..., :topk + 1]) for p in probs]
    gaps.append(_relative_gaps(scores.sort(descending=True).values[:num_draft_tokens]))
    return min((float(g.min()) for g in gaps if g.numel()), default=float("inf"))


def _relative_gaps(x: torch.Tensor) -> torch.Tensor:  # [..., m] sorted descending -> [..., m-1]
    return (x[..., :-1] - x[..., 1:]) / x[..., :-1].clamp_min(torch.finfo(x.dtype).tiny)


def accept_len(tree: DraftTree, b: int, sequence: list[int]) -> int:
    """Draft tokens request b's tree accepts against the known greedy continuation `sequence` (the target's
    token after node i sits at position_i + 1)."""
    one = request_tree(tree, b)
    predict = torch.tensor([sequence[p + 1] if p + 1 < len(sequence) else -1 for p in one.positions.tolist()])
    return int(verify_predicted(one, predict[None]).accept_len[0])


def request_tree(tree: DraftTree, b: int) -> DraftTree:
    """Request b's tree as a batch of one (retrieve_index holds flat verify rows b*N + i)."""
    n = tree.num_draft_tokens
    return DraftTree(tree.draft_tokens[b:b + 1], tree.positions.view(-1, n)[b], tree.tree_mask[b:b + 1],
                     tree.retrieve_index[b:b + 1] - b * n, tree.retrieve_next_token[b:b + 1],
                     tree.retrieve_next_sibling[b:b + 1], tree.num_steps, tree.topk)


class DraftChecker:
    """Installed on an engine, checks every drafter's state before each draft (see the module docstring); for
    greedy requests without a grammar (a grammar masks the draft's choices).

    sequences[rid]: request rid's prompt + greedy output, long enough to judge every draft token of its last
    round (the target-only reference decoded a few tokens past max_new_tokens). `tol`: assert_close's tolerance
    for KV and state (a deeper real model than the tiny ones rounds further apart)."""

    def __init__(self, engine, sequences: list[list[int]], tol: dict = TOL):
        self.engine, self.sequences, self.tol = engine, sequences, tol
        self.accepts: dict[int, list[tuple[int, int]]] = {}  # rid -> (round start n, accept_len) per draft
        self.checked = self.trees = self.near_ties = 0
        for drafter in engine.drafters.values():
            drafter.draft = self._hook(drafter, drafter.draft)

    def _hook(self, drafter, draft):
        def checked_draft(batch):
            seq_lens = batch.seq_lens.tolist()  # exact under overlap too (the round in flight wrote it)
            refs = [self._check_state(drafter, rid, row, n)
                    for rid, row, n in zip(batch.rids, batch.rows.tolist(), seq_lens)]
            tree = draft(batch)
            for b, (rid, n, ref) in enumerate(zip(batch.rids, seq_lens, refs)):
                self._check_tree(tree, b, ref)
                self.accepts.setdefault(rid, []).append((n, accept_len(tree, b, self.sequences[rid])))
            return tree
        return checked_draft

    def _check_state(self, drafter, rid: int, row: int, n: int) -> Reference:
        ref = reference(self.engine, drafter, self.sequences[rid][:n + 1])
        pool, table = self.engine.worker.draft_pool, self.engine.worker.table
        slots = table.slots(row, 0, n)
        where = f"request {rid}'s draft KV at positions 0..{n - 1}"
        for got, want in zip((t[:, slots] for t in (pool.k, pool.v) if t is not None), ref.kv):
            torch.testing.assert_close(got, want, **self.tol, msg=lambda m: f"{where}: {m}")
        state = drafter.states[rid]
        where = f"request {rid}'s draft state after {n} tokens"
        for name in ("topk_p", "hidden", "normed", "layers"):
            got, want = getattr(state, name), getattr(ref, name)
            assert (got is None) == (want is None), f"{where}: {name}"
            if want is not None:
                torch.testing.assert_close(got, want, **self.tol, msg=lambda m: f"{where}, {name}: {m}")
        if ref.margin > TIE:
            assert torch.equal(state.topk_index, ref.topk_index), f"{where}: top-k tokens"
        self.checked += 1
        return ref

    def _check_tree(self, tree: DraftTree, b: int, ref: Reference) -> None:
        if ref.margin <= TIE:
            self.near_ties += 1
            return
        got, want = request_tree(tree, b), ref.tree
        assert tree_paths(got) == ref.paths, f"draft tree {sorted(tree_paths(got))} != oracle {sorted(ref.paths)}"
        depths = torch.tensor([0] + [int(got.tree_mask[0, i, 1:].sum()) for i in range(1, got.num_draft_tokens)])
        assert torch.equal(got.positions - got.positions[0], depths), "a draft node's position is not its depth"
        for name in ("draft_tokens", "positions", "tree_mask", "retrieve_index", "retrieve_next_token",
                     "retrieve_next_sibling"):
            g, w = getattr(got, name), getattr(want, name)
            assert torch.equal(g, w), f"draft tree {name}: {g.tolist()} != reference {w.tolist()}"
        self.trees += 1

    def expected_metrics(self, rid: int, prompt_len: int, max_new: int) -> tuple[int, int]:
        """(verify rounds, accepted draft tokens) request rid's rounds must have had: the drafts made while it
        still had tokens to produce (under overlap a finished request may draft once more, its round dropped)."""
        rounds = [a for n, a in self.accepts.get(rid, []) if n < prompt_len + max_new - 1]
        return len(rounds), sum(rounds)
