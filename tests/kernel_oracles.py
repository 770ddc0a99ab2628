"""Hand-worked EAGLE trees and literal Python transcriptions of the sgl_kernel loops (the oracles), with random
EAGLE trees for property tests: shared by test_kernels.py (tree building, renormalisation) and
test_verify_kernels.py (greedy and sampled verification)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from fastspec.kernels import TreeMaskMode, build_tree_kernel_efficient

# ---------------------------------------------------------------------------------------------------------
# Hand-worked EAGLE trees, topk = 2, depth = 3, N = 6. Candidate ids: step 0 -> 0, 1 (children of the root);
# step 1 -> 2 + 2r + c (child c of leaf r, leaves = 0, 1); step 1 keeps leaves 2 and 4, so step 2 -> 6 + 2r + c
# (children of 2: 6, 7; children of 4: 8, 9). parent_list = [-1, 0, 1, 2, 4]: parent of g is parent_list[g // 2].
#
# Tree 1: selected [0, 1, 2, 3, 6], seq_len 3      Tree 2: selected [0, 1, 2, 4, 8], seq_len 2
#   pos 0 root                                       pos 0 root
#   pos 1 g0 (parent root)   pos 2 g1 (root)         pos 1 g0 (root)    pos 2 g1 (root)
#   pos 3 g2 (parent g0 = pos 1)                     pos 3 g2 (g0 = pos 1)
#   pos 4 g3 (3 // 2 = 1 -> g0 = pos 1)              pos 4 g4 (4 // 2 = 2 -> g1 = pos 2)
#   pos 5 g6 (6 // 2 = 3 -> g2 = pos 3)              pos 5 g8 (8 // 2 = 4 -> g4 = pos 4)
#        0                                                0
#      /   \                                            /   \
#     1     2                                          1     2
#    / \                                               |     |
#   3   4                                              3     4
#   |                                                        |
#   5                                                        5
PARENT_LIST = [[-1, 0, 1, 2, 4], [-1, 0, 1, 2, 4]]
SELECTED = [[0, 1, 2, 3, 6], [0, 1, 2, 4, 8]]
SEQ_LENS = [3, 2]
TREE_ROWS = [["100000", "110000", "101000", "110100", "110010", "110101"],   # root + ancestors + self
             ["100000", "110000", "101000", "110100", "101010", "101011"]]
POSITIONS = [3, 4, 4, 5, 5, 6, 2, 3, 3, 4, 4, 5]  # seq_len + depth
RETRIEVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
NEXT_TOKEN = [[1, 3, -1, 5, -1, -1], [1, 3, 4, -1, 5, -1]]  # smallest child position
NEXT_SIBLING = [[-1, 2, -1, 4, -1, -1], [-1, 2, -1, -1, -1, -1]]  # next larger sibling position
BITPACKED = [1, 3, 5, 11, 19, 43, 1, 3, 5, 11, 21, 53]  # bit j of row t = column j, e.g. "110101" -> 43


def bits(rows: list[str]) -> list[bool]:
    return [c == "1" for row in rows for c in row]


def build_hand_tree(mode: TreeMaskMode, tree_mask: torch.Tensor, parent_list=PARENT_LIST, selected=SELECTED,
           seq_lens=SEQ_LENS, topk=2, depth=3, n=6):
    bs = len(seq_lens)
    positions = torch.empty(bs * n, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient(torch.tensor(parent_list), torch.tensor(selected), torch.tensor(seq_lens),
                                tree_mask, positions, retrieve[0], retrieve[1], retrieve[2], topk, depth, n,
                                int(mode))
    return positions.tolist(), retrieve.tolist()

# ---------------------------------------------------------------------------------------------------------
# Literal Python transcriptions of the sgl_kernel loops: the oracles.

def oracle_build(parent_list, selected, seq_len, topk, n, b):
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n - 1, 0, -1):
        pidx = selected[i - 1] // topk
        pp = 0 if pidx == 0 else 1 + selected.index(parent_list[pidx])
        if next_token[pp] == -1:
            next_token[pp] = i
        else:
            next_sibling[i], next_token[pp] = next_token[pp], i
    mask = [[j == 0 for j in range(n)] for _ in range(n)]
    positions = [seq_len] + [0] * (n - 1)
    for t in range(1, n):
        cur, depth = t - 1, 0
        while True:
            depth += 1
            mask[t][cur + 1] = True
            pidx = selected[cur] // topk
            if pidx == 0:
                break
            cur = selected.index(parent_list[pidx])
        positions[t] = seq_len + depth
    return positions, [b * n + i for i in range(n)], next_token, next_sibling, mask


def walk(ri, nt, ns, num_steps, b, accept_child):
    """Shared skeleton of §2.4/§2.5: accept_child(last_row, child) -> bool; returns the accepted verify rows."""
    accept, cur = [ri[b][0]], 0
    for _ in range(num_steps):
        cur = nt[b][cur]
        while cur != -1:
            if accept_child(accept[-1], cur):
                accept.append(ri[b][cur])
                break
            cur = ns[b][cur]
        if cur == -1:
            break
    return accept


def oracle_greedy(candidates, ri, nt, ns, target_flat, num_steps):
    results = []
    for b in range(len(candidates)):
        predicts = {}

        def accept_child(last, cur):
            if candidates[b][cur] == target_flat[last]:
                predicts[last] = candidates[b][cur]
                return True
            return False
        path = walk(ri, nt, ns, num_steps, b, accept_child)
        predicts[path[-1]] = target_flat[path[-1]]
        results.append((path, predicts))
    return results


def oracle_sampling(candidates, ri, nt, ns, u, u_final, target, draft, num_steps, th_single, th_acc):
    """target/draft: float32 numpy [bs, N, V] (draft is updated); float32 arithmetic as on the GPU."""
    results, f32 = [], np.float32
    for b in range(len(candidates)):
        state = {"row": 0, "acc": f32(0), "coin": f32(u[b][0])}
        predicts = {}

        def accept_child(last, cur):
            tok = candidates[b][cur]
            q = target[b, state["row"], tok]
            state["acc"] = f32(state["acc"] + q)
            if state["coin"] <= f32(state["acc"] / f32(max(th_acc, 1e-9))) or q >= f32(th_single):
                state.update(acc=f32(0), row=cur, coin=f32(u[b][cur]))
                predicts[last] = tok
                return True
            draft[b, state["row"], tok] = q
            return False
        path = walk(ri, nt, ns, num_steps, b, accept_child)
        k, row = len(path) - 1, state["row"]
        r = np.maximum(target[b, row] - (draft[b, row] if k != num_steps else 0), 0).astype(f32)
        total, acc, pick = f32(r.sum(dtype=f32)), f32(0), r.shape[0] - 1
        for i, w in enumerate(r):
            acc = f32(acc + w)
            if acc > f32(u_final[b]) * total:
                pick = i
                break
        predicts[path[-1]] = pick
        results.append((path, predicts))
    return results


# ---------------------------------------------------------------------------------------------------------
# Random EAGLE trees: the id scheme of select_top_k with random path scores (strictly decreasing along paths).

def random_eagle_tree(rng, topk, depth, n):
    score = {g: rng.uniform(0.05, 1.0) for g in range(topk)}
    leaves, parents_list = list(range(topk)), [[-1] + list(range(topk))]
    for i in range(1, depth):
        cands = [topk + topk * topk * (i - 1) + r * topk + c for r in range(len(leaves)) for c in range(topk)]
        for g in cands:
            score[g] = score[leaves[(g - topk - topk * topk * (i - 1)) // topk]] * rng.uniform(0.05, 0.99)
        leaves = sorted(cands, key=lambda g: -score[g])[:topk]
        parents_list.append(leaves)
    parent_list = [g for entry in parents_list[:-1] for g in entry]
    selected = sorted(sorted(score, key=lambda g: -score[g])[: n - 1])
    return parent_list, selected


@st.composite
def eagle_batches(draw):
    topk, depth = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    n = draw(st.integers(2, min(topk + (depth - 1) * topk * topk, 12) + 1))
    bs, seed = draw(st.integers(1, 4)), draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    trees = [random_eagle_tree(rng, topk, depth, n) for _ in range(bs)]
    seq_lens = rng.integers(0, 7, bs).tolist()
    return topk, depth, n, trees, seq_lens, rng


def build_batch(topk, depth, n, trees, seq_lens):
    bs = len(trees)
    parent_list = torch.tensor([t[0] for t in trees], dtype=torch.int64).reshape(bs, -1)  # [bs, 0] at depth 1
    qlen = torch.zeros(bs * n * n, dtype=torch.bool)
    positions, retrieve = torch.empty(bs * n, dtype=torch.int64), torch.full((3, bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient(parent_list, torch.tensor([t[1] for t in trees]), torch.tensor(seq_lens), qlen,
                                positions, retrieve[0], retrieve[1], retrieve[2], topk, depth, n,
                                int(TreeMaskMode.QLEN_ONLY))
    return qlen, positions, retrieve
