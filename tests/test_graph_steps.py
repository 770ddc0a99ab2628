"""The round functions as static graphs (issue: CUDA-graph-first). On CPU the proof that they are graph-safe
is a fullgraph torch.compile (with GraphRunner's host-sync check) that succeeds for two buckets; compiled
outputs must equal eager, padding must not disturb real KV, and decoding stays lossless.

Compiling is slow (Inductor, ~10 s a graph cold), so one compiled engine is shared by the whole module.
"""

import pytest
import torch
from conftest import all_slots_free
from test_speculative import PROMPTS, reference

from fastspec.config import EngineConfig
from fastspec.engine.engine import Engine
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecConfig
from fastspec.speculative.steps import TREE_FIELDS, draft_extend, draft_loop

BUCKETS = (1, 4)


@pytest.fixture(scope="module")
def compiled(tiny_dirs, draft_dirs):
    prepared = []
    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model=str(draft_dirs["llama"]["eagle3"]),
                              num_steps=3, topk=2, num_draft_tokens=5)
    config = EngineConfig(model=str(tiny_dirs["llama"][0]), max_total_tokens=4096, graphs="compile",
                          cuda_graph_bs=BUCKETS, max_running_requests=4)
    engine = Engine(config, spec, on_prepare=lambda name, bs: prepared.append((name, bs)))
    return engine, prepared


def test_graphs_compile_fullgraph_for_two_buckets_and_stay_lossless(compiled, tiny_dirs):
    engine, prepared = compiled
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outputs = engine.generate(PROMPTS[:4], [params] * 4)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS[:4], params)
    names = {name.split(" (")[0] for name, _ in prepared}
    assert names == {"draft loop", "draft extend", "verify", "decode"}  # decode: plain rounds, graphed too
    for name in names:  # every graph compiled for both buckets, largest first
        assert [bs for n, bs in prepared if n.startswith(name)][:2] == [4, 1]


def test_requests_joining_and_leaving_move_between_buckets(compiled, tiny_dirs):
    """4 requests finishing at different lengths: the batch shrinks 4 -> 3 (padded into 4) -> 2 -> 1."""
    engine, _ = compiled
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 7, 11, 15)]
    outputs = engine.generate(PROMPTS[:4], params)
    for out, p, prompt in zip(outputs, params, PROMPTS):
        assert out.output_ids == reference(tiny_dirs, "llama", 1, [prompt], p)[0]
    assert all_slots_free(engine)


def test_compiled_draft_loop_equals_eager_and_padding_leaves_real_kv_alone(compiled):
    """bs=3 runs in bucket 4: the compiled loop's outputs equal the eager function's, and the only draft KV
    slots it writes are the real rows' scratch slots and dummy slot 0."""
    engine, _ = compiled
    drafter = engine.drafter
    seen = {}
    real_call = type(drafter.loop_graphs).__call__

    def spy(graphs, bs, x):
        if graphs is drafter.loop_graphs and bs == 3 and "x" not in seen:
            seen["x"] = {k: v.clone() for k, v in x.items()}
            seen["pool_before"] = (drafter.pool.k.clone(), drafter.pool.v.clone())
            out = real_call(graphs, bs, x)
            seen["pool_after"] = (drafter.pool.k.clone(), drafter.pool.v.clone())
            seen["out"] = out
            return out
        return real_call(graphs, bs, x)

    type(drafter.loop_graphs).__call__ = spy
    try:
        engine.generate(PROMPTS[4:7], [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3)
    finally:
        type(drafter.loop_graphs).__call__ = real_call
    assert seen, "no 3-request draft round happened"
    assert drafter.loop_graphs.runner.bucket_for(3) == 4
    changed = (seen["pool_after"][0] != seen["pool_before"][0]).any(-1).any(-1).any(0)  # [slots]
    allowed = torch.zeros_like(changed)
    allowed[seen["x"]["scratch"].flatten()] = True
    allowed[0] = True
    assert not (changed & ~allowed).any()
    # the same inputs through the plain function give the same tree
    pool = drafter.pool
    pool.k.copy_(seen["pool_before"][0]), pool.v.copy_(seen["pool_before"][1])
    eager = draft_loop(drafter.model, drafter.hot_token_id, pool, drafter.table.table, drafter.topk, drafter.num_steps,
                       drafter.num_draft_tokens, seen["x"])
    for key in TREE_FIELDS:
        assert torch.equal(eager[key], seen["out"][key]), key


class EveryOther:
    """A scripted fallback policy: plain and speculative rounds alternate."""

    def __init__(self):
        self.n = 0

    def speculate(self, bs, context=0):
        self.n += 1
        return self.n % 2 == 0

    def record(self, *args):
        pass


def test_plain_rounds_run_the_compiled_decode_graph_and_stay_lossless(compiled, tiny_dirs):
    engine, _ = compiled
    calls = []
    real_call = type(engine.worker.decode_graphs).__call__

    def spy(graphs, bs, x):
        if graphs is engine.worker.decode_graphs:
            calls.append(bs)
        return real_call(graphs, bs, x)

    engine.policy, params = EveryOther(), SamplingParams(max_new_tokens=13, ignore_eos=True)
    type(engine.worker.decode_graphs).__call__ = spy
    try:
        outputs = engine.generate(PROMPTS[:3], [params] * 3)
    finally:
        type(engine.worker.decode_graphs).__call__ = real_call
        engine.policy = None
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS[:3], params)
    assert 3 in calls and all(o.metrics.verify_rounds for o in outputs)  # both kinds of round ran
    assert all_slots_free(engine)


def test_compiled_draft_extend_equals_eager(compiled):
    engine, _ = compiled
    drafter = engine.drafter
    seen = {}
    real_call = type(drafter.extend_graphs).__call__

    def spy(graphs, bs, x):
        out = real_call(graphs, bs, x)
        if graphs is drafter.extend_graphs and "x" not in seen:
            seen.update(x={k: v.clone() for k, v in x.items()}, out=out)
        return out

    type(drafter.extend_graphs).__call__ = spy
    try:
        engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=5, ignore_eos=True)] * 2)
    finally:
        type(drafter.extend_graphs).__call__ = real_call
    eager = draft_extend(drafter.model, drafter.hot_token_id, drafter.pool, drafter.table.table, drafter.topk,
                         seen["x"])
    assert torch.equal(eager["topk_index"], seen["out"]["topk_index"])
    torch.testing.assert_close(eager["topk_p"], seen["out"]["topk_p"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(eager["hidden"], seen["out"]["hidden"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm, draft, steps, topk, n, page_size", [
    ("STANDALONE", "self", 4, 1, 5, 16),
    ("EAGLE", "eagle", 3, 4, 8, 1),
    ("NONE", None, None, None, None, 16),  # plain decoding through the decode graph
])
def test_reduced_lossless_matrix_with_compiled_graphs(tiny_dirs, draft_dirs, algorithm, draft, steps, topk, n,
                                                      page_size):
    directory = str(tiny_dirs["qwen2"][0])
    draft_path = directory if draft == "self" else (str(draft_dirs["qwen2"][draft]) if draft else None)
    spec = SpecConfig.resolve(algorithm, "Qwen2ForCausalLM", draft_model=draft_path, num_steps=steps, topk=topk,
                              num_draft_tokens=n)
    engine = Engine(EngineConfig(model=directory, max_total_tokens=4096, page_size=page_size, graphs="compile",
                                 cuda_graph_bs=(4,), max_running_requests=4), spec)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    outputs = engine.generate(PROMPTS[:4], [params] * 4)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "qwen2", page_size, PROMPTS[:4], params)
    assert all_slots_free(engine)


@pytest.mark.gpu
def test_cuda_graph_round_equals_eager(tiny_dirs, draft_dirs):
    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model=str(draft_dirs["llama"]["eagle3"]),
                              num_steps=3, topk=2, num_draft_tokens=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for mode in ("eager", "cuda"):
        engine = Engine(EngineConfig(model=str(tiny_dirs["llama"][0]), device="cuda", dtype="float32",
                                     max_total_tokens=4096, graphs=mode, cuda_graph_bs=(1, 2, 4),
                                     max_running_requests=4), spec)
        outs[mode] = [o.output_ids for o in engine.generate(PROMPTS[:3], [params] * 3)]
    assert outs["eager"] == outs["cuda"]


def test_a_failed_compile_falls_back_to_eager_kernels_with_one_warning_line(tiny_dirs, draft_dirs, monkeypatch,
                                                                            caplog):
    """A round function whose compile fails (injected: the backend raises, as torch 2.11's dynamo did on an IntEnum)
    runs its eager kernels: the engine lives, stays lossless, and says once per graph and bucket what failed."""
    import fastspec.graphs.runner as runner_module

    def broken_backend(gm, example_inputs):
        raise RuntimeError("injected compile failure\nsecond line not shown")

    monkeypatch.setenv("FASTSPEC_GRAPH_FALLBACK", "1")
    monkeypatch.setattr(runner_module, "inductor_without_host_sync", broken_backend)
    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model=str(draft_dirs["llama"]["eagle3"]),
                              num_steps=3, topk=2, num_draft_tokens=5)
    config = EngineConfig(model=str(tiny_dirs["llama"][0]), max_total_tokens=2048, graphs="compile",
                          max_running_requests=2)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with caplog.at_level("WARNING", logger="fastspec.graphs.runner"):
        outputs = Engine(config, spec).generate(PROMPTS[:2], [params] * 2)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS[:2], params)
    lines = [r.getMessage() for r in caplog.records]
    assert {line.split(":")[0] for line in lines} >= {f"graph '{name}', batch bucket 2"
                                                      for name in ("draft loop", "draft extend", "verify")}
    assert all("compiling failed (RuntimeError: injected compile failure); using its eager kernels instead" in line
               and "\n" not in line for line in lines)
    assert len(lines) == len(set(lines))  # once per graph and bucket, not per run
