"""The end-to-end invariant: greedy speculative output == greedy target-only output, token for token, for every
algorithm and parameter combination (float32; random tiny targets and drafts); KV fully returned afterwards.
16-bit targets and KV caches: test_speculative_dtypes.py; configurations refused or resolved:
test_speculative_configs.py.

STANDALONE with the target itself as the draft ("self") accepts long runs, so it drives every KV path
(multi-token commits, page-crossing compaction, stops inside an accepted run); random EAGLE heads accept
little and check the rest of the flow.
"""

import gc
import weakref

import pytest
import torch
from conftest import all_slots_free

import fastspec
from fastspec.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50], [2 + 1], [28, 84, 19, 71],
           [69, 39, 93, 75, 10, 58, 20, 97 - 1, 44, 59, 23, 7, 81, 64, 6], [28, 62], [8, 99 - 10, 9], [86, 2 + 30]]
NEW = 21

# (family, algorithm, draft, num_steps, topk, num_draft_tokens, page_size, batch size)
CASES = [
    ("llama", "EAGLE", "eagle", 5, 4, 8, 1, 8),
    ("llama", "EAGLE3", "eagle3", 3, 1, 4, 16, 3),
    ("llama", "STANDALONE", "self", 6, 8, 64, 1, 5),
    ("llama", "STANDALONE", "self", 4, 1, 5, 16, 8),
    ("llama", "STANDALONE", "self", 3, 3, 10, 16, 4),
    ("llama", "STANDALONE", "standalone", 2, 2, 4, 1, 2),
    ("llama", "NGRAM", None, None, None, 8, 1, 6),
    ("qwen2", "EAGLE", "eagle", 1, 1, 2, 16, 7),
    ("qwen2", "EAGLE3", "eagle3", 6, 2, 12, 1, 8),
    ("qwen2", "STANDALONE", "self", 5, 1, 6, 1, 1),
    ("qwen2", "STANDALONE", "self", 2, 8, 17, 16, 6),
    ("qwen2", "NGRAM", None, None, None, 12, 16, 8),
    ("qwen3", "EAGLE", "eagle", 4, 3, 9, 16, 5),
    ("qwen3", "EAGLE3", "eagle3", 5, 4, 8, 16, 8),
    ("qwen3", "STANDALONE", "self", 3, 2, 7, 16, 8),
    ("qwen3", "STANDALONE", "self", 1, 4, 5, 1, 3),
    ("qwen3", "NGRAM", None, None, None, 4, 1, 2),
]

_reference_cache = {}


def reference(tiny_dirs, family, page_size, prompts, params):
    key = (family, page_size, tuple(map(tuple, prompts)), params)
    if key not in _reference_cache:
        llm = fastspec.LLM(str(tiny_dirs[family][0]), dtype="float32", max_total_tokens=4096, page_size=page_size)
        _reference_cache[key] = [o.output_ids for o in llm.engine.generate(prompts, [params] * len(prompts))]
    return _reference_cache[key]


def spec_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, **extra):
    directory = str(tiny_dirs[family][0])
    draft_path = directory if draft == "self" else (str(draft_dirs[family][draft]) if draft else None)
    return fastspec.LLM(directory, speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                        topk=topk, num_draft_tokens=n, page_size=page_size, max_total_tokens=4096, **extra)


@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size, bs", CASES)
def test_greedy_speculative_equals_target_only(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n,
                                               page_size, bs):
    prompts = PROMPTS[:bs]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size)
    outputs = llm.engine.generate(prompts, [params] * bs)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, family, page_size, prompts, params)
    assert all(len(o.output_ids) == NEW for o in outputs)
    assert all_slots_free(llm.engine)  # every slot came back
    llm.engine.check_kv()
    rounds = sum(o.metrics.verify_rounds for o in outputs)
    assert rounds > 0
    if draft == "self" and steps > 1:  # the target drafting for itself accepts multi-token runs
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)


@pytest.mark.parametrize("page_size, topk, steps, n", [(1, 1, 5, 6), (16, 4, 4, 9)])
def test_stop_token_inside_an_accepted_run(tiny_dirs, draft_dirs, page_size, topk, steps, n):
    """A stop id in the middle of a long accepted run ends the request exactly where target-only does."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = reference(tiny_dirs, "llama", page_size, PROMPTS, params)
    stops = [out[7] for out in plain]  # a token each request emits, mid-run
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", steps, topk, n, page_size)
    for prompt, out, stop in zip(PROMPTS, plain, stops):
        stopped = SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=(stop,))
        got = llm.engine.generate([prompt], [stopped])[0]
        assert got.output_ids == out[: out.index(stop) + 1] and got.finish_reason == "stop"
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("max_new", [1, 2, 9, 13])
def test_max_new_tokens_inside_an_accepted_run(tiny_dirs, draft_dirs, max_new):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "qwen2", "STANDALONE", "self", 6, 1, 7, 1)
    outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "qwen2", 1, PROMPTS, params)
    assert all(o.finish_reason == "length" and len(o.output_ids) == max_new for o in outputs)


def test_eagle3_drafts_only_hot_vocabulary_tokens(tiny_dirs, draft_dirs):
    """EAGLE-3 maps its draft vocabulary to target ids through d2t: every drafted token is a hot token."""
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, 4, 8, 1)
    hot = llm.engine.drafter.hot_token_id
    assert hot is not None and hot.numel() == 48 and len(set(hot.tolist())) == 48
    seen = []
    draft = llm.engine.drafter.draft
    llm.engine.drafter.draft = lambda batch: seen.append(draft(batch)) or seen[-1]
    llm.engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2)
    drafted = torch.cat([tree.draft_tokens[:, 1:].flatten() for tree in seen])
    assert seen and torch.isin(drafted, hot).all()


def test_fr_spec_token_map_keeps_greedy_lossless(tiny_dirs, draft_dirs, tmp_path):
    hot = tmp_path / "map.json"
    hot.write_text(str(list(range(0, 97, 2))))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, token_map=str(hot))
    assert llm.engine.drafter.hot_token_id.tolist() == list(range(0, 97, 2))
    outputs = llm.engine.generate(PROMPTS[:4], [params] * 4)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS[:4], params)


@pytest.mark.parametrize("algorithm, draft, chunk", [("NONE", None, 4), ("EAGLE3", "eagle3", 3),
                                                     ("STANDALONE", "self", 5), ("NGRAM", None, 2)])
def test_chunked_prefill_is_lossless(tiny_dirs, draft_dirs, algorithm, draft, chunk):
    """Prompts prefilled a few tokens per step (non-final draft chunks end with the next prompt token)."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    steps, topk, n = (None, None, 6) if algorithm == "NGRAM" else (3, 2, 5) if draft else (None, None, None)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, 1, chunked_prefill_size=chunk)
    outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS, params)
    assert all_slots_free(llm.engine)
    if draft:  # the draft saw exactly what an unchunked prefill shows it: the same trees, the same acceptance
        whole = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, 1)
        unchunked = whole.engine.generate(PROMPTS, [params] * len(PROMPTS))
        assert [o.metrics for o in outputs] == [o.metrics for o in unchunked]


@pytest.mark.parametrize("algorithm, draft, page_size, pool", [("NONE", None, 1, 96), ("STANDALONE", "self", 16, 224),
                                                               ("EAGLE3", "eagle3", 1, 128), ("NGRAM", None, 4, 128)])
def test_overload_preempts_and_recomputes_losslessly(tiny_dirs, draft_dirs, algorithm, draft, page_size, pool):
    """Far more work than the pool holds, mixed lengths and sampling settings: requests wait, running ones get
    preempted and recomputed; every output equals the request run alone, and no slot leaks."""
    steps, topk, n = (3, 2, 5) if draft else (None, None, 6 if algorithm == "NGRAM" else None)
    params = [SamplingParams(max_new_tokens=10 + 5 * i, ignore_eos=True,
                             **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 3 == 1 else {}))
              for i in range(len(PROMPTS))]
    alone = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, page_size)
    expected = [alone.engine.generate([p], [sp])[0].output_ids for p, sp in zip(PROMPTS, params)]
    cramped = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm=algorithm, num_steps=steps, topk=topk,
                           draft_model=(str(tiny_dirs["llama"][0]) if draft == "self" else
                                        str(draft_dirs["llama"][draft]) if draft else None),
                           num_draft_tokens=n, page_size=page_size, max_total_tokens=pool)
    outputs = cramped.engine.generate(PROMPTS, params)
    assert [o.output_ids for o in outputs] == expected
    assert cramped.engine.preemptions > 0
    assert all_slots_free(cramped.engine)


@pytest.mark.parametrize("algorithm, draft, steps, topk, n", [("EAGLE3", "eagle3", 3, 2, 4),
                                                              ("STANDALONE", "self", 3, 2, 4), ("NGRAM", None, None, None, 4)])
def test_a_dropped_llm_is_freed_at_once(tiny_dirs, draft_dirs, algorithm, draft, steps, topk, n):
    """No reference cycle holds an engine: dropping the last reference frees its weights and KV pools right
    away, not whenever the garbage collector next runs (a cycle kept ~3 GB per dropped embedded-model engine)."""
    gc.disable()
    try:
        llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, 1, speculative_fallback=True)
        llm.engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
        pool = weakref.ref(llm.engine.pool.k)
        del llm
        assert pool() is None
    finally:
        gc.enable()
