"""CUDA dispatch for the speculative ops: sgl_kernel when the tensors are on CUDA and it imports, else the twin.

Owns the only `import sgl_kernel` in fastspec (lazy, on the first CUDA call) and the calling convention at
that boundary: every argument positional, because later sgl-kernel builds renamed the `retrive_*` keywords to
`retrieve_*`, and builds after SGLang PR #28581 dropped `draft_probs` from tree_speculative_sampling_target_only
(they allocate it internally, so the caller's buffer is then left untouched). Semantics live in the pure-torch
twins (tree.py, verify.py, sampling.py); nothing here computes anything.
"""

from __future__ import annotations

import functools
import inspect

import torch

from fastspec.kernels.sampling import top_k_renorm_prob as _top_k_renorm_prob_twin
from fastspec.kernels.sampling import top_p_renorm_prob as _top_p_renorm_prob_twin
from fastspec.kernels.tree_build import build_tree_kernel_efficient as _build_tree_twin
from fastspec.kernels.tree_build import reconstruct_indices_from_tree_mask as _reconstruct_twin
from fastspec.kernels.verify import tree_speculative_sampling_target_only as _tree_sampling_twin
from fastspec.kernels.verify import verify_tree_greedy as _verify_greedy_twin


@functools.cache
def _sgl_kernel():
    """The sgl_kernel module, or None. Without the CUDA libraries it fails with OSError / RuntimeError too."""
    try:
        import sgl_kernel
    except Exception:  # noqa: BLE001 - any import failure means "use the torch twins"
        return None
    return sgl_kernel


def sgl_kernel_op(name: str, device):
    """sgl_kernel.<name> for tensors on `device` if it is CUDA and the installed sgl_kernel provides it, else None."""
    if torch.device(device).type != "cuda":
        return None
    return getattr(_sgl_kernel(), name, None)


def _kernel(name: str, tensor: torch.Tensor):
    return sgl_kernel_op(name, tensor.device)


def kernels_backend(device) -> str:
    """Which implementation the ops use for tensors on `device`: "sgl_kernel" or "torch"."""
    if torch.device(device).type == "cuda" and getattr(_sgl_kernel(), "verify_tree_greedy", None) is not None:
        return "sgl_kernel"
    return "torch"


@functools.cache
def _takes_draft_probs(op) -> bool:
    """True for sgl-kernel builds whose tree sampling still takes draft_probs (0.3.21, the version we pin)."""
    try:
        return "draft_probs" in inspect.signature(op).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the pinned layout
        return True


def build_tree_kernel_efficient(parent_list: torch.Tensor,      # int64 [bs, topk*(depth-1)+1]
                                selected_index: torch.Tensor,   # int64 [bs, N-1]
                                verified_seq_len: torch.Tensor,  # int64 [bs]
                                tree_mask: torch.Tensor,        # out, layout per tree_mask_mode
                                positions: torch.Tensor,        # out int64 [bs*N]
                                retrieve_index: torch.Tensor,   # out int64 [bs, N]  pre-filled -1
                                retrieve_next_token: torch.Tensor,    # out int64 [bs, N]  pre-filled -1
                                retrieve_next_sibling: torch.Tensor,  # out int64 [bs, N]  pre-filled -1
                                topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    op = _kernel("build_tree_kernel_efficient", verified_seq_len) or _build_tree_twin
    op(parent_list, selected_index, verified_seq_len, tree_mask, positions, retrieve_index, retrieve_next_token,
       retrieve_next_sibling, int(topk), int(depth), int(draft_token_num), int(tree_mask_mode))


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor,         # bool [bs*N*N]  QLEN_ONLY layout
                                       verified_seq_len: torch.Tensor,  # int64 [bs]
                                       positions: torch.Tensor,         # out int64 [bs*N]
                                       retrieve_index: torch.Tensor,    # out int64 [bs, N]
                                       retrieve_next_token: torch.Tensor,    # out int64 [bs, N]
                                       retrieve_next_sibling: torch.Tensor,  # out int64 [bs, N]
                                       batch_size: int, draft_token_num: int) -> None:
    op = _kernel("reconstruct_indices_from_tree_mask", verified_seq_len) or _reconstruct_twin
    op(tree_mask, verified_seq_len, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling,
       int(batch_size), int(draft_token_num))


def verify_tree_greedy(predicts: torch.Tensor,          # out int32 [bs*N]
                       accept_index: torch.Tensor,      # out int32 [bs, S+1]  pre-filled -1
                       accept_token_num: torch.Tensor,  # out int32 [bs]
                       candidates: torch.Tensor,        # int64 [bs, N]
                       retrieve_index: torch.Tensor,    # int64 [bs, N]
                       retrieve_next_token: torch.Tensor,    # int64 [bs, N]
                       retrieve_next_sibling: torch.Tensor,  # int64 [bs, N]
                       target_predict: torch.Tensor,    # int64 [bs, N]
                       ) -> None:
    op = _kernel("verify_tree_greedy", candidates) or _verify_greedy_twin
    op(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
       retrieve_next_sibling, target_predict)


def tree_speculative_sampling_target_only(
        predicts: torch.Tensor,          # out int32 [bs*N]
        accept_index: torch.Tensor,      # out int32 [bs, S+1]  pre-filled -1
        accept_token_num: torch.Tensor,  # out int32 [bs]
        candidates: torch.Tensor,        # int64 [bs, N]
        retrieve_index: torch.Tensor,    # int64 [bs, N]
        retrieve_next_token: torch.Tensor,    # int64 [bs, N]
        retrieve_next_sibling: torch.Tensor,  # int64 [bs, N]
        uniform_samples: torch.Tensor,   # float32 [bs, N]
        uniform_samples_for_final_sampling: torch.Tensor,  # float32 [bs]
        target_probs: torch.Tensor,      # float32 [bs, N, V]
        draft_probs: torch.Tensor,       # float32 [bs, N, V]  in/out scratch (not written by newer builds)
        threshold_single: float = 1.0, threshold_acc: float = 1.0, deterministic: bool = True) -> None:
    head = (predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
            retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs)
    tail = (float(threshold_single), float(threshold_acc), bool(deterministic))
    op = _kernel("tree_speculative_sampling_target_only", candidates)
    if op is None:
        _tree_sampling_twin(*head, draft_probs, *tail)
    elif _takes_draft_probs(op):
        op(*head, draft_probs, *tail)
    else:
        op(*head, *tail)


def top_k_renorm_prob(probs: torch.Tensor,  # float [batch, V]
                      top_k,                # int or int tensor [batch]
                      ) -> torch.Tensor:    # float32 [batch, V]
    op = _kernel("top_k_renorm_prob", probs) or _top_k_renorm_prob_twin
    return op(probs, top_k)


def top_p_renorm_prob(probs: torch.Tensor,  # float [batch, V]
                      top_p,                # float or float tensor [batch]
                      ) -> torch.Tensor:    # float32 [batch, V]
    op = _kernel("top_p_renorm_prob", probs) or _top_p_renorm_prob_twin
    return op(probs, top_p)
