"""FlashInfer attention backend: the same `plan(metadata)` / `run(...)` interface as the torch backend, on CUDA.

Owns the wrappers (one per mode, one per draft step, one per CUDA-graph bucket), their fixed graph buffers, and
`make_backend`; the plan() arguments, wrapper keys and bucket padding are pure functions in flashinfer_plan.
It does not build metadata (metadata.py), write K/V (context.py) or capture graphs (graphs/). flashinfer is imported lazily, only when a FlashInferAttnBackend is constructed.
"""

from __future__ import annotations

import torch

from fastspec.attention.flashinfer_plan import (DECODE_MODES, AttnShape, FlashInferAttnPlan, GraphBucket, GraphLimits,
                                               WrapperKey, decode_use_tensor_cores, empty_metadata, pad_to_bucket,
                                               plan_wrapper, scale_kwargs, wrapper_key)
from fastspec.attention.metadata import AttnMetadata, AttnMode
from fastspec.attention.torch_backend import TorchAttnBackend
from fastspec.errors import FastspecError

DEFAULT_WORKSPACE_BYTES = 384 << 20  # SGLang's default float workspace, shared by every wrapper


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
        plan_wrapper(wrapper, meta, self.shape)
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
            capture_meta = pad_to_bucket(empty_metadata(key.mode, masked, self.device), graph)
            plan_wrapper(wrapper, capture_meta, self.shape)
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
    `kv_lora_rank` (an MLA latent pool of width head_dim = kv_lora_rank + rope dim) FlashInferMLABackend. `kv_dtype`
    (in kwargs): the cache's dtype where it is not `dtype` (fp8)."""
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

        if kwargs.get("kv_dtype", dtype) != dtype:
            raise FastspecError(f"flashinfer's MLA attention reads the latent cache in {dtype}, not "
                                f"{kwargs['kv_dtype']}; use --attention-backend torch for another --kv-cache-dtype")
        return FlashInferMLABackend(num_qo_heads, kv_lora_rank, head_dim - kv_lora_rank, dtype, device,
                                    kwargs["sm_scale"])
    return FlashInferAttnBackend(num_qo_heads, num_kv_heads, head_dim, dtype, device, **kwargs)
