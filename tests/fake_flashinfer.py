"""A fake `flashinfer` for CPU tests: wrappers that execute FlashInfer's documented plan()/run() semantics
(keyword-only optional plan arguments, int32 index checks, fixed batch and row capacity in graph mode) with a
dense float64 loop."""

from __future__ import annotations

import torch

I32 = torch.int32


def dense_paged_attention(q, k, v, qo_indptr, kv_indptr, indices, last_page_len, mask, causal, sm_scale):
    """Per request b: kv_len = (pages-1)*page_size + last_page_len; mask = its qo x kv row-major block."""
    page_size, group = k.shape[1], q.shape[1] // k.shape[2]
    out, mask_at = torch.zeros(q.shape, dtype=torch.float64), 0
    for b in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pages = indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        kv_len = (pages.numel() - 1) * page_size + int(last_page_len[b])
        kb = k[pages].reshape(-1, *k.shape[2:])[:kv_len].double().repeat_interleave(group, 1)
        vb = v[pages].reshape(-1, *v.shape[2:])[:kv_len].double().repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kb) * sm_scale
        qi, kj = torch.arange(q1 - q0)[:, None], torch.arange(kv_len)[None, :]
        if mask is not None:
            allowed = mask[mask_at: mask_at + (q1 - q0) * kv_len].view(q1 - q0, kv_len)
            mask_at += (q1 - q0) * kv_len
        else:
            allowed = (kj <= kv_len - (q1 - q0) + qi) if causal else torch.ones(q1 - q0, kv_len, dtype=torch.bool)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", logits.masked_fill(~allowed, -torch.inf).softmax(-1), vb)
    return out.to(q.dtype)


class FakeWrapper:
    def _store(self, graph_buffers: dict, indptrs: dict, indices, mask, mask_buf):
        for t in [*indptrs.values(), indices]:
            assert t.dtype == I32
        if not self.use_cuda_graph:
            self.state = dict(indptrs, indices=indices)
            self.mask = mask
            return
        assert len(indptrs["last_page_len"]) == len(graph_buffers["last_page_len"]), "cudagraph batch is fixed"
        rows = int(indptrs["qo_indptr"][-1]) if "qo_indptr" in indptrs else len(indptrs["last_page_len"])
        self.max_rows = self.max_rows or rows
        assert rows <= self.max_rows, "more rows than the first (capture) plan"
        for name, t in indptrs.items():
            graph_buffers[name].copy_(t)
        graph_buffers["indices"][: len(indices)].copy_(indices)
        if mask is not None:  # a real wrapper bit-packs it into custom_mask_buf
            assert mask_buf is not None and (mask.numel() + 7) // 8 <= mask_buf.numel()
        self.state, self.mask = graph_buffers, None if mask is None else mask.clone()

    def _attend(self, q, paged_kv_cache, q_scale, qo_indptr, causal):
        k, v = paged_kv_cache
        assert k.dim() == 4 and k.shape[1] == self.page_size and q.dtype == self.q_dtype  # NHD pages
        scale = (self.sm_scale or q.shape[-1] ** -0.5) * (q_scale or 1.0)
        s = self.state
        return dense_paged_attention(q, k, v, qo_indptr, s["kv_indptr"], s["indices"], s["last_page_len"],
                                     self.mask, causal, scale)


class FakePrefillWrapper(FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        assert kv_layout == "NHD"
        self.use_cuda_graph, self.backend, self.max_rows, self.plans = use_cuda_graph, backend, None, []
        self.buffers = dict(qo_indptr=qo_indptr_buf, kv_indptr=paged_kv_indptr_buf,
                            indices=paged_kv_indices_buf, last_page_len=paged_kv_last_page_len_buf)
        assert not use_cuda_graph or all(b is not None for b in self.buffers.values())
        self.custom_mask_buf = custom_mask_buf

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True):
        self.plans.append(dict(qo_indptr=qo_indptr.clone(), rows=int(qo_indptr[-1]), masked=custom_mask is not None))
        indptrs = dict(qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, last_page_len=paged_kv_last_page_len)
        self._store(self.buffers, indptrs, paged_kv_indices, custom_mask, self.custom_mask_buf)
        self.causal, self.sm_scale, self.page_size, self.q_dtype = causal, sm_scale, page_size, q_data_type

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        return self._attend(q, paged_kv_cache, q_scale, self.state["qo_indptr"], self.causal)


class FakeDecodeWrapper(FakeWrapper):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.max_rows, self.plans = None, []
        self.buffers = dict(kv_indptr=paged_kv_indptr_buffer, indices=paged_kv_indices_buffer,
                            last_page_len=paged_kv_last_page_len_buffer)
        assert not use_cuda_graph or all(b is not None for b in self.buffers.values())

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        self.plans.append(dict(rows=len(last_page_len)))
        self._store(self.buffers, dict(kv_indptr=indptr, last_page_len=last_page_len), indices, None, None)
        self.sm_scale, self.page_size, self.q_dtype = sm_scale, page_size, q_data_type

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=1):
        assert q.shape[0] == len(self.state["last_page_len"]), "decode: one query row per planned request"
        return self._attend(q, paged_kv_cache, q_scale, torch.arange(q.shape[0] + 1), False)
