"""The draft's state pinned: before every round, the draft KV of every layer at the committed positions, the
state the last extend left and the proposed tree equal a reference built from the committed tokens alone
(tests/draft_reference.py), whatever path built them: prefill chunks, the backlog's catch-up after plain rounds,
the draft extend after each verify round, the prefix cache, preemption and re-prefill, overlap. A wrong draft
is harmless to the output (it only lowers acceptance), so losslessness cannot see it; this can. Acceptance is
pinned exactly: every round accepts what its tree accepts against the known greedy continuation.

For each algorithm that drafts: EAGLE, EAGLE-3, STANDALONE, NEXTN (DeepSeek MTP with one and two layers, and
Qwen3-Next's MTP layer over a hybrid target).
"""

import pytest
from conftest import all_slots_free
from draft_reference import DraftChecker
from test_policy import Alternating, PlainFor
from test_speculative import PROMPTS

import fastspec
from fastspec.sampling import SamplingParams

NEW = 16


def greedy(model: str, prompts: list[list[int]], new: int, **options) -> list[list[int]]:
    """prompt + target-only greedy output of `new` tokens, per prompt."""
    llm = fastspec.LLM(model, max_total_tokens=4096, **options)
    outputs = llm.engine.generate(prompts, [SamplingParams(max_new_tokens=new, ignore_eos=True)] * len(prompts))
    return [list(p) + o.output_ids for p, o in zip(prompts, outputs)]


def run_checked(llm, prompts: list[list[int]], sequences: list[list[int]], new: int = NEW):
    """Generate under a DraftChecker; the output equals target-only and each request's rounds accept exactly what
    their trees accept against the greedy continuation."""
    checker = DraftChecker(llm.engine, sequences)
    outputs = llm.engine.generate(prompts, [SamplingParams(max_new_tokens=new, ignore_eos=True)] * len(prompts))
    for rid, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.output_ids == sequences[rid][len(prompt):len(prompt) + new]
        m = out.metrics
        assert (m.verify_rounds, m.accepted_tokens) == checker.expected_metrics(rid, len(prompt), new), rid
    worker = llm.engine.worker  # every request released: no draft state or backlog rows left behind
    assert not any(d.states for d in worker.drafters.values())
    assert not any(worker.backlog.behind(rid) for rid in range(len(prompts)))
    # near-ties (a random head's flat distributions have some) leave a tree unchecked, never most of them
    assert checker.checked > 0 and checker.trees >= checker.checked / 2, (checker.trees, checker.checked)
    return checker, outputs


_greedy = {}


def sequences(model: str, prompts: list[list[int]], page_size: int) -> list[list[int]]:
    """Target-only greedy sequences, a few tokens past NEW (a last round's tree may reach past max_new_tokens)."""
    key = (model, page_size, tuple(map(tuple, prompts)))
    if key not in _greedy:
        _greedy[key] = greedy(model, prompts, NEW + 8, page_size=page_size)
    return _greedy[key]


# (family, algorithm, draft, num_steps, topk, num_draft_tokens, page size)
DRAFTS = [("llama", "EAGLE", "eagle", 3, 2, 6, 1),
          ("qwen3", "EAGLE3", "eagle3", 3, 1, 4, 16),
          ("llama", "EAGLE3", "eagle3", 4, 2, 7, 1),
          ("qwen2", "STANDALONE", "self", 4, 2, 6, 16),
          ("llama", "STANDALONE", "standalone", 2, 2, 4, 1)]
# how the draft KV gets built: prompts in chunks of 5 and rounds plain or speculative at random (the backlog fills
# and catches up); or more work than the pool holds (preemption, re-prefill in chunks of 3) under overlap
PATHS = {"chunks-backlog": dict(chunked_prefill_size=5, overlap_schedule="off"),
         "preemption-overlap": dict(chunked_prefill_size=3, overlap_schedule="on")}


def draft_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, **options):
    target = str(tiny_dirs[family][0])
    path = target if draft == "self" else str(draft_dirs[family][draft])
    return fastspec.LLM(target, speculative_algorithm=algorithm, draft_model=path, num_steps=steps, topk=topk,
                        num_draft_tokens=n, page_size=page_size,
                        **{"max_total_tokens": 4096, "radix_cache": False} | options)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size", DRAFTS)
def test_draft_state_equals_a_fresh_prefill_after_every_path(tiny_dirs, draft_dirs, family, algorithm, draft, steps,
                                                              topk, n, page_size, path):
    preempt = path == "preemption-overlap"
    prompts = PROMPTS if preempt else PROMPTS[:4]
    pool = {"max_total_tokens": 224 if page_size > 1 else 128} if preempt else {}
    llm = draft_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, **PATHS[path],
                    **pool)
    if not preempt:
        llm.engine.policy = Alternating(len(family))
    run_checked(llm, prompts, sequences(str(tiny_dirs[family][0]), prompts, page_size))
    if preempt:
        assert llm.engine.preemptions > 0
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size",
                         [DRAFTS[2], ("qwen2", "STANDALONE", "self", 4, 2, 6, 4)])
def test_draft_state_from_the_prefix_cache(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n,
                                           page_size):
    """Requests decoded plainly to their end leave their draft KV in the prefix cache (caught up as they leave);
    follow-up turns start from it and draft exactly as from a fresh prefill."""
    target = str(tiny_dirs[family][0])
    llm = draft_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, radix_cache=True,
                    chunked_prefill_size=4)
    firsts = sequences(target, PROMPTS[:3], page_size)
    llm.engine.policy = PlainFor(10**6)
    llm.engine.generate(PROMPTS[:3], [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * 3)
    llm.engine.policy = PlainFor(2)  # the follow-ups start plain too: cached KV, then backlog, then rounds
    follow = [s[:len(p) + NEW] + [7, 8, 9][:i + 1] for i, (p, s) in enumerate(zip(PROMPTS, firsts))]
    run_checked(llm, follow, sequences(target, follow, page_size))
    # each follow-up reuses its first turn's KV, the last page too where the next token is the one drafted with it
    # (where two first turns branch, the draft's KV at the branch is the first writer's, so reuse stops before it)
    assert llm.engine.worker.reused_tokens >= sum(len(p) + NEW - 1 - page_size for p in PROMPTS[:3] if len(p) > 1)
    assert all_slots_free(llm.engine)


@pytest.fixture(scope="module")
def mtp_targets(tmp_path_factory):
    """A DeepSeek-V3 target with one MTP layer and one with two (a layer per draft step), and a Qwen3-Next
    target with its MTP layer (a hybrid target: its features come from a recurrent forward)."""
    from tiny_models import write_deepseek, write_qwen3_next_mtp

    out = {}
    for name, layers in (("deepseek-mtp1", 1), ("deepseek-mtp2", 2)):
        out[name] = tmp_path_factory.mktemp(name)
        write_deepseek(out[name], "deepseek_v3", mtp=layers)
    out["qwen3-next-mtp"] = tmp_path_factory.mktemp("qwen3-next-mtp")
    write_qwen3_next_mtp(out["qwen3-next-mtp"])
    return out


@pytest.mark.parametrize("target, steps, topk, n, page_size", [("deepseek-mtp1", 3, 2, 6, 1),
                                                                ("deepseek-mtp2", 3, 1, 4, 16),
                                                                ("deepseek-mtp2", 2, 2, 4, 1),
                                                                ("qwen3-next-mtp", 3, 2, 5, 1)])
def test_nextn_draft_state_equals_a_fresh_prefill(mtp_targets, target, steps, topk, n, page_size):
    """NEXTN: the checkpoint's MTP layers draft; with two, each draft step's layer reads the one before at the
    position before (its per-layer outputs are part of the state). Prompts in chunks, rounds plain or
    speculative at random."""
    model = str(mtp_targets[target])
    llm = fastspec.LLM(model, speculative_algorithm="NEXTN", num_steps=steps, topk=topk, num_draft_tokens=n,
                       page_size=page_size, max_total_tokens=4096, chunked_prefill_size=5, radix_cache=False)
    llm.engine.policy = Alternating(steps)
    run_checked(llm, PROMPTS[:4], sequences(model, PROMPTS[:4], page_size))
    assert all_slots_free(llm.engine)
