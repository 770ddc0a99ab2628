"""Tree construction ops: pure-torch twins of sgl_kernel's `build_tree_kernel_efficient` and
`reconstruct_indices_from_tree_mask`, plus two torch helpers they share.

Owns: turning a draft tree given by parents into the verify inputs (attention mask, positions, the retrieve
linked lists). Does not own: choosing the tree (speculative/tree.py) or walking it (kernels/verify.py).
The sgl_kernel twins keep its positional signatures and write into the caller's pre-allocated outputs, so
sgl_kernel can be swapped in on CUDA; their parameters keep sgl_kernel's `retrive_` spelling (this boundary
only). Everything is vectorised over requests; the only Python loops run log2(N) pointer-jumping rounds.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class TreeMaskMode(IntEnum):
    FULL_MASK = 0             # bool, request b: N x (seq_len_b + N) rows; caller pre-fills True (prefix columns)
    QLEN_ONLY = 1             # bool [bs*N*N], request b: the N x N tree block only
    QLEN_ONLY_BITPACKING = 2  # [bs*N] uint8/16/32 (N <= 8/16/32), bit j of row t = tree column j; zero-filled


def _jump_rounds(n: int) -> int:
    """Pointer-jumping rounds that cover any chain of length < n (2**rounds >= n)."""
    return max(1, (n - 1).bit_length())


def ancestor_mask(parent_pos: torch.Tensor,  # int64 [bs, N]  parent position per node, -1 = root / orphan
                  ) -> torch.Tensor:          # bool [bs, N, N]
    """mask[b, t, j] = node j is t itself, an ancestor of t, or the root (column 0 is True on every row).

    Pointer jumping: after round r, reach[t] holds the ancestors of t at distance < 2**r and jump[t] the
    2**r-th ancestor; a sentinel node N (its own parent, reaching nothing) absorbs walks past the root.
    """
    bs, n = parent_pos.shape
    jump = torch.cat([parent_pos.where(parent_pos >= 0, n), parent_pos.new_full((bs, 1), n)], 1)  # [bs, N+1]
    reach = torch.eye(n + 1, dtype=torch.bool, device=parent_pos.device).repeat(bs, 1, 1)
    reach[:, n, n] = False
    for _ in range(_jump_rounds(n)):
        reach = reach | reach.gather(1, jump[:, :, None].expand(-1, -1, n + 1))
        jump = jump.gather(1, jump)
    mask = reach[:, :n, :n].clone()
    mask[:, :, 0] = True
    return mask


def full_tree_mask(qlen_mask: torch.Tensor,  # bool [bs, N, N]  tree block per request
                   seq_lens: torch.Tensor,   # int64 [bs]
                   seq_lens_sum: int,        # host int == seq_lens.sum()
                   ) -> torch.Tensor:        # bool [seq_lens_sum*N + bs*N*N]  FULL_MASK layout
    """Prefix columns True, then the tree block: request b is an N x (seq_len_b + N) row-major block."""
    bs, n, _ = qlen_mask.shape
    out = torch.ones(seq_lens_sum * n + bs * n * n, dtype=torch.bool, device=qlen_mask.device)
    out[_full_mask_index(seq_lens, n)] = qlen_mask.reshape(-1)
    return out


def _full_mask_index(seq_lens: torch.Tensor, n: int) -> torch.Tensor:  # int64 [bs*N*N]
    """Flat FULL_MASK index of tree cell (b, t, j): start_b + t*(seq_len_b + N) + seq_len_b + j."""
    seq_lens = seq_lens.to(torch.int64)
    bs = seq_lens.shape[0]
    ar = torch.arange(n, device=seq_lens.device)
    start = n * n * torch.arange(bs, device=seq_lens.device) + n * (torch.cumsum(seq_lens, 0) - seq_lens)
    idx = (start[:, None, None] + ar[None, :, None] * (seq_lens + n)[:, None, None]
           + seq_lens[:, None, None] + ar[None, None, :])
    return idx.reshape(-1)


def _first_child(parent_pos: torch.Tensor) -> torch.Tensor:  # [bs, N] -> [bs, N]
    """Smallest child position of each node, -1 for leaves."""
    n = parent_pos.shape[1]
    ar = torch.arange(n, device=parent_pos.device)
    is_child = parent_pos[:, None, :] == ar[None, :, None]  # [bs, node, candidate child]
    first = torch.where(is_child, ar, n).amin(-1)
    return first.where(first < n, -1)


def _next_sibling(parent_pos: torch.Tensor) -> torch.Tensor:  # [bs, N] -> [bs, N]
    """Next larger position with the same (real) parent, -1 if none: siblings in ascending position order."""
    n = parent_pos.shape[1]
    ar = torch.arange(n, device=parent_pos.device)
    later = ar[None, None, :] > ar[None, :, None]
    same = (parent_pos[:, :, None] == parent_pos[:, None, :]) & later & (parent_pos[:, :, None] >= 0)
    nxt = torch.where(same, ar, n).amin(-1)
    return nxt.where(nxt < n, -1)


def _eagle_parent_positions(parent_list: torch.Tensor,     # int64 [bs, topk*(depth-1)+1]
                            selected_index: torch.Tensor,  # int64 [bs, N-1]  ascending global candidate ids
                            topk: int) -> torch.Tensor:    # int64 [bs, N]  -1 for root and orphans
    """Node p >= 1 is candidate g = selected_index[p-1]; its parent candidate is parent_list[g // topk]
    (g // topk == 0: the root). An unselected parent makes the node an orphan (sgl_kernel: "invalid tree")."""
    bs, m = selected_index.shape
    pidx = selected_index // topk
    if parent_list.shape[1] == 0:  # depth 1: every node hangs off the root
        parent_g = torch.full_like(selected_index, -1)
    else:
        parent_g = parent_list.to(torch.int64).gather(1, pidx.clamp(0, parent_list.shape[1] - 1))
    match = selected_index[:, None, :] == parent_g[:, :, None]  # [bs, node, candidate parent]
    pos = torch.where(match.any(-1), match.to(torch.int8).argmax(-1) + 1, -1)
    pos = torch.where(pidx == 0, 0, pos)
    return torch.cat([selected_index.new_full((bs, 1), -1), pos], 1)


def _write_tree_mask(tree_mask, mask, verified_seq_len, tree_mask_mode) -> None:
    bs, n, _ = mask.shape
    mode = int(tree_mask_mode)  # a plain int: torch 2.11's dynamo cannot build an IntEnum inside a compiled region
    if mode == TreeMaskMode.FULL_MASK:
        tree_mask.view(-1)[_full_mask_index(verified_seq_len, n)] = mask.reshape(-1)
    elif mode == TreeMaskMode.QLEN_ONLY:
        tree_mask.view(bs, n, n).copy_(mask)
    else:
        num_bytes = 1 if n <= 8 else 2 if n <= 16 else 4
        rows = tree_mask.view(torch.uint8).view(bs * n, -1)  # little-endian: byte i holds columns 8i..8i+7
        if n > 32 or rows.shape[1] != num_bytes:
            raise ValueError(f"bitpacked tree mask: N={n} needs {num_bytes} bytes per row, "
                             f"buffer has {rows.shape[1]} (N <= 32 supported)")
        bits = torch.zeros(bs * n, num_bytes * 8, dtype=torch.int32, device=mask.device)
        bits[:, :n] = mask.reshape(bs * n, n).to(torch.int32)
        weights = 1 << torch.arange(8, dtype=torch.int32, device=mask.device)
        rows |= (bits.view(bs * n, num_bytes, 8) * weights).sum(-1).to(torch.uint8)


def build_tree_kernel_efficient(parent_list: torch.Tensor,      # int64 [bs, topk*(depth-1)+1]
                                selected_index: torch.Tensor,   # int64 [bs, N-1]  top_scores_index
                                verified_seq_len: torch.Tensor,  # int64 [bs]
                                tree_mask: torch.Tensor,        # out, layout per tree_mask_mode
                                positions: torch.Tensor,        # out int64 [bs*N]  seq_len + depth
                                retrive_index: torch.Tensor,    # out int64 [bs, N]  (sgl_kernel spelling)
                                retrive_next_token: torch.Tensor,    # out int64 [bs, N]
                                retrive_next_sibling: torch.Tensor,  # out int64 [bs, N]
                                topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """Node 0 = root (the verified token), node p >= 1 = candidate selected_index[p-1] (depth-major since
    the ids ascend, so parent position < child position). Mask row t: root, ancestors of t, t. `depth` is
    accepted for signature compatibility (pointer jumping needs no depth bound)."""
    bs, n = verified_seq_len.shape[0], draft_token_num
    parent_pos = _eagle_parent_positions(parent_list, selected_index.to(torch.int64), topk)
    mask = ancestor_mask(parent_pos)
    _write_tree_mask(tree_mask, mask, verified_seq_len, tree_mask_mode)
    node_depth = mask[:, :, 1:].sum(-1)  # ancestors below the root, plus the node itself
    positions.copy_((verified_seq_len.to(torch.int64)[:, None] + node_depth).reshape(positions.shape))
    ar = torch.arange(n, device=parent_pos.device)
    retrive_index.copy_(ar[None, :] + n * torch.arange(bs, device=parent_pos.device)[:, None])
    retrive_next_token.copy_(_first_child(parent_pos))
    retrive_next_sibling.copy_(_next_sibling(parent_pos))


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor,         # bool [bs*N*N]  QLEN_ONLY layout
                                       verified_seq_len: torch.Tensor,  # int64 [bs]
                                       positions: torch.Tensor,         # out int64 [bs*N]
                                       retrive_index: torch.Tensor,     # out int64 [bs, N]
                                       retrive_next_token: torch.Tensor,    # out int64 [bs, N]
                                       retrive_next_sibling: torch.Tensor,  # out int64 [bs, N]
                                       batch_size: int, draft_token_num: int) -> None:
    """Per node t: depth = set columns < t, parent = largest set column < t, next_token = first later row
    with column t set, next_sibling = first later row whose parent is t's parent (i.e. column parent set and
    the columns between clear). Applied to build_tree's masks it reproduces build_tree's outputs."""
    bs, n = batch_size, draft_token_num
    mask = tree_mask.reshape(bs, n, n).to(torch.bool)
    ar = torch.arange(n, device=mask.device)
    before = mask & (ar[None, None, :] < ar[None, :, None])  # [bs, t, j]: set columns j < t
    parent_pos = torch.where(before, ar, -1).amax(-1)
    positions.copy_((verified_seq_len.to(torch.int64)[:, None] + before.sum(-1)).reshape(positions.shape))
    retrive_index.copy_(ar[None, :] + n * torch.arange(bs, device=mask.device)[:, None])
    later = mask.transpose(1, 2) & (ar[None, None, :] > ar[None, :, None])  # [bs, t, i]: row i > t sets col t
    first = torch.where(later, ar, n).amin(-1)
    retrive_next_token.copy_(first.where(first < n, -1))
    retrive_next_sibling.copy_(_next_sibling(parent_pos))
