"""FlashInfer attention backend: the same `plan(metadata)` / `run(...)` interface as the torch backend, on CUDA.

Owns the translation of an `AttnMetadata` into FlashInfer plan() arguments (page-size-1 view: kv_indices are
slot ids, last_page_len all ones, int32 indptrs), the wrappers (one per mode, one per draft step, one per
CUDA-graph bucket), their fixed graph buffers and bucket padding, and `make_backend`. The argument functions
are pure and run on CPU. It does not build metadata (metadata.py), write K/V (context.py) or capture graphs
(graphs/). flashinfer is imported lazily, only when a FlashInferAttnBackend is constructed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fastspec.attention.metadata import AttnMetadata, AttnMode
from fastspec.attention.torch_backend import TorchAttnBackend
from fastspec.errors import FastspecError

DEFAULT_WORKSPACE_BYTES = 384 << 20  # SGLang's default float workspace, shared by every wrapper
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


def _plan_wrapper(wrapper, meta: AttnMetadata, shape: AttnShape) -> None:
    decode = meta.mode in DECODE_MODES
    args = decode_plan_args(meta, shape) if decode else prefill_plan_args(meta, shape)
    positional = DECODE_POSITIONAL if decode else PREFILL_POSITIONAL
    wrapper.plan(*(args[name] for name in positional), **{k: v for k, v in args.items() if k not in positional})


def _empty_metadata(mode: AttnMode, masked: bool, device) -> AttnMetadata:
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    return AttnMetadata(mode, zero, zero, torch.empty(0, dtype=torch.int32, device=device),
                        torch.empty(0, dtype=torch.int64, device=device),
                        torch.empty(0, dtype=torch.bool, device=device) if masked else None, True)


# ----------------------------------------------------------------------------------------------------------
# the backend


class _GraphBuffers:
    """Fixed device buffers of one (mode, step): every bucket's wrapper plans into prefixes of these."""

    def __init__(self, limits: GraphLimits, device):
        r, t, ctx = limits.max_requests, limits.max_tokens, limits.max_context_len
        i32 = dict(dtype=torch.int32, device=device)
        self.qo_indptr = torch.zeros(r + 1, **i32)
        self.kv_indptr = torch.zeros(r + 1, **i32)
        self.kv_indices = torch.zeros(r * ctx, **i32)
        self.last_page_len = torch.ones(r, **i32)
        self.mask_indptr = torch.zeros(r + 1, **i32)
        self.packed_mask = torch.zeros(-(-t * ctx // 8) + r, dtype=torch.uint8, device=device)  # bit-packed
        self.out_cache_loc = torch.zeros(t, dtype=torch.int64, device=device)


class FlashInferAttnBackend:
    """Prefill wrappers for EXTEND / DRAFT_EXTEND / TARGET_VERIFY, decode wrappers for DECODE / DRAFT_DECODE.

    plan() copies the indptrs to the host (FlashInfer schedules work there); with device metadata that copy
    syncs the stream, so a wrapper's re-plan never overwrites its pinned staging buffer mid-upload. Graph mode:
    plan(meta, graph=bucket) before capture and before every replay; the wrapper, its buffers and
    plan.out_cache_loc are the same objects each time, so the captured kernels read the new metadata.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, *, kv_dtype: torch.dtype | None = None,
                 sm_scale: float | None = None, graph_limits: GraphLimits | None = None):
        try:
            import flashinfer
        except ImportError as e:
            raise FastspecError(f"flashinfer is not importable ({e}); pip install 'fastspec[gpu]'") from e
        if dtype not in (torch.float16, torch.bfloat16):
            raise FastspecError(f"flashinfer attention needs float16 or bfloat16, got {dtype}")
        self._flashinfer = flashinfer
        self.device = torch.device(device)
        self.shape = AttnShape(num_qo_heads, num_kv_heads, head_dim, dtype, kv_dtype or dtype,
                               sm_scale if sm_scale is not None else head_dim ** -0.5)
        self.graph_limits = graph_limits
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[WrapperKey, object] = {}
        self._buffers: dict[tuple[AttnMode, int], _GraphBuffers] = {}

    def plan(self, meta: AttnMetadata, *, step: int = 0, graph: GraphBucket | None = None) -> FlashInferAttnPlan:
        key = wrapper_key(meta.mode, step, graph)
        out_cache_loc = meta.out_cache_loc
        if graph is not None:
            if meta.mode in DECODE_MODES and graph.num_tokens != graph.batch_size:
                raise ValueError(f"{meta.mode}: a decode bucket has one row per request, got {graph}")
            meta = pad_to_bucket(meta, graph)
            out_cache_loc = self._graph_buffers(key).out_cache_loc[: graph.num_tokens]
            out_cache_loc.copy_(meta.out_cache_loc, non_blocking=True)
        wrapper = self._wrappers[key] if key in self._wrappers else self._new_wrapper(key, meta, graph)
        _plan_wrapper(wrapper, meta, self.shape)
        return FlashInferAttnPlan(key, wrapper, out_cache_loc, self.shape.sm_scale)

    def run(self, plan: FlashInferAttnPlan,
            q: torch.Tensor,        # [T, Hq, D]
            k_cache: torch.Tensor,  # [num_slots, Hkv, D]  one layer, new tokens' K/V already written
            v_cache: torch.Tensor,  # [num_slots, Hkv, D]
            scale: float) -> torch.Tensor:  # [T, Hq, D]
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [num_slots, page_size 1, Hkv, D]  NHD
        return plan.wrapper.run(q, paged, **scale_kwargs(scale, plan.sm_scale))

    # ---- wrappers ----------------------------------------------------------------------------------------

    def _graph_buffers(self, key: WrapperKey) -> _GraphBuffers:
        if self.graph_limits is None:
            raise ValueError("graph-mode plan on a FlashInferAttnBackend built without graph_limits")
        slot = (key.mode, key.step)
        if slot not in self._buffers:
            self._buffers[slot] = _GraphBuffers(self.graph_limits, self.device)
        return self._buffers[slot]

    def _new_wrapper(self, key: WrapperKey, meta: AttnMetadata, graph: GraphBucket | None):
        masked = meta.custom_mask is not None
        if graph is None:
            wrapper = self._construct(key.mode, masked, None, None)
        else:
            limits = self.graph_limits
            if graph.batch_size > limits.max_requests or graph.num_tokens > limits.max_tokens:
                raise ValueError(f"graph bucket {graph} exceeds the backend's graph limits {limits}")
            wrapper = self._construct(key.mode, masked, self._graph_buffers(key), graph.batch_size)
            # the first plan of a graph wrapper fixes its row capacity: plan the bucket's full shape once
            capture_meta = pad_to_bucket(_empty_metadata(key.mode, masked, self.device), graph)
            _plan_wrapper(wrapper, capture_meta, self.shape)
        self._wrappers[key] = wrapper
        return wrapper

    def _construct(self, mode: AttnMode, masked: bool, buf: _GraphBuffers | None, bs: int | None):
        fi, ws = self._flashinfer, self.workspace
        if mode in DECODE_MODES:
            tensor_cores = decode_use_tensor_cores(self.shape.num_qo_heads, self.shape.num_kv_heads,
                                                   self.shape.kv_dtype)
            if buf is None:
                return fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=buf.kv_indptr[: bs + 1], paged_kv_indices_buffer=buf.kv_indices,
                paged_kv_last_page_len_buffer=buf.last_page_len[:bs])
        backend = "fa2" if mode == AttnMode.DRAFT_EXTEND else "auto"  # as SGLang's draft-extend wrapper
        if buf is None:
            return fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=buf.qo_indptr[: bs + 1],
            paged_kv_indptr_buf=buf.kv_indptr[: bs + 1], paged_kv_indices_buf=buf.kv_indices,
            paged_kv_last_page_len_buf=buf.last_page_len[:bs],
            custom_mask_buf=buf.packed_mask if masked else None,
            mask_indptr_buf=buf.mask_indptr[: bs + 1] if masked else None, backend=backend)


def make_backend(name: str, *, num_qo_heads: int | None = None, num_kv_heads: int | None = None,
                 head_dim: int | None = None, dtype: torch.dtype | None = None, device="cpu",
                 kv_lora_rank: int | None = None, **kwargs):
    """"torch" -> TorchAttnBackend (any device); "flashinfer" -> FlashInferAttnBackend (CUDA only), or with
    `kv_lora_rank` (an MLA latent pool of width head_dim = kv_lora_rank + rope dim) FlashInferMLABackend."""
    if name == "torch":
        return TorchAttnBackend()
    if name != "flashinfer":
        raise FastspecError(f"unknown attention backend '{name}' (choose torch or flashinfer)")
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise FastspecError("flashinfer needs a CUDA device")
    if None in (num_qo_heads, num_kv_heads, head_dim, dtype):
        raise FastspecError("the flashinfer backend needs num_qo_heads, num_kv_heads, head_dim and dtype")
    if kv_lora_rank is not None:
        from fastspec.attention.flashinfer_mla import FlashInferMLABackend

        return FlashInferMLABackend(num_qo_heads, kv_lora_rank, head_dim - kv_lora_rank, dtype, device,
                                    kwargs["sm_scale"])
    return FlashInferAttnBackend(num_qo_heads, num_kv_heads, head_dim, dtype, device, **kwargs)
