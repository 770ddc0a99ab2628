"""sgl_kernel-compatible speculative ops (tree build, tree verify, renorm): pure-torch twins + CUDA dispatch.

The names exported here dispatch (dispatch.py): sgl_kernel for CUDA tensors when it imports, else the twin,
with the same positional signatures and in-place outputs. The twins stay importable from their modules
(tree.py, verify.py, sampling.py). This package is the only place that may import sgl_kernel. Knows nothing
about models, KV or requests.
"""

from fastspec.kernels.dispatch import (
    build_tree_kernel_efficient,
    kernels_backend,
    reconstruct_indices_from_tree_mask,
    top_k_renorm_prob,
    top_p_renorm_prob,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)
from fastspec.kernels.sampling import fast_topk
from fastspec.kernels.tree_build import TreeMaskMode, ancestor_mask, full_tree_mask
from fastspec.kernels.verify import sample_from_weights, tree_links

__all__ = [
    "TreeMaskMode",
    "ancestor_mask",
    "build_tree_kernel_efficient",
    "fast_topk",
    "full_tree_mask",
    "kernels_backend",
    "reconstruct_indices_from_tree_mask",
    "sample_from_weights",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "tree_links",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]
