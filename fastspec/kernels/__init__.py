"""sgl_kernel-compatible speculative ops (tree build, tree verify, renorm) as pure-torch twins.

Same positional signatures and in-place outputs as sgl_kernel, so a CUDA build can swap sgl_kernel in here;
this package is the only place that may import it. Knows nothing about models, KV or requests.
"""

from fastspec.kernels.sampling import fast_topk, top_k_renorm_prob, top_p_renorm_prob
from fastspec.kernels.tree import (
    TreeMaskMode,
    ancestor_mask,
    build_tree_kernel_efficient,
    full_tree_mask,
    reconstruct_indices_from_tree_mask,
)
from fastspec.kernels.verify import (
    sample_from_weights,
    tree_links,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)

__all__ = [
    "TreeMaskMode",
    "ancestor_mask",
    "build_tree_kernel_efficient",
    "fast_topk",
    "full_tree_mask",
    "reconstruct_indices_from_tree_mask",
    "sample_from_weights",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "tree_links",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]
