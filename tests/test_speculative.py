"""The end-to-end invariant: greedy speculative output == greedy target-only output, token for token, for every
algorithm and parameter combination (float32, and 16-bit targets; random tiny targets and drafts); KV fully returned
afterwards.

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
from fastspec.errors import FastspecError
from fastspec.kernels.cpu_row_gemm import RowLinear
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


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="EAGLE"), "needs a draft model"),
    (dict(speculative_algorithm="MEDUSA"), "unknown speculative algorithm"),
    (dict(speculative_algorithm="EAGLE", draft_model="DRAFT", num_steps=2, topk=2, num_draft_tokens=9),
     "infeasible"),
    (dict(speculative_algorithm="EAGLE3", draft_model="DRAFT"), "needs a LlamaForCausalLMEagle3 head"),
    (dict(speculative_algorithm="STANDALONE", draft_model="DRAFT"), "needs a full model"),
    (dict(speculative_algorithm="EAGLE3", draft_model="TARGET"), "a full model: STANDALONE drafts with one"),
    (dict(speculative_algorithm="EAGLE", draft_model="DRAFT", accept_threshold_acc=1.5), "must be in [0, 1]"),
])
def test_bad_speculative_configs(tiny_dirs, draft_dirs, kwargs, message):
    if kwargs.get("draft_model") == "DRAFT":
        kwargs["draft_model"] = str(draft_dirs["llama"]["eagle"])
    if kwargs.get("draft_model") == "TARGET":
        kwargs["draft_model"] = str(tiny_dirs["llama"][0])
    with pytest.raises(FastspecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=1024, **kwargs)


def test_draft_that_does_not_fit_the_target(tiny_dirs, draft_dirs):
    from fastspec.models.draft_loader import check_draft_fits
    from fastspec.models.loader import read_config

    head = read_config(draft_dirs["llama"]["eagle"])
    target = read_config(tiny_dirs["llama"][0])
    with pytest.raises(FastspecError, match="draft expects target features of width 64"):
        check_draft_fits(head, target.replace(hidden_size=32), "draft")
    with pytest.raises(FastspecError, match="draft vocabulary 97 != target vocabulary 50"):
        check_draft_fits(head, target.replace(vocab_size=50), "draft")


def test_token_map_outside_the_vocabulary(tiny_dirs, draft_dirs, tmp_path):
    bad = tmp_path / "map.json"
    bad.write_text("[1, 2, 500]")
    with pytest.raises(FastspecError, match="outside the target vocabulary"):
        spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, token_map=str(bad))


def test_fr_spec_token_map_keeps_greedy_lossless(tiny_dirs, draft_dirs, tmp_path):
    hot = tmp_path / "map.json"
    hot.write_text(str(list(range(0, 97, 2))))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1, token_map=str(hot))
    assert llm.engine.drafter.hot_token_id.tolist() == list(range(0, 97, 2))
    outputs = llm.engine.generate(PROMPTS[:4], [params] * 4)
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS[:4], params)


def test_topk_one_forces_a_chain(tiny_dirs):
    from fastspec.spec_config import SpecConfig, SpecParams

    spec = SpecConfig.resolve("EAGLE", "LlamaForCausalLM", draft_model="x", num_steps=4, topk=1, num_draft_tokens=9)
    assert spec.num_draft_tokens == 5
    assert SpecConfig.resolve("EAGLE", "LlamaForCausalLM", draft_model="x").num_steps == 5  # Llama: (5, 4, 8)
    assert SpecConfig.resolve("EAGLE", "Qwen2ForCausalLM", draft_model="x").topk == 1  # others: (3, 1, 4)
    assert SpecConfig.resolve("NEXTN", "Qwen2ForCausalLM", draft_model="x").algorithm == "EAGLE"
    # on a CPU Llama's unset tree flags take the CPU's measured shape; set flags and other targets as on a GPU
    cpu = dict(draft_model="x", device="cpu")
    assert SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", **cpu).params == SpecParams(2, 2, 3)
    assert SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", topk=4, **cpu).params == SpecParams(2, 4, 3)
    assert SpecConfig.resolve("EAGLE3", "Qwen2ForCausalLM", **cpu).params == SpecParams(3, 1, 4)
    assert SpecConfig.resolve("STANDALONE", "LlamaForCausalLM", **cpu).params == SpecParams(3, 1, 4)


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


def plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft, every_round=False, **extra):
    """(the speculative LLM, its outputs, the target-only output ids) over PROMPTS with the same engine options;
    a small tree (NGRAM: 6 tokens); `every_round`: no measured fallback to plain rounds."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    steps, topk, n = (None, None, 6) if algorithm == "NGRAM" else (3, 2, 5)
    plain = fastspec.LLM(str(tiny_dirs[family][0]), max_total_tokens=4096, **extra)
    expected = [o.output_ids for o in plain.engine.generate(PROMPTS, [params] * len(PROMPTS))]
    llm = spec_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, 16, **extra)
    if every_round:
        llm.engine.policy = None
    return llm, llm.engine.generate(PROMPTS, [params] * len(PROMPTS)), expected


@pytest.mark.parametrize("family, algorithm, draft, quantization, kv", [
    ("llama", "EAGLE3", "eagle3", None, "bfloat16"), ("qwen2", "STANDALONE", "self", "int4", "float16"),
    ("qwen3", "EAGLE", "eagle", "int4", "bf16"), ("llama", "NGRAM", None, None, "fp16"),
    ("llama", "EAGLE3", "eagle3", "int4", "fp8_e4m3"), ("qwen2", "STANDALONE", "self", None, "fp8_e5m2")])
def test_a_smaller_kv_cache_is_lossless(tiny_dirs, draft_dirs, family, algorithm, draft, quantization, kv):
    """--kv-cache-dtype: K and V (target's and draft's) stored rounded to 16 or 8 bits; speculative output still
    equals target-only output over the same cache dtype, on the float layers and on packed ones (the fused C
    kernels)."""
    llm, outputs, expected = plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft,
                                                   quantization=quantization, kv_cache_dtype=kv)
    assert [o.output_ids for o in outputs] == expected
    stored = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}.get(kv, torch.float16)
    assert {p.k.dtype for p in llm.engine.worker.memory.pools} == {stored}
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("family, algorithm, draft, dtype, quantization", [
    ("llama", "EAGLE3", "eagle3", "bfloat16", None), ("qwen3", "EAGLE", "eagle", "float16", None),
    ("qwen2", "STANDALONE", "self", "bfloat16", "int4"), ("llama", "NGRAM", None, "float16", None)])
def test_a_16_bit_target_is_lossless(tiny_dirs, draft_dirs, family, algorithm, draft, dtype, quantization):
    """--dtype bfloat16 / float16: a verify row rounds as the decode step of its token does (attention takes each row
    over exactly its keys, whatever the batch and the tree around it), so speculative output equals target-only output
    in 16 bits too, token for token (torch's SDPA over the padded verify block made greedy EAGLE-3 leave plain decoding
    in bfloat16)."""
    llm, outputs, expected = plain_and_speculative(tiny_dirs, draft_dirs, family, algorithm, draft, every_round=True,
                                                   dtype=dtype, quantization=quantization)
    invariant = gemms_row_invariant(llm.engine.worker.target.model, getattr(torch, dtype))
    if [o.output_ids for o in outputs] != expected and not invariant:
        pytest.skip(f"this CPU's {dtype} GEMMs round a row by the rows beside it: no kernel of ours can make a verify "
                    "row its decode step here")
    assert [o.output_ids for o in outputs] == expected
    assert sum(o.metrics.verify_rounds for o in outputs) > 0


def gemms_row_invariant(model, dtype: torch.dtype) -> bool:
    """Whether every linear of `model` gives a row alone what it gives it among others (1 to 40 rows): torch's 16-bit
    GEMMs do on the CPUs measured, but their kernels are the CPU library's choice, made by the row count."""
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if type(module) in (torch.nn.Linear, RowLinear) or hasattr(module, "activation"):
            x = torch.randn(40, module.in_features, generator=g).to(dtype)
            whole = module(x)
            if not all(torch.equal(module(x[:m]), whole[:m]) for m in (1, 2, 3, 5, 8, 13, 24)):
                return False
    return True


def test_auto_stores_a_packed_cpu_targets_kv_cache_in_bfloat16(tiny_dirs):
    """--kv-cache-dtype auto: the model's --dtype, but bfloat16 for quantised weights run on the CPU in float32 (the
    embedded model's case, as llama.cpp's cache is 16-bit); float weights and an explicit float32 keep float32."""
    def stored(**kwargs) -> torch.dtype:
        llm = fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=512, **kwargs)
        return llm.engine.worker.pool.k.dtype

    assert stored(quantization="int4") == torch.bfloat16
    assert stored() == stored(quantization="int4", kv_cache_dtype="float32") == torch.float32


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


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_loading_a_head_leaves_the_target_it_shares_modules_with_as_it_was(tiny_dirs, draft_dirs, kind):
    """A head shares the target's embedding (and EAGLE-1's lm_head); casting the head to its dtype cast those too,
    so a bfloat16 target whose shared module keeps a float32 table (a packed embedding's scales) computed other
    logits beside a head than alone: greedy EAGLE-3 differed from plain decoding on the embedded model in bfloat16.
    Every target tensor, float32 ones included, stays bit for bit what it was."""
    from fastspec.models.draft_loader import load_draft
    from fastspec.models.loader import load_target

    target = load_target(tiny_dirs["llama"][0], torch.bfloat16)
    target.model.embed_tokens.register_buffer("scale", torch.rand(7, dtype=torch.float64).float())  # a float32 table
    before = {k: v.clone() for k, v in target.state_dict().items()}
    head = load_draft(draft_dirs["llama"][kind], target, torch.bfloat16)
    after = target.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(p.dtype == torch.bfloat16 for n, p in head.named_parameters() if not n.startswith(("embed", "lm_head")))
