"""FlashInfer MLA backend: attention over the latent KV pool through `BatchMLAPagedAttentionWrapper`.

The same plan(metadata) / run(...) interface as the other backends. run() receives what
AttentionContext.attend_latent passes: q [T, H, C+R] (q_nope absorbed into the latent space | q_rope) and the
layer's latent cache [num_slots, 1, C+R] (compressed KV | rope key); it splits both into the nope / rope parts
FlashInfer's MLA kernels take (ckv and kpe as strided page-size-1 views of the one cache tensor: nothing is
copied) and returns the attention-weighted latent [T, H, C]. Planning happens on the host, once per forward.

It serves the eager forwards of the worker (prefill chunks, plain decode rounds); FlashInfer's MLA kernels take no
custom mask, and the speculative round functions attend through the static torch path anyway. flashinfer is
imported lazily, only when a FlashInferMLABackend is constructed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastspec.attention.metadata import AttnMetadata
from fastspec.errors import FastspecError

# plan()'s parameters, in FlashInfer's documented order (passed positionally, as they have kept their order)
PLAN_ORDER = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv", "head_dim_kpe",
              "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")


@dataclass(frozen=True)
class MLAShape:
    num_heads: int
    kv_lora_rank: int  # C: head_dim_ckv
    rope_dim: int  # R: head_dim_kpe
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float  # planned; run() rescales q when a layer asks for another


@dataclass(frozen=True)
class FlashInferMLAPlan:
    wrapper: object  # the planned wrapper; run() only launches kernels
    out_cache_loc: torch.Tensor  # int64 [T]  slots receiving the new tokens' latents
    sm_scale: float


def mla_plan_args(meta: AttnMetadata, shape: MLAShape) -> dict:
    """BatchMLAPagedAttentionWrapper.plan() arguments for the page-size-1 view (kv_indices are slot ids)."""
    if meta.custom_mask is not None:
        raise ValueError(f"{meta.mode}: FlashInfer's MLA kernels take no custom mask")
    kv_indptr = meta.kv_indptr.to(torch.int32)
    return {
        "qo_indptr": meta.qo_indptr.to(torch.int32),
        "kv_indptr": kv_indptr,
        "kv_indices": meta.kv_indices.to(torch.int32),
        "kv_len_arr": kv_indptr[1:] - kv_indptr[:-1],
        "num_heads": shape.num_heads,
        "head_dim_ckv": shape.kv_lora_rank,
        "head_dim_kpe": shape.rope_dim,
        "page_size": 1,
        "causal": meta.causal,  # bottom-right aligned, as our metadata means it
        "sm_scale": shape.sm_scale,
        "q_data_type": shape.q_dtype,
        "kv_data_type": shape.kv_dtype,
    }


class FlashInferMLABackend:
    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, device,
                 sm_scale: float, workspace_bytes: int = 128 << 20):
        try:
            import flashinfer
        except ImportError as e:
            raise FastspecError(f"flashinfer is not importable ({e}); pip install 'fastspec[gpu]'") from e
        if dtype not in (torch.float16, torch.bfloat16):
            raise FastspecError(f"flashinfer MLA attention needs float16 or bfloat16, got {dtype}")
        self.shape = MLAShape(num_heads, kv_lora_rank, rope_dim, dtype, dtype, sm_scale)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)  # one forward at a time

    def plan(self, meta: AttnMetadata) -> FlashInferMLAPlan:
        args = mla_plan_args(meta, self.shape)
        self.wrapper.plan(*(args[name] for name in PLAN_ORDER))
        return FlashInferMLAPlan(self.wrapper, meta.out_cache_loc, self.shape.sm_scale)

    def run(self, plan: FlashInferMLAPlan,
            q: torch.Tensor,        # [T, H, C+R]
            k_cache: torch.Tensor,  # [num_slots, 1, C+R]  one layer's latents, the new tokens' already written
            v_cache: torch.Tensor,  # [num_slots, 1, C]    a view of k_cache (V = the compressed KV)
            scale: float) -> torch.Tensor:  # [T, H, C]
        C = self.shape.kv_lora_rank
        if v_cache.shape[-1] != C or k_cache.shape[-1] != C + self.shape.rope_dim:
            raise ValueError(f"latent cache of width {k_cache.shape[-1]} / V {v_cache.shape[-1]} does not match "
                             f"the planned {C} + {self.shape.rope_dim}")
        if not math.isclose(scale, plan.sm_scale, rel_tol=1e-9):
            q = q * (scale / plan.sm_scale)  # the kernel applies the planned scale
        ckv, kpe = k_cache[:, :, :C], k_cache[:, :, C:]  # [num_slots, page 1, C] / [.., R]: strided views
        return plan.wrapper.run(q[..., :C], q[..., C:], ckv, kpe)
