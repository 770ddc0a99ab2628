"""A growing KV pool (CPU, no --max-total-tokens): it starts small and doubles between steps up to its ceiling (a
fraction of the memory available at start). Greedy output must equal a large static pool's token for token, for
plain and speculative decoding, with and without the overlap schedule and the prefix cache, several requests at
once and compiled graphs; every slot comes back; at the ceiling it preempts as a static pool of that size does;
with --max-total-tokens it never grows."""

import pytest
from conftest import all_slots_free
from test_speculative import PROMPTS

import fastspec
import fastspec.engine.pools as memory_module
import fastspec.engine.worker as worker_module
import fastspec.memory.kv_pool as kv_pool_module
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

INITIAL = 16  # tokens a growing pool starts with here (whole pages): every case below grows several times
LARGE = 4096  # the ceiling, and the static pool the outputs are compared with


def make(tiny_dirs, draft_dirs, algorithm, draft, page_size, **extra):
    family = "llama"
    draft_path = str(tiny_dirs[family][0]) if draft == "self" else str(draft_dirs[family][draft]) if draft else None
    steps, topk, n = (3, 2, 5) if draft else (None, None, None)
    return fastspec.LLM(str(tiny_dirs[family][0]), speculative_algorithm=algorithm, draft_model=draft_path,
                        num_steps=steps, topk=topk, num_draft_tokens=n, page_size=page_size, **extra)


def growing(monkeypatch, build, static, ceiling: int):
    """build(kv_mem_fraction=1.0): a growing pool with `static`'s settings, starting at INITIAL tokens, whose ceiling
    (all the memory there is) is `ceiling` tokens."""
    page = static.engine.config.page_size
    per_token = sum(t[:, 0].numel() * t.element_size() for p in static.engine.worker.memory.pools
                    for t in (p.k, p.v) if t is not None)
    monkeypatch.setattr(memory_module, "INITIAL_KV_TOKENS", INITIAL)
    monkeypatch.setattr(kv_pool_module, "available_bytes", lambda device="cpu": (ceiling + page) * per_token)
    monkeypatch.setattr(worker_module, "check_weights_fit", lambda *args: None)  # (the memory after loading)
    llm = build(kv_mem_fraction=1.0)
    memory = llm.engine.worker.memory
    assert (memory.ceiling, memory.pool.capacity) == (ceiling, max(INITIAL, page))
    return llm


def params_for(prompts, new=21) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=new + 3 * i, ignore_eos=True) for i in range(len(prompts))]


# (algorithm, draft, page size, overlap, prefix cache)
CASES = [
    ("NONE", None, 1, "off", True),
    ("NONE", None, 16, "on", False),
    ("EAGLE3", "eagle3", 1, "off", True),
    ("EAGLE3", "eagle3", 16, "on", True),
    ("EAGLE", "eagle", 1, "on", False),
    ("STANDALONE", "self", 4, "off", False),  # (the target drafting for itself: long accepted runs)
]


@pytest.mark.parametrize("algorithm, draft, page_size, overlap, cache", CASES)
def test_a_growing_pool_decodes_as_a_large_static_one(monkeypatch, tiny_dirs, draft_dirs, algorithm, draft,
                                                      page_size, overlap, cache):
    def build(**pool):
        return make(tiny_dirs, draft_dirs, algorithm, draft, page_size, overlap_schedule=overlap,
                    radix_cache=cache, **pool)

    static = build(max_total_tokens=LARGE)
    params = params_for(PROMPTS)
    outputs = static.engine.generate(PROMPTS, params)
    expected, accepted = [o.output_ids for o in outputs], [o.metrics.accepted_tokens for o in outputs]
    assert draft != "self" or min(accepted) > 10
    llm = growing(monkeypatch, build, static, LARGE)
    for _ in range(2):  # the second time (prefix cache on): the first run's KV is cached in the grown pool
        outputs = llm.engine.generate(PROMPTS, params)
        assert [o.output_ids for o in outputs] == expected
        if not cache:  # the draft state survives growth (a STANDALONE draft's first-token keys too)
            assert [o.metrics.accepted_tokens for o in outputs] == accepted
        llm.engine.check_kv()
    memory = llm.engine.worker.memory
    assert 8 * INITIAL <= memory.pool.capacity <= memory.ceiling  # doubled at least three times
    for p in memory.pools:  # target and draft pools grow together, in step with the allocator
        assert p.num_slots == memory.pool.capacity + page_size + p.row_slots == p.k.shape[1]
        assert p.row_slots == (memory.table.table.shape[0] if p is memory.draft_pool and draft == "self" else 0)
    assert memory.allocator.capacity == memory.pool.capacity
    assert llm.engine.preemptions == 0
    assert all_slots_free(llm.engine)
    assert llm.engine.worker.available_kv() == LARGE  # free now + room to grow: what admission plans with


@pytest.mark.parametrize("page_size, overlap", [(1, "off"), (16, "on")])
def test_at_the_ceiling_it_preempts_as_a_static_pool_of_that_size(monkeypatch, tiny_dirs, draft_dirs, page_size,
                                                                   overlap):
    """More work than the ceiling holds: the pool grows to it, then preempts, re-prefills in chunks and evicts
    from the prefix cache exactly as a static pool of the ceiling's size does."""
    def build(**pool):
        return make(tiny_dirs, draft_dirs, "EAGLE3", "eagle3", page_size, chunked_prefill_size=7,
                    overlap_schedule=overlap, **pool)

    static = build(max_total_tokens=160)
    params = params_for(PROMPTS, new=10)
    expected = [o.output_ids for o in static.engine.generate(PROMPTS, params)]
    llm = growing(monkeypatch, build, static, 160)
    assert [o.output_ids for o in llm.engine.generate(PROMPTS, params)] == expected
    assert llm.engine.preemptions == static.engine.preemptions > 0
    assert llm.engine.pool.capacity == 160
    assert all_slots_free(llm.engine)


def test_admission_checks_the_ceiling_not_the_current_capacity(monkeypatch, tiny_dirs, draft_dirs):
    def build(**pool):
        return make(tiny_dirs, draft_dirs, "NONE", None, 1, **pool)

    llm = growing(monkeypatch, build, build(max_total_tokens=64), 64)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)  # more than the pool holds now, within the ceiling
    assert len(llm.engine.generate([PROMPTS[0]], [long])[0].output_ids) == 40
    with pytest.raises(FastspecError, match=r"^a request of 5 prompt \+ 60 new tokens does not fit in the KV pool "
                                            r"of 64 tokens \(it needs 66: a decode round's headroom; "
                                            r"raise max_total_tokens\)$"):
        llm.engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=60)])


def test_with_max_total_tokens_the_pool_never_grows(tiny_dirs, draft_dirs):
    llm = make(tiny_dirs, draft_dirs, "EAGLE3", "eagle3", 1, max_total_tokens=128, chunked_prefill_size=7)
    memory = llm.engine.worker.memory
    llm.engine.generate(PROMPTS, params_for(PROMPTS, new=10))
    assert memory.pool.capacity == memory.allocator.capacity == memory.ceiling == 128
    assert llm.engine.preemptions > 0


def test_a_compiled_engine_grows_without_compiling_again(monkeypatch, tiny_dirs, draft_dirs):
    """The pools' slot dim is symbolic in the compiled graphs (target verify, draft loop and extend): after the
    first request prepared them, a longer one grows both pools three times and compiles nothing."""
    from torch._dynamo.utils import counters

    prompt, long = PROMPTS[0], SamplingParams(max_new_tokens=120, ignore_eos=True)
    expected = make(tiny_dirs, draft_dirs, "NONE", None, 1, max_total_tokens=LARGE).engine.generate(
        [prompt], [long])[0].output_ids
    prepared = []
    monkeypatch.setattr(memory_module, "INITIAL_KV_TOKENS", INITIAL)
    llm = make(tiny_dirs, draft_dirs, "EAGLE3", "eagle3", 1, graphs="compile", cuda_graph_bs=(1,),
               max_running_requests=1, on_prepare=lambda name, bs: prepared.append(name))
    llm.engine.generate([prompt], [SamplingParams(max_new_tokens=2, ignore_eos=True)])
    names, graphs, capacity = list(prepared), counters["stats"]["unique_graphs"], llm.engine.pool.capacity
    assert "verify" in names
    assert llm.engine.generate([prompt], [long])[0].output_ids == expected
    assert llm.engine.pool.capacity >= 8 * capacity
    assert prepared == names and counters["stats"]["unique_graphs"] == graphs
    assert all_slots_free(llm.engine)
