"""The prefix cache in the engine: with it on, every output equals the output with it off, token for token, for
every algorithm, chains and trees, pages 1 and 16; requests that share a prefix reuse its KV (target and draft);
eviction under a small pool, preemption and chunked prefill keep working; after a flush every slot is free."""

import pytest
from test_speculative import PROMPTS

import fastspec
from fastspec.sampling import SamplingParams

SYSTEM = [5 + i % 90 for i in range(40)]  # a shared "system prompt"
SHARED = [SYSTEM + p for p in PROMPTS]

# (family, algorithm, draft, num_steps, topk, num_draft_tokens, page_size)
CASES = [
    ("llama", "NONE", None, None, None, None, 1),
    ("llama", "EAGLE", "eagle", 4, 2, 6, 1),
    ("qwen2", "EAGLE3", "eagle3", 3, 1, 4, 16),
    ("llama", "STANDALONE", "self", 3, 2, 6, 16),
    ("qwen3", "STANDALONE", "self", 4, 1, 5, 1),
    ("qwen3", "NGRAM", None, None, None, 6, 4),
]


def make(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, cache, **extra):
    directory = str(tiny_dirs[family][0])
    draft_path = directory if draft == "self" else (str(draft_dirs[family][draft]) if draft else None)
    extra = {"max_total_tokens": 4096, **extra}
    return fastspec.LLM(directory, speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                        topk=topk, num_draft_tokens=n, page_size=page_size, radix_cache=cache, **extra)


def all_free_after_flush(engine) -> bool:
    engine.check_kv()  # the cache's slots and the free ones partition the pool
    engine.flush_cache()
    return engine.allocator.num_free() == engine.pool.capacity


@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size", CASES)
def test_cache_on_equals_cache_off_and_reuses_shared_prefixes(tiny_dirs, draft_dirs, family, algorithm, draft,
                                                              steps, topk, n, page_size):
    params = [SamplingParams(max_new_tokens=8 + 2 * i, ignore_eos=True) for i in range(len(SHARED))]
    off = make(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, False,
               max_running_requests=3)
    on = make(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, True,
              max_running_requests=3)
    expected = off.engine.generate(SHARED, params)
    got = on.engine.generate(SHARED, params)  # later requests start on the prefix the first ones cached
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    aligned = lambda n: n - n % page_size  # noqa: E731
    first = on.engine.worker.reused_tokens  # each request admitted after the first three reuses SYSTEM
    assert first >= (len(SHARED) - 3) * (aligned(len(SYSTEM)) - page_size)
    again = on.engine.generate(SHARED, params)  # a second turn: whole prompts (and answers) are cached
    assert [o.output_ids for o in again] == [o.output_ids for o in expected]
    assert on.engine.worker.reused_tokens - first >= sum(aligned(len(p)) - page_size for p in SHARED)
    # (acceptance may differ: cached KV of an answer was computed by decode steps, not by a prefill, which is
    # not bitwise the same, and a draft can flip in a near-tie; the target's output may not, and does not)
    assert all_free_after_flush(on.engine)


def test_a_chat_turn_reuses_the_conversation_before_it(tiny_dirs, draft_dirs):
    """Turn 2's prompt is turn 1's prompt + answer + a new message: all of turn 1 is reused."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    on = make(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, True)
    off = make(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, False)
    turn = PROMPTS[1]
    for _ in range(3):
        answer = on.engine.generate([turn], [params])[0].output_ids
        assert answer == off.engine.generate([turn], [params])[0].output_ids
        before = on.engine.worker.reused_tokens
        turn = turn + answer + [40, 41, 42]
        on.engine.generate([turn], [SamplingParams(max_new_tokens=1, ignore_eos=True)])
        assert on.engine.worker.reused_tokens - before >= len(turn) - len(answer) - 5
    assert all_free_after_flush(on.engine)


@pytest.mark.parametrize("algorithm, draft, page_size, pool", [("NONE", None, 1, 96), ("STANDALONE", "self", 16, 256),
                                                               ("EAGLE3", "eagle3", 1, 160), ("NGRAM", None, 4, 160)])
def test_small_pool_evicts_preempts_and_stays_exact(tiny_dirs, draft_dirs, algorithm, draft, page_size, pool):
    """More work than the pool holds, shared prefixes, prompts prefilled a few tokens per step, some sampled."""
    steps, topk, n = (3, 2, 5) if draft else (None, None, 6 if algorithm == "NGRAM" else None)
    params = [SamplingParams(max_new_tokens=10 + 3 * i, ignore_eos=True,
                             **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 3 == 1 else {}))
              for i in range(len(SHARED))]
    off = make(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, page_size, False,
               max_total_tokens=pool, chunked_prefill_size=7, speculative_fallback=False)
    on = make(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, page_size, True,
              max_total_tokens=pool, chunked_prefill_size=7, speculative_fallback=False)
    expected = [o.output_ids for o in off.engine.generate(SHARED, params)]
    for _ in range(2):  # the second time, the cache is full of the first run's prefixes and must make room
        assert [o.output_ids for o in on.engine.generate(SHARED, params)] == expected
        on.engine.check_kv()
    assert on.engine.worker.reused_tokens > 0
    assert all_free_after_flush(on.engine)


def test_cache_with_the_overlap_schedule(tiny_dirs, draft_dirs):
    """Releases into the cache run in the worker's thread after the round in flight: the same tokens."""
    params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(SHARED))]
    off = make(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, False, max_running_requests=3)
    on = make(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, True, max_running_requests=3,
              overlap_schedule="on")
    expected = [o.output_ids for o in off.engine.generate(SHARED, params)]
    for _ in range(2):
        assert [o.output_ids for o in on.engine.generate(SHARED, params)] == expected
    assert on.engine.worker.reused_tokens > 0
    assert all_free_after_flush(on.engine)
