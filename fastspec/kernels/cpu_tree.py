"""A speculative round's tree bookkeeping on CPU in one C call each (cpu_tree.c): an EAGLE tree's verify inputs from
its candidates, and the greedy walk down a tree. Eager CPU rounds only: each function returns None where it cannot
take the tensors (no compiler, another device, inside a compiled graph), and the caller runs the torch twin
(kernels/tree_build.py, kernels/verify.py) that the tests compare these against.
"""

from __future__ import annotations

import torch

from fastspec.kernels import cpu_library


def _takes(*tensors: torch.Tensor):
    """The library, if these tensors can go to it: CPU int64, contiguous, outside a compiled graph."""
    if torch.compiler.is_compiling() or any(
            t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        return None
    return cpu_library.library()


def eagle_tree(parent_list: torch.Tensor,  # int64 [bs, P]  the kept leaves' candidate ids per step (-1 first)
               selected: torch.Tensor,     # int64 [bs, N-1]  the chosen candidate ids, ascending
               seq_lens: torch.Tensor,     # int64 [bs]
               topk: int, n: int) -> tuple[torch.Tensor, ...] | None:
    """(tree_mask bool [bs, N, N], positions [bs*N], retrieve_index, retrieve_next_token, retrieve_next_sibling
    [bs, N]) as tree_build.build_tree_kernel_efficient writes them in QLEN_ONLY mode, or None."""
    lib = _takes(parent_list, selected, seq_lens)
    if lib is None:
        return None
    bs = seq_lens.shape[0]
    mask = torch.empty(bs, n, n, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.int64)
    retrieve = torch.empty(3, bs, n, dtype=torch.int64)
    cpu_library.call(lib.eagle_tree, parent_list.data_ptr(), parent_list.shape[1], selected.data_ptr(),
                     seq_lens.data_ptr(), bs, n, topk, mask.data_ptr(), positions.data_ptr(), retrieve[0].data_ptr(),
                     retrieve[1].data_ptr(), retrieve[2].data_ptr())
    return mask, positions, *retrieve


def greedy_walk(candidates: torch.Tensor,  # int64 [bs, N]  node tokens, column 0 = root
                retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor,
                retrieve_next_sibling: torch.Tensor,  # int64 [bs, N] each
                predict: torch.Tensor,  # int64 [bs, N]  the target's token after each node (by flat verify row)
                num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(accept_index [bs, S+1], accept_len [bs], emitted [bs, S+1]) of verify_tree_greedy's walk, or None."""
    lib = _takes(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, predict)
    if lib is None:
        return None
    bs, n = candidates.shape
    accept_index = torch.empty(bs, num_steps + 1, dtype=torch.int64)
    accept_len = torch.empty(bs, dtype=torch.int64)
    emitted = torch.empty_like(accept_index)
    cpu_library.call(lib.greedy_walk, candidates.data_ptr(), retrieve_index.data_ptr(),
                     retrieve_next_token.data_ptr(), retrieve_next_sibling.data_ptr(), predict.data_ptr(), bs, n,
                     num_steps, accept_index.data_ptr(), accept_len.data_ptr(), emitted.data_ptr())
    return accept_index, accept_len, emitted
