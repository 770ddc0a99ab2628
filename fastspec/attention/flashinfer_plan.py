"""FlashInfer's plan() arguments from an `AttnMetadata` (a page-size-1 view: kv_indices are slot ids,
last_page_len all ones, int32 indptrs), the wrapper keys (one per mode, draft step and CUDA-graph bucket) and
bucket padding. Pure functions and values: they run on CPU and import no flashinfer (flashinfer_backend does).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fastspec.attention.metadata import AttnMetadata, AttnMode

DUMMY_SLOT = 0                       # the KV pool's reserved slot: padded rows read and write only it
DECODE_MODES = (AttnMode.DECODE, AttnMode.DRAFT_DECODE)
# plan() parameters passed positionally (their names changed across FlashInfer releases); the rest by keyword
PREFILL_POSITIONAL = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                      "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size")
DECODE_POSITIONAL = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")


@dataclass(frozen=True)
class AttnShape:
    """What every plan() of one model's attention shares."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    sm_scale: float  # planned softmax scale; run() rescales through q_scale if a layer asks for another


@dataclass(frozen=True)
class GraphBucket:
    """A CUDA-graph bucket as attention sees it: planned requests (draft decode: bs*topk rows) and the
    query rows the captured graph feeds (decode: == batch_size; verify: bs*N; draft extend: bs*(S+1))."""

    batch_size: int
    num_tokens: int


@dataclass(frozen=True)
class GraphLimits:
    """Sizes of the fixed graph buffers: the largest bucket over all modes this backend serves."""

    max_requests: int
    max_tokens: int
    max_context_len: int  # most keys of one planned request


@dataclass(frozen=True)
class WrapperKey:
    mode: AttnMode
    step: int             # draft step of a DRAFT_DECODE forward (0 for every other mode)
    graph_bs: int | None  # CUDA-graph bucket; None = eager


@dataclass(frozen=True)
class FlashInferAttnPlan:
    key: WrapperKey
    wrapper: object              # the planned flashinfer wrapper; run() only launches kernels
    out_cache_loc: torch.Tensor  # int64 [T]  slots receiving the new K/V (graph mode: a fixed buffer)
    sm_scale: float


# ----------------------------------------------------------------------------------------------------------
# pure argument preparation (CPU-testable)


def wrapper_key(mode: AttnMode, step: int = 0, graph: GraphBucket | None = None) -> WrapperKey:
    """Draft steps get distinct wrappers so a round's S-1 draft forwards can all be planned before any runs."""
    if step < 0 or (step and mode != AttnMode.DRAFT_DECODE):
        raise ValueError(f"a draft step is only meaningful for DRAFT_DECODE, got {mode} step {step}")
    return WrapperKey(mode, step, None if graph is None else graph.batch_size)


def decode_use_tensor_cores(num_qo_heads: int, num_kv_heads: int, kv_dtype: torch.dtype) -> bool:
    """SGLang's rule: the prefill (tensor-core) kernel decodes faster from a GQA group of 4, or with fp8 KV."""
    return num_qo_heads // num_kv_heads >= 4 or kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _ones(meta: AttnMetadata) -> torch.Tensor:  # int32 [bs]  paged_kv_last_page_len at page size 1
    return torch.ones(meta.batch_size, dtype=torch.int32, device=meta.qo_indptr.device)


def prefill_plan_args(meta: AttnMetadata, shape: AttnShape) -> dict:
    """BatchPrefillWithPagedKVCacheWrapper.plan() arguments. A custom mask (target verify) is the flat
    FULL_MASK, per request qo_len x kv_len row-major; with a mask FlashInfer ignores causal, so we pass False."""
    return {
        "qo_indptr": meta.qo_indptr.to(torch.int32),
        "paged_kv_indptr": meta.kv_indptr.to(torch.int32),
        "paged_kv_indices": meta.kv_indices.to(torch.int32),
        "paged_kv_last_page_len": _ones(meta),
        "num_qo_heads": shape.num_qo_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim_qk": shape.head_dim,
        "page_size": 1,
        "custom_mask": meta.custom_mask,
        "causal": meta.causal and meta.custom_mask is None,
        "q_data_type": shape.q_dtype,
        "kv_data_type": shape.kv_dtype,
        "sm_scale": shape.sm_scale,
        "non_blocking": True,
    }


def decode_plan_args(meta: AttnMetadata, shape: AttnShape) -> dict:
    """BatchDecodeWithPagedKVCacheWrapper.plan() arguments: one query row per planned request."""
    if meta.custom_mask is not None or meta.num_tokens != meta.batch_size:
        raise ValueError(f"{meta.mode}: the decode wrapper needs one query row per request and no mask")
    return {
        "indptr": meta.kv_indptr.to(torch.int32),
        "indices": meta.kv_indices.to(torch.int32),
        "last_page_len": _ones(meta),
        "num_qo_heads": shape.num_qo_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "page_size": 1,
        "q_data_type": shape.q_dtype,
        "kv_data_type": shape.kv_dtype,
        "sm_scale": shape.sm_scale,
        "non_blocking": True,
    }


def pad_to_bucket(meta: AttnMetadata, bucket: GraphBucket) -> AttnMetadata:
    """Append dummy requests so the metadata has exactly bucket.batch_size requests.

    Each dummy request has 1 query row over 1 key (the dummy slot), except the last, which takes every spare
    row up to bucket.num_tokens (q rows over q dummy keys, mask all True) so a padded batch plans exactly the
    rows the graph was captured with. E.g. 1 verify request of 4 rows into bucket (3, 12): dummy qo lens [1, 7].
    out_cache_loc always covers num_tokens rows; rows past the last request write the dummy slot.
    """
    bs, num_tokens = meta.batch_size, meta.num_tokens
    extra, spare = bucket.batch_size - bs, bucket.num_tokens - num_tokens
    if extra < 0 or spare < extra:
        raise ValueError(f"{meta.mode}: {bs} requests / {num_tokens} rows do not fit graph bucket {bucket}")
    device = meta.qo_indptr.device
    pad_lens = torch.ones(extra, dtype=torch.int64, device=device)
    if extra:
        pad_lens[-1] += spare - extra
    padded_keys = spare if extra else 0  # each dummy request has as many keys as query rows
    mask = meta.custom_mask
    if mask is not None:
        mask_pad = (extra - 1 + (spare - extra + 1) ** 2) if extra else 0
        mask = torch.cat([mask, torch.ones(mask_pad, dtype=torch.bool, device=device)])

    def grow(indptr: torch.Tensor) -> torch.Tensor:
        return torch.cat([indptr, (indptr[-1:] + torch.cumsum(pad_lens, 0)).to(indptr.dtype)])

    return dataclasses.replace(
        meta, qo_indptr=grow(meta.qo_indptr), kv_indptr=grow(meta.kv_indptr), custom_mask=mask,
        kv_indices=torch.cat([meta.kv_indices, meta.kv_indices.new_full((padded_keys,), DUMMY_SLOT)]),
        out_cache_loc=torch.cat([meta.out_cache_loc, meta.out_cache_loc.new_full((spare,), DUMMY_SLOT)]))


def scale_kwargs(scale: float, planned: float) -> dict:
    """run() keywords that make the kernel use `scale`: FlashInfer multiplies its planned sm_scale by q_scale."""
    return {} if math.isclose(scale, planned, rel_tol=1e-9) else {"q_scale": scale / planned}


def plan_wrapper(wrapper, meta: AttnMetadata, shape: AttnShape) -> None:
    decode = meta.mode in DECODE_MODES
    args = decode_plan_args(meta, shape) if decode else prefill_plan_args(meta, shape)
    positional = DECODE_POSITIONAL if decode else PREFILL_POSITIONAL
    wrapper.plan(*(args[name] for name in positional), **{k: v for k, v in args.items() if k not in positional})


def empty_metadata(mode: AttnMode, masked: bool, device) -> AttnMetadata:
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    return AttnMetadata(mode, zero, zero, torch.empty(0, dtype=torch.int32, device=device),
                        torch.empty(0, dtype=torch.int64, device=device),
                        torch.empty(0, dtype=torch.bool, device=device) if masked else None, True)
