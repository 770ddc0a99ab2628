"""GraphRunner: compiled / eager / CUDA-graph runs of a toy draft-loop-like function vs direct calls.

The oracle is always the toy function called directly on the real (unpadded) rows with its own copy of the
pool. Compilation is slow on CPU, so one compiled runner (buckets 1, 4) is shared by the whole module. The bucket
functions: test_graph_buckets.py; what cannot be a graph, and a malformed runner: test_graph_misuse.py.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.errors import FastspecError
from fastspec.graphs import GraphRunner, StaticInput, configure_compile_caches

D, SLOTS, STEPS, K = 8, 40, 2, 4  # hidden size, pool slots (slot 0 = dummy), draft steps, slots read per request
BUCKETS = [1, 4]  # exact runs at 1 and 4, padded runs 2 -> 4 and 3 -> 4 (each bucket costs ~10 s cold)
INPUTS = [StaticInput("hidden", (D,), torch.float32),
          StaticInput("read_slots", (K,), torch.int64),
          StaticInput("write_slots", (), torch.int64, rows_per_request=STEPS),
          StaticInput("positions", (), torch.int64, pad_value=7)]


def make_toy(pool):  # pool [SLOTS, D], read and written by closure like a KV pool
    """A fixed-count step loop: gather from the pool, softmax/topk, scatter the new state into the pool."""
    def toy(inp):
        h = inp["hidden"]  # [bs, D]
        bs = h.shape[0]
        write = inp["write_slots"].view(bs, STEPS)  # [bs, STEPS]
        tokens = []
        for step in range(STEPS):
            ctx = pool.index_select(0, inp["read_slots"].flatten()).view(bs, K, D)  # re-read: sees earlier writes
            p = torch.softmax(torch.einsum("bd,bkd->bk", h, ctx), dim=-1)  # [bs, K]
            top_p, top_i = p.topk(2, dim=-1)  # [bs, 2]
            best = torch.gather(ctx, 1, top_i[:, :1, None].expand(bs, 1, D)).squeeze(1)  # [bs, D]
            inp["positions"].add_(1)  # in-place input update, like the draft loop's positions
            h = torch.tanh(h + best * top_p[:, :1] + inp["positions"][:, None] * 0.01)
            pool.index_copy_(0, write[:, step], h)
            tokens.append(top_i)
        return {"hidden": h, "tokens": torch.stack(tokens, 1).flatten(0, 1),  # [bs*STEPS, 2]
                "cum": torch.cumsum(p, dim=-1), "positions": inp["positions"] * 1}
    return toy


def make_inputs(bs, seed):
    """Real rows only: distinct write slots >= 1, reads from slots >= 1 (overlapping the writes)."""
    gen = torch.Generator().manual_seed(seed)
    return {"hidden": torch.randn(bs, D, generator=gen),
            "read_slots": torch.randint(1, SLOTS, (bs, K), generator=gen),
            "write_slots": torch.randperm(SLOTS - 1, generator=gen)[: bs * STEPS] + 1,
            "positions": torch.randint(0, 100, (bs,), generator=gen)}


def reference(pool0, inputs):
    """The toy called directly on the real rows with a private pool: (outputs, final pool)."""
    pool = pool0.clone()
    inputs = {k: v.clone() for k, v in inputs.items()}
    return make_toy(pool)(inputs), pool


def assert_outputs_equal(out, ref, bs):
    assert out.keys() == ref.keys()
    for key in ref:
        assert out[key].shape == ref[key].shape and out[key].shape[0] % bs == 0, key
        torch.testing.assert_close(out[key], ref[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.fixture(scope="module")
def pool0():
    return torch.randn(SLOTS, D, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def compiled(pool0):
    """(runner, its pool, on_bucket calls, dynamo graphs compiled by prepare) for the compile backend."""
    from torch._dynamo.utils import counters

    pool = pool0.clone()
    calls = []
    runner = GraphRunner("toy", make_toy(pool), INPUTS, BUCKETS, "compile")
    before = counters["stats"]["unique_graphs"]
    runner.prepare(on_bucket=lambda name, bs: calls.append((name, bs)))
    return runner, pool, calls, counters["stats"]["unique_graphs"] - before


# ---- a runner's buckets (the bucket functions: test_graph_buckets.py) ----

def test_runner_bucket_for_pads_to_next_and_errors_past_max(compiled):
    runner = compiled[0]
    assert [runner.bucket_for(bs) for bs in (1, 2, 3, 4)] == [1, 4, 4, 4]
    with pytest.raises(FastspecError, match="exceeds"):
        runner.bucket_for(5)
    with pytest.raises(FastspecError):
        runner.bucket_for(0)


# ---- compiled backend vs the direct call ----

def test_prepare_visits_buckets_largest_first(compiled):
    _, _, calls, graphs = compiled
    assert calls == [("toy", 4), ("toy", 1)]
    assert graphs == len(BUCKETS)  # one compiled graph per bucket, all built inside prepare()


def test_compiled_equals_direct_call_every_bucket_and_padded(compiled, pool0):
    from torch._dynamo.utils import counters

    runner, pool, _, _ = compiled
    graphs_before = counters["stats"]["unique_graphs"]
    for bs, seed in [(4, 1), (3, 2), (1, 3), (2, 4), (3, 5)]:  # after bs=4, bs=3 and 2 must re-pad stale rows
        pool.copy_(pool0)
        inputs = make_inputs(bs, seed)
        out = runner.run(bs, inputs)
        ref, ref_pool = reference(pool0, inputs)
        assert_outputs_equal(out, ref, bs)
        assert out["tokens"].shape == (bs * STEPS, 2)
        # real slots match the direct call; padded rows (bs=3 in bucket 4) wrote only dummy slot 0
        torch.testing.assert_close(pool[1:], ref_pool[1:], atol=1e-5, rtol=1e-5)
        assert not torch.equal(pool[1:], pool0[1:])
    assert counters["stats"]["unique_graphs"] == graphs_before  # run() never compiles


def test_padded_rows_hit_only_the_dummy_slot(compiled, pool0):
    runner, pool, _, _ = compiled
    pool.copy_(pool0)
    runner.run(3, make_inputs(3, 9))
    assert not torch.equal(pool[0], pool0[0])  # the padded 4th row really ran and wrote slot 0
    assert torch.equal(runner.buffers["write_slots"][3 * STEPS: 4 * STEPS], torch.zeros(STEPS, dtype=torch.int64))
    assert torch.equal(runner.buffers["read_slots"][3], torch.zeros(K, dtype=torch.int64))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(bs=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_compiled_equals_direct_call_property(compiled, pool0, bs, seed):
    runner, pool, _, _ = compiled
    pool.copy_(pool0)
    inputs = make_inputs(bs, seed)
    out = runner.run(bs, inputs)
    ref, ref_pool = reference(pool0, inputs)
    assert_outputs_equal(out, ref, bs)
    torch.testing.assert_close(pool[1:], ref_pool[1:], atol=1e-5, rtol=1e-5)


def test_eager_backend_equals_direct_call(pool0):
    pool = pool0.clone()
    runner = GraphRunner("toy", make_toy(pool), INPUTS, [2, 4, 8], "eager")
    runner.prepare(on_bucket=lambda *a: pytest.fail("eager has nothing to prepare"))
    inputs = make_inputs(5, 11)  # padded to bucket 8
    ref, ref_pool = reference(pool0, inputs)
    assert_outputs_equal(runner.run(5, inputs), ref, 5)
    torch.testing.assert_close(pool[1:], ref_pool[1:])
    assert torch.equal(inputs["positions"], make_inputs(5, 11)["positions"])  # caller's tensors untouched


# ---- a run's inputs checked (refusing what cannot be a graph: test_graph_misuse.py); the compile caches ----

def test_run_checks_inputs_and_outputs(compiled):
    runner = compiled[0]
    good = make_inputs(2, 0)
    with pytest.raises(FastspecError, match="input 'hidden' has shape"):
        runner.run(2, good | {"hidden": torch.zeros(3, D)})
    with pytest.raises(FastspecError, match="takes inputs"):
        runner.run(2, {k: v for k, v in good.items() if k != "positions"})
    not_per_request = GraphRunner("vocab", lambda inp: {"y": torch.zeros(5)}, INPUTS[:1], [4], "eager")
    with pytest.raises(FastspecError, match="output 'y' of shape \\(5,\\) is not per-request"):
        not_per_request.run(3, {"hidden": torch.zeros(3, D)})


def test_compile_caches_point_at_fastspec_cache(monkeypatch, tmp_path):
    import torch._dynamo.config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    for before, after in [(None, tmp_path / "inductor"),  # unset -> ours
                          (default_cache_dir(), tmp_path / "inductor"),  # torch's own default -> ours
                          ("/somewhere/explicit", "/somewhere/explicit")]:  # the user's choice wins
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(before))
        configure_compile_caches()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(after)
    assert torch._dynamo.config.recompile_limit >= 1024


# ---- CUDA graphs (skipped without a GPU) ----

@pytest.mark.parametrize("bs", [1, 3, 4, 7, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replay_equals_direct_call(bs, cuda_runner):
    runner, pool, pool0 = cuda_runner
    pool.copy_(pool0)
    inputs = {k: v.cuda() for k, v in make_inputs(bs, bs).items()}
    out = {k: v.clone() for k, v in runner.run(bs, inputs).items()}
    ref, ref_pool = reference(pool0, inputs)
    assert_outputs_equal(out, ref, bs)
    torch.testing.assert_close(pool[1:], ref_pool[1:], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_pool_and_outputs_overwritten_by_next_replay(cuda_runner):
    runner, _, _ = cuda_runner
    assert runner.pool is not None and sorted(runner._graphs) == [1, 2, 4, 8]
    assert {g.pool() for g in runner._graphs.values()} == {runner.pool}
    first = runner.run(2, {k: v.cuda() for k, v in make_inputs(2, 1).items()})["hidden"]
    kept = first.clone()
    second = runner.run(2, {k: v.cuda() for k, v in make_inputs(2, 2).items()})["hidden"]
    assert first.data_ptr() == second.data_ptr() and torch.equal(first, second) and not torch.equal(first, kept)


@pytest.fixture(scope="module")
def cuda_runner():
    pool0 = torch.randn(SLOTS, D, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pool = pool0.clone()
    runner = GraphRunner("toy", make_toy(pool), INPUTS, [1, 2, 4, 8], "cuda", device="cuda")
    calls = []
    runner.prepare(on_bucket=lambda name, bs: calls.append(bs))
    assert calls == [8, 4, 2, 1]
    return runner, pool, pool0


def test_profile_categories_of_kernel_and_operator_names():
    from fastspec.benchmark.profile import category

    names = {"sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
             "aten::addmm": "gemm", "_paged_attention_partial": "attention", "_paged_attention_combine": "attention",
             "fastspec::paged_attention": "attention", "triton_red_fused_add_mean_mul_pow_rsqrt_3": "norm/elementwise",
             "triton_poi_fused_mul_silu_1": "norm/elementwise", "aten::copy_": "copies",
             "triton_poi_fused__to_copy_cos_index_put_mul_sin_2": "norm/elementwise", "Memcpy DtoD (Device -> Device)": "copies",
             "Memset (Device)": "copies", "triton_red_fused_argmax_4": "sampling", "aten::softmax": "sampling",
             "aten::_weight_int4pack_mm_for_cpu": "gemm", "aten::_weight_int8pack_mm": "gemm",
             "cudaLaunchKernel": "other"}
    assert {name: category(name) for name in names} == names
