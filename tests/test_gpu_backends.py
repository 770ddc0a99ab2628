"""GPU backends: FlashInfer attention and sgl_kernel dispatch, checked on CPU and (marked `gpu`) on CUDA.

CPU: the plan-argument functions against hand-worked metadata; the whole FlashInferAttnBackend driven through
a fake `flashinfer` module whose wrappers execute FlashInfer's documented plan()/run() semantics with a dense
float64 loop (keyword-only optional plan arguments, int32 index checks, fixed batch and row capacity in graph
mode), compared with TorchAttnBackend; the kernel dispatch falling back to the torch twins, and its positional
calling convention against fake sgl_kernel ops of both signatures. GPU: the real flashinfer and sgl_kernel
against the torch twins.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from fastspec.attention import (
    TorchAttnBackend,
    decode_metadata,
    draft_decode_metadata,
    draft_extend_metadata,
    extend_metadata,
    make_backend,
    verify_metadata,
)
from fastspec.attention.flashinfer_backend import (
    AttnShape,
    FlashInferAttnBackend,
    GraphBucket,
    GraphLimits,
    decode_plan_args,
    decode_use_tensor_cores,
    pad_to_bucket,
    prefill_plan_args,
    scale_kwargs,
    wrapper_key,
)
from fastspec.attention.metadata import AttnMetadata, AttnMode
from fastspec.errors import FastspecError
from fastspec.kernels import dispatch
from fastspec.kernels import sampling as sampling_twins
from fastspec.kernels import tree as tree_twins
from fastspec.kernels import verify as verify_twins
from fastspec.kernels.tree import TreeMaskMode, ancestor_mask, full_tree_mask
from fastspec.speculative.tree import organize_draft_results, select_top_k

SHAPE = AttnShape(8, 2, 16, torch.bfloat16, torch.bfloat16, 0.25)
I32 = torch.int32


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def gpu(test):
    """The `gpu` marker plus the skip when no CUDA device is present."""
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(pytest.mark.gpu(test))


# ---------------------------------------------------------------------------------------------------------
# metadata fixtures


def patterned_table(num_rows: int = 3, width: int = 12) -> torch.Tensor:
    """Row r holds slots 10*(r+1) + j."""
    return torch.tensor([[10 * (r + 1) + j for j in range(width)] for r in range(num_rows)], dtype=I32)


def random_tree_mask(gen, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """FULL_MASK of a random tree per request (parent of node t uniform in [0, t))."""
    bs = seq_lens.numel()
    parents = (torch.rand(bs, n - 1, generator=gen) * torch.arange(1, n)).long()
    parent_pos = torch.cat([torch.full((bs, 1), -1), parents], 1)
    return full_tree_mask(ancestor_mask(parent_pos), seq_lens, int(seq_lens.sum()))


def scenario(device="cpu", rows=(0, 1, 2), seq=(5, 3, 7), seed=0):
    """Random slot table, K/V pool and one metadata per mode for requests `rows` with lengths `seq`."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, width = 4, 32
    num_slots = num_rows * width + 1
    table = (torch.randperm(num_slots - 1, generator=gen)[: num_rows * width] + 1).view(num_rows, width).to(I32)
    k = torch.randn(num_slots, 2, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_slots, 2, 16, generator=gen).to(torch.bfloat16)
    rows_t, seq_t = torch.tensor(rows), torch.tensor(seq)
    metas = {
        "extend": extend_metadata(table, rows_t, seq_t - seq_t.clamp(max=3), seq_t.clamp(max=3)),
        "decode": decode_metadata(table, rows_t, seq_t),
        "draft_decode": draft_decode_metadata(table, rows_t, seq_t, topk=2, num_steps=3, step=1),
        "draft_extend": draft_extend_metadata(table, rows_t, seq_t, torch.minimum(seq_t % 3 + 1, seq_t)),
        "verify": verify_metadata(table, rows_t, seq_t, 4, random_tree_mask(gen, seq_t, 4)),
    }
    to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    metas = {name: AttnMetadata(*[to(getattr(m, f)) for f in AttnMetadata.__dataclass_fields__])
             for name, m in metas.items()}
    return table.to(device), k.to(device), v.to(device), metas


def reference(meta, q, k, v, scale):
    """TorchAttnBackend in float32 on the same (bf16-rounded) inputs."""
    backend = TorchAttnBackend()
    return backend.run(backend.plan(meta), q.float(), k.float(), v.float(), scale)


# ---------------------------------------------------------------------------------------------------------
# plan arguments, hand-worked


def test_prefill_args_extend_and_draft_extend():
    table = patterned_table()
    meta = extend_metadata(table, torch.tensor([0, 1]), torch.tensor([2, 0]), torch.tensor([3, 2]))
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 3, 5]))
    assert torch.equal(args["paged_kv_indptr"], t32([0, 5, 7]))
    assert torch.equal(args["paged_kv_indices"], t32([10, 11, 12, 13, 14, 20, 21]))
    assert torch.equal(args["paged_kv_last_page_len"], t32([1, 1]))
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert args[name].dtype == I32
    assert (args["page_size"], args["causal"], args["custom_mask"]) == (1, True, None)
    assert (args["num_qo_heads"], args["num_kv_heads"], args["head_dim_qk"], args["sm_scale"]) == (8, 2, 16, 0.25)
    assert args["q_data_type"] == args["kv_data_type"] == torch.bfloat16
    meta = draft_extend_metadata(table, torch.tensor([0, 1]), torch.tensor([4, 2]), torch.tensor([2, 1]))
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 2, 3])) and torch.equal(args["paged_kv_indptr"], t32([0, 4, 6]))
    assert args["causal"] is True and args["custom_mask"] is None


def test_prefill_args_verify_pass_the_flat_tree_mask_and_no_causal():
    table = patterned_table()
    # request 0: seq 2, N 2 -> 2 x 4 block; request 1: seq 1 -> 2 x 3 block (FULL_MASK, row-major per request)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1] + [1, 1, 0, 1, 1, 1], dtype=torch.bool)
    meta = verify_metadata(table, torch.tensor([0, 1]), torch.tensor([2, 1]), 2, mask)
    args = prefill_plan_args(meta, SHAPE)
    assert torch.equal(args["qo_indptr"], t32([0, 2, 4])) and torch.equal(args["paged_kv_indptr"], t32([0, 4, 7]))
    assert torch.equal(args["paged_kv_indices"], t32([10, 11, 12, 13, 20, 21, 22]))
    assert torch.equal(args["custom_mask"], mask) and args["causal"] is False


def test_decode_args_decode_and_draft_decode():
    table = patterned_table()
    args = decode_plan_args(decode_metadata(table, torch.tensor([0, 1]), torch.tensor([3, 2])), SHAPE)
    assert torch.equal(args["indptr"], t32([0, 3, 5])) and torch.equal(args["indices"], t32([10, 11, 12, 20, 21]))
    assert torch.equal(args["last_page_len"], t32([1, 1])) and args["page_size"] == 1
    assert "causal" not in args and "custom_mask" not in args
    # seq 2, topk 2, num_steps 2, step 1: branch 0 reads columns [0, 1, 2, 3], branch 1 reads [0, 1, 4, 5]
    meta = draft_decode_metadata(table, torch.tensor([0]), torch.tensor([2]), topk=2, num_steps=2, step=1)
    args = decode_plan_args(meta, SHAPE)
    assert torch.equal(args["indptr"], t32([0, 4, 8]))
    assert torch.equal(args["indices"], t32([10, 11, 12, 13, 10, 11, 14, 15]))
    with pytest.raises(ValueError, match="one query row"):
        decode_plan_args(extend_metadata(table, torch.tensor([0]), torch.tensor([0]), torch.tensor([2])), SHAPE)


def test_wrapper_keys_and_tensor_core_rule():
    keys = {wrapper_key(AttnMode.DRAFT_DECODE, step) for step in range(4)}
    assert len(keys) == 4 and {k.step for k in keys} == {0, 1, 2, 3}
    assert wrapper_key(AttnMode.DECODE) != wrapper_key(AttnMode.DRAFT_DECODE)
    assert wrapper_key(AttnMode.TARGET_VERIFY, graph=GraphBucket(4, 16)).graph_bs == 4
    with pytest.raises(ValueError):
        wrapper_key(AttnMode.TARGET_VERIFY, 1)
    assert decode_use_tensor_cores(32, 8, torch.bfloat16) and not decode_use_tensor_cores(32, 16, torch.float16)
    assert decode_use_tensor_cores(8, 8, torch.float8_e4m3fn)


def test_scale_kwargs():
    assert scale_kwargs(0.25, 0.25) == {}
    assert scale_kwargs(0.5, 0.25) == {"q_scale": 2.0}


def test_pad_to_bucket_hand_worked():
    mask = torch.rand(24) > 0.5  # one verify request: 4 rows x 6 keys
    meta = AttnMetadata(AttnMode.TARGET_VERIFY, t32([0, 4]), t32([0, 6]), t32([7, 8, 9, 3, 4, 5]),
                        torch.tensor([3, 4, 5, 6]), mask, True)
    padded = pad_to_bucket(meta, GraphBucket(3, 12))  # dummy requests: 1 row x 1 key, 7 rows x 7 keys
    assert torch.equal(padded.qo_indptr, t32([0, 4, 5, 12])) and torch.equal(padded.kv_indptr, t32([0, 6, 7, 14]))
    assert torch.equal(padded.kv_indices, t32([7, 8, 9, 3, 4, 5] + [0] * 8))
    assert torch.equal(padded.out_cache_loc, torch.tensor([3, 4, 5, 6] + [0] * 8))
    assert torch.equal(padded.custom_mask[:24], mask) and bool(padded.custom_mask[24:].all())
    assert padded.custom_mask.numel() == 24 + 1 + 49
    decode = AttnMetadata(AttnMode.DECODE, t32([0, 1]), t32([0, 2]), t32([5, 6]), torch.tensor([6]), None, True)
    padded = pad_to_bucket(decode, GraphBucket(3, 3))
    assert torch.equal(padded.qo_indptr, t32([0, 1, 2, 3])) and torch.equal(padded.kv_indices, t32([5, 6, 0, 0]))
    with pytest.raises(ValueError):
        pad_to_bucket(meta, GraphBucket(3, 5))  # 2 dummy requests need 2 spare rows
    with pytest.raises(ValueError):
        pad_to_bucket(padded, GraphBucket(2, 2))


# ---------------------------------------------------------------------------------------------------------
# a fake flashinfer: FlashInfer's documented semantics, executed densely


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


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def fake_backend(**kwargs) -> FlashInferAttnBackend:
    return FlashInferAttnBackend(8, 2, 16, torch.bfloat16, "cpu", workspace_bytes=64, **kwargs)


MODES = ["extend", "decode", "draft_decode", "draft_extend", "verify"]


@pytest.mark.parametrize("name", MODES)
def test_fake_flashinfer_backend_matches_torch_backend(fake_flashinfer, name):
    _, k, v, metas = scenario()
    meta = metas[name]
    backend = fake_backend()
    q = torch.randn(meta.num_tokens, 8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plan = backend.plan(meta)
    out = backend.run(plan, q, k, v, 0.3)  # 0.3 != 16 ** -0.5: the q_scale path
    torch.testing.assert_close(out.float(), reference(meta, q, k, v, 0.3), atol=2e-2, rtol=2e-2)
    decode = meta.mode in (AttnMode.DECODE, AttnMode.DRAFT_DECODE)
    assert isinstance(plan.wrapper, FakeDecodeWrapper if decode else FakePrefillWrapper)
    assert plan.out_cache_loc is meta.out_cache_loc and not plan.wrapper.use_cuda_graph
    if decode:
        assert plan.wrapper.use_tensor_cores  # GQA group 8 / 2 = 4
    else:
        assert plan.wrapper.backend == ("fa2" if name == "draft_extend" else "auto")


@pytest.mark.parametrize("graph", [False, True])
def test_draft_steps_planned_up_front_keep_their_own_wrappers(fake_flashinfer, graph):
    table, k, v, _ = scenario()
    rows, seq = torch.tensor([0, 1, 2]), torch.tensor([5, 3, 7])
    backend = fake_backend(graph_limits=GraphLimits(8, 8, 32) if graph else None)
    bucket = GraphBucket(8, 8) if graph else None
    metas = [draft_decode_metadata(table, rows, seq, topk=2, num_steps=3, step=s) for s in range(2)]
    plans = [backend.plan(meta, step=s, graph=bucket) for s, meta in enumerate(metas)]  # plan both, then run
    assert plans[0].wrapper is not plans[1].wrapper and plans[0].key != plans[1].key
    for meta, plan in zip(metas, plans):
        q = torch.randn(8 if graph else 6, 8, 16).to(torch.bfloat16)
        out = backend.run(plan, q, k, v, 0.25)[:6]
        torch.testing.assert_close(out.float(), reference(meta, q[:6], k, v, 0.25), atol=2e-2, rtol=2e-2)


def test_graph_mode_verify_pads_and_replans_the_same_buffers(fake_flashinfer):
    backend = fake_backend(graph_limits=GraphLimits(4, 16, 32))
    bucket = GraphBucket(4, 16)  # 4 requests x N = 4 tree tokens
    plans = []
    for rows, seq, seed in (((0, 1, 2), (5, 3, 7), 0), ((3, 1), (9, 2), 1)):
        _, k, v, metas = scenario(rows=rows, seq=seq, seed=seed)
        meta = metas["verify"]
        plan = backend.plan(meta, graph=bucket)
        real = meta.num_tokens
        assert torch.equal(plan.out_cache_loc[:real], meta.out_cache_loc)
        assert bool((plan.out_cache_loc[real:] == 0).all())  # padded rows write the dummy slot
        q = torch.randn(16, 8, 16).to(torch.bfloat16)
        out = backend.run(plan, q, k, v, 0.25)[:real]
        torch.testing.assert_close(out.float(), reference(meta, q[:real], k, v, 0.25), atol=2e-2, rtol=2e-2)
        plans.append(plan)
    assert plans[0].wrapper is plans[1].wrapper
    assert plans[0].out_cache_loc.data_ptr() == plans[1].out_cache_loc.data_ptr()  # what the graph reads
    first = plans[0].wrapper.plans[0]  # the capture-shape plan: 4 dummy requests covering all 16 rows
    assert torch.equal(first["qo_indptr"], t32([0, 1, 2, 3, 16])) and first["masked"]
    assert [p["rows"] for p in plans[0].wrapper.plans] == [16, 16, 16]
    with pytest.raises(ValueError):
        backend.plan(scenario()[3]["decode"], graph=GraphBucket(4, 8))  # a decode bucket has one row per request
    with pytest.raises(ValueError):
        fake_backend().plan(scenario()[3]["verify"], graph=bucket)  # no graph_limits


def test_make_backend_and_constructor_errors(fake_flashinfer, monkeypatch):
    assert isinstance(make_backend("torch"), TorchAttnBackend)
    with pytest.raises(FastspecError, match="flashinfer needs a CUDA device"):
        make_backend("flashinfer", num_qo_heads=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(FastspecError, match="unknown attention backend"):
        make_backend("triton")
    with pytest.raises(FastspecError, match="float16 or bfloat16"):
        FlashInferAttnBackend(8, 2, 16, torch.float32, "cpu", workspace_bytes=64)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(FastspecError, match="flashinfer is not importable"):
        fake_backend()


# ---------------------------------------------------------------------------------------------------------
# kernel dispatch


def random_eagle_round(bs=3, topk=2, num_steps=3, n=6, vocab=11, seed=0, device="cpu"):
    """A real drafting round's select/organize outputs with random draft distributions."""
    gen = torch.Generator().manual_seed(seed)
    hidden, scores = torch.zeros(bs, 1), None
    score_list, token_list, parents_list = [], [], []
    for step in range(num_steps):
        rows = bs if step == 0 else bs * topk
        probs = torch.rand(rows, vocab, generator=gen).softmax(-1)
        topk_p, topk_index = probs.topk(topk, -1)
        sel = select_top_k(step, topk_p, topk_index, hidden, scores, topk)
        score_list.append(sel.score_entry), token_list.append(sel.token_entry), parents_list.append(sel.parent_entry)
        hidden, scores = sel.hidden, sel.scores
    parent_list, selected, tokens = organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return (*to(parent_list, selected, tokens, seq_lens), topk, num_steps, n)


def build_tree(op, parent_list, selected, seq_lens, topk, steps, n, mode=TreeMaskMode.FULL_MASK):
    bs, dev = seq_lens.numel(), seq_lens.device
    if mode == TreeMaskMode.FULL_MASK:
        mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool, device=dev)
    elif mode == TreeMaskMode.QLEN_ONLY:
        mask = torch.zeros(bs * n * n, dtype=torch.bool, device=dev)
    else:
        mask = torch.zeros(bs * n, dtype=torch.uint8, device=dev)  # N <= 8: one byte per row
    positions = torch.empty(bs * n, dtype=torch.int64, device=dev)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.int64, device=dev)
    op(parent_list, selected, seq_lens, mask, positions, *retrieve, topk, steps, n, int(mode))
    return mask, positions, retrieve


def verify_inputs(retrieve, n, steps, vocab, seed, device):
    gen = torch.Generator().manual_seed(seed)
    bs = retrieve.shape[1]
    candidates = torch.randint(0, 4, (bs, n), generator=gen).to(device)
    target = (torch.randn(bs, n, vocab, generator=gen) * 3).softmax(-1).to(device)
    out = lambda: (torch.zeros(bs * n, dtype=I32, device=device),  # noqa: E731
                   torch.full((bs, steps + 1), -1, dtype=I32, device=device), torch.zeros(bs, dtype=I32, device=device))
    u = torch.rand(bs, n, generator=gen).to(device), torch.rand(bs, generator=gen).to(device)
    return candidates, target, out, u


def run_all_ops(ops, device="cpu", seed=0):
    """Every dispatched op on one random round; returns all outputs (for comparing two op sets)."""
    parent_list, selected, _, seq_lens, topk, steps, n = random_eagle_round(seed=seed, device=device)
    outs = [build_tree(ops.build_tree_kernel_efficient, parent_list, selected, seq_lens, topk, steps, n, mode)
            for mode in TreeMaskMode]
    _, _, retrieve = outs[0]
    qlen = outs[1][0]
    rec = [torch.empty_like(outs[0][1]), *torch.full_like(retrieve, -1)]
    ops.reconstruct_indices_from_tree_mask(qlen, seq_lens, *rec, seq_lens.numel(), n)
    candidates, target, out, (u, u_final) = verify_inputs(retrieve, n, steps, 7, seed, device)
    greedy = out()
    ops.verify_tree_greedy(*greedy, candidates, *retrieve, target.argmax(-1))
    sampled = out()
    ops.tree_speculative_sampling_target_only(*sampled, candidates, *retrieve, u, u_final, target,
                                              torch.zeros_like(target), 1.0, 1.0, True)
    probs = target.view(-1, 7)
    renorm = [ops.top_k_renorm_prob(probs, 3), ops.top_p_renorm_prob(probs, 0.7)]
    return [t for group in (*outs, rec, greedy, sampled, renorm) for t in group]


TWINS = types.SimpleNamespace(
    build_tree_kernel_efficient=tree_twins.build_tree_kernel_efficient,
    reconstruct_indices_from_tree_mask=tree_twins.reconstruct_indices_from_tree_mask,
    verify_tree_greedy=verify_twins.verify_tree_greedy,
    tree_speculative_sampling_target_only=verify_twins.tree_speculative_sampling_target_only,
    top_k_renorm_prob=sampling_twins.top_k_renorm_prob, top_p_renorm_prob=sampling_twins.top_p_renorm_prob)


def test_dispatch_falls_back_to_the_twins_on_cpu(monkeypatch):
    def no_import():
        raise AssertionError("sgl_kernel must not be imported for CPU tensors")

    monkeypatch.setattr(dispatch, "_sgl_kernel", no_import)
    for seed in range(3):
        for got, want in zip(run_all_ops(dispatch, seed=seed), run_all_ops(TWINS, seed=seed)):
            assert torch.equal(got, want)
    assert dispatch.kernels_backend("cpu") == "torch"
    import fastspec.kernels as kernels

    assert kernels.verify_tree_greedy is dispatch.verify_tree_greedy


def new_style_sampling(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
                       retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                       threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """sgl-kernel after SGLang PR #28581: no draft_probs argument (allocated inside)."""
    assert isinstance(threshold_single, float) and isinstance(deterministic, bool)
    verify_twins.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
        retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        torch.zeros_like(target_probs), threshold_single, threshold_acc, deterministic)


@pytest.mark.parametrize("sampling_op", [verify_twins.tree_speculative_sampling_target_only, new_style_sampling])
def test_dispatch_calls_sgl_kernel_positionally(monkeypatch, sampling_op):
    calls = []

    def recording(fn):
        def op(*args, **kwargs):
            assert not kwargs, "sgl_kernel must be called positionally"
            calls.append((fn.__name__, len(args)))
            return fn(*args)
        op.__signature__ = inspect.signature(fn)
        return op

    fakes = {name: recording(getattr(TWINS, name)) for name in vars(TWINS)}
    fakes["tree_speculative_sampling_target_only"] = recording(sampling_op)
    monkeypatch.setattr(dispatch, "_kernel", lambda name, tensor: fakes[name])
    for got, want in zip(run_all_ops(dispatch), run_all_ops(TWINS)):
        assert torch.equal(got, want)
    arity = dict(calls)
    assert arity["build_tree_kernel_efficient"] == 12 and arity["verify_tree_greedy"] == 8
    assert arity["reconstruct_indices_from_tree_mask"] == 8 and arity["top_k_renorm_prob"] == 2
    assert arity[sampling_op.__name__] == (14 if sampling_op is not new_style_sampling else 13)


# ---------------------------------------------------------------------------------------------------------
# GPU: the real flashinfer and sgl_kernel


@gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])  # tensor-core decode and plain decode
@pytest.mark.parametrize("name", MODES)
def test_flashinfer_matches_torch_backend(name, heads):
    pytest.importorskip("flashinfer")
    hq, hkv = heads
    _, k, v, metas = scenario("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(k.shape[0], hkv, 64, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(k.shape[0], hkv, 64, device="cuda", generator=gen).to(torch.bfloat16)
    meta = metas[name]
    backend = make_backend("flashinfer", num_qo_heads=hq, num_kv_heads=hkv, head_dim=64, dtype=torch.bfloat16,
                           device="cuda")
    q = torch.randn(meta.num_tokens, hq, 64, device="cuda", generator=gen).to(torch.bfloat16)
    out = backend.run(backend.plan(meta), q, k, v, 0.125)
    torch.testing.assert_close(out.float(), reference(meta, q, k, v, 0.125), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("name,bucket", [("verify", GraphBucket(4, 16)), ("draft_decode", GraphBucket(8, 8))])
def test_flashinfer_graph_capture_and_replay(name, bucket):
    pytest.importorskip("flashinfer")
    backend = make_backend("flashinfer", num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                           device="cuda", graph_limits=GraphLimits(8, 16, 32))
    _, k, v, metas = scenario("cuda", rows=(0, 1, 2), seq=(5, 3, 7))
    k = torch.randn(k.shape[0], 2, 64, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    q_static = torch.zeros(bucket.num_tokens, 8, 64, device="cuda", dtype=torch.bfloat16)
    plan = backend.plan(metas[name], graph=bucket)
    backend.run(plan, q_static, k, v, 0.125)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.run(plan, q_static, k, v, 0.125)
    for rows, seq in (((0, 1, 2), (5, 3, 7)), ((3, 1), (9, 2))):
        meta = scenario("cuda", rows=rows, seq=seq)[3][name]
        replanned = backend.plan(meta, graph=bucket)
        assert replanned.wrapper is plan.wrapper
        q = torch.randn(meta.num_tokens, 8, 64, device="cuda").to(torch.bfloat16)
        q_static[: meta.num_tokens].copy_(q)
        graph.replay()
        torch.testing.assert_close(out_static[: meta.num_tokens].float(), reference(meta, q, k, v, 0.125),
                                   atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("seed", range(5))
def test_sgl_kernel_matches_twins_on_random_eagle_trees(seed):
    pytest.importorskip("sgl_kernel")
    assert dispatch.kernels_backend("cuda") == "sgl_kernel"
    for got, want in zip(run_all_ops(dispatch, "cuda", seed), run_all_ops(TWINS, "cuda", seed)):
        if got.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(got, want)
