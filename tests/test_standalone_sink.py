"""A STANDALONE draft sees the true sequence: its rows pair t_{p+1} with draft position p (the EAGLE frame), so the
sequence's first token t_0 is no row of its own; its K/V sit in one key per request every draft row attends, and
draft position p is the LM's position p + 1.

Two oracles that share no code with the drafter:
- the target drafting for itself (the same float32 weights) predicts exactly the target's greedy tokens, so every
  draft token of every round is accepted (each tree walked against the known greedy continuation): batch 1 and
  batched, chunked prefill, page size 16, trees, preemption, a prefix-cache hit;
- a different draft's KV at every committed position (every layer) and its logits after the last one equal the
  plain LM's over t_0..t_n, run by the test's own pool runner (extend metadata, the torch backend): draft position
  p against LM position p + 1, the first-token key against position 0.
Tolerance: float32, batched / paged / padded forwards against one plain forward round apart by ~1e-6; TOL is two
orders above that and far below what a missing t_0 or a shifted position changes (O(0.1)).
"""

from contextlib import contextmanager

import pytest
import torch
from conftest import PoolRunner, all_slots_free
from draft_reference import accept_len
from test_speculative import PROMPTS

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecParams
from fastspec.tune.replay import record, replay_tau

NEW = 14
TOL = dict(atol=1e-4, rtol=1e-4)


def llm_for(target: str, draft: str, steps: int, topk: int, n: int, page_size: int, **options):
    return fastspec.LLM(target, speculative_algorithm="STANDALONE", draft_model=draft, num_steps=steps, topk=topk,
                        num_draft_tokens=n, page_size=page_size, speculative_fallback=False,
                        **{"max_total_tokens": 4096, "radix_cache": False} | options)


def greedy(target: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """prompt + target-only greedy output of `new` tokens, per prompt."""
    llm = fastspec.LLM(target, max_total_tokens=4096)
    outputs = llm.engine.generate(prompts, [SamplingParams(max_new_tokens=new, ignore_eos=True)] * len(prompts))
    return [list(p) + o.output_ids for p, o in zip(prompts, outputs)]


@contextmanager
def on_every_draft(engine, check):
    """check(drafter, batch, tree) after each draft of every drafter, within the block."""
    for drafter in engine.drafters.values():
        def draft(batch, real=drafter.draft, drafter=drafter):
            tree = real(batch)
            check(drafter, batch, tree)
            return tree
        drafter.draft = draft
    try:
        yield
    finally:
        for drafter in engine.drafters.values():
            del drafter.draft  # the method again


def generate_all_accepted(llm, prompts: list[list[int]], sequences: list[list[int]], steps: int) -> None:
    """Generate NEW tokens per prompt; the output is target-only's and every round's tree has all `steps` draft
    tokens accepted against the greedy continuation `sequences` (by request id: prompts in order)."""
    accepted = []
    with on_every_draft(llm.engine, lambda drafter, batch, tree: accepted.extend(
            (rid, n, accept_len(tree, b, sequences[rid])) for b, (rid, n) in
            enumerate(zip(batch.rids, batch.seq_lens.tolist())))):
        outputs = llm.engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * len(prompts))
    assert [p + o.output_ids for p, o in zip(prompts, outputs)] == [s[:len(p) + NEW] for p, s in
                                                                      zip(prompts, sequences)]
    assert accepted and all(a == steps for _, _, a in accepted), [x for x in accepted if x[2] != steps]


# (family, num_steps, topk, num_draft_tokens, page size, batch size, options)
SELF = [("llama", 4, 1, 5, 1, 1, {}),
        ("qwen2", 3, 1, 4, 16, 4, dict(chunked_prefill_size=3)),
        # a tree: both root children expanded and every candidate kept, so the greedy path is in it (deeper, the
        # beam may drop it: the greedy child's score p1 * p2 can lose to the other branch's)
        ("qwen3", 2, 2, 7, 1, 3, dict(chunked_prefill_size=5)),
        ("llama", 3, 1, 4, 16, 8, dict(chunked_prefill_size=3, max_total_tokens=224, overlap_schedule="on"))]


@pytest.mark.parametrize("family, steps, topk, n, page_size, bs, options", SELF)
def test_a_self_draft_is_accepted_at_every_depth_of_every_round(tiny_dirs, family, steps, topk, n, page_size, bs,
                                                                options):
    target = str(tiny_dirs[family][0])
    prompts = PROMPTS[:bs]
    llm = llm_for(target, target, steps, topk, n, page_size, **options)
    generate_all_accepted(llm, prompts, greedy(target, prompts, NEW + steps + 2), steps)
    if "max_total_tokens" in options:
        assert llm.engine.preemptions > 0
    assert all_slots_free(llm.engine)


def test_a_self_draft_from_the_prefix_cache_is_accepted_at_every_depth(tiny_dirs):
    """Follow-ups whose prefix (t_0 included) the cache holds draft from its KV: still every token accepted."""
    target = str(tiny_dirs["llama"][0])
    llm = llm_for(target, target, 3, 1, 4, 4, radix_cache=True, chunked_prefill_size=6)
    firsts = greedy(target, PROMPTS[:3], NEW)
    generate_all_accepted(llm, PROMPTS[:3], greedy(target, PROMPTS[:3], NEW + 5), 3)
    follow = [s + [7, 8, 9][:i + 1] for i, s in enumerate(firsts)]
    generate_all_accepted(llm, follow, greedy(target, follow, NEW + 5), 3)
    assert llm.engine.worker.reused_tokens > 0
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("page_size, options", [(1, dict(chunked_prefill_size=4)), (16, {})])
def test_the_draft_sees_the_true_sequence(tiny_dirs, draft_dirs, page_size, options):
    """Before every round (n committed tokens, root t_n) the draft's KV at positions 0..n-1 and its first-token key
    are the plain LM's K/V at positions 1..n and 0, and its top-k comes from the plain LM's logits at position n."""
    target, draft = str(tiny_dirs["llama"][0]), str(draft_dirs["llama"]["standalone"])
    prompts = PROMPTS[:3]
    sequences = greedy(target, prompts, NEW + 4)
    llm = llm_for(target, draft, 3, 2, 6, page_size, **options)
    worker = llm.engine.worker
    lm = worker.draft_model.lm
    checked = []

    def check(drafter, batch, tree):
        for rid, row, n in zip(batch.rids, batch.rows.tolist(), batch.seq_lens.tolist()):
            runner = PoolRunner(lm)
            final = runner.extend([0], [sequences[rid][:n + 1]]).final  # LM positions 0..n
            want = runner.table.slots(runner.rows[0], 0, n + 1)
            got = torch.cat([drafter.pool.row_slot(torch.tensor([row])), worker.table.slots(row, 0, n)])
            where = f"request {rid} after {n} tokens"
            for mine, plain in ((drafter.pool.k, runner.pool.k), (drafter.pool.v, runner.pool.v)):
                torch.testing.assert_close(mine[:, got], plain[:, want], **TOL, msg=lambda m: f"{where}: KV {m}")
            logits = lm.compute_logits(drafter.states[rid].normed[None])
            torch.testing.assert_close(logits, lm.compute_logits(final[n:]), **TOL, msg=lambda m: f"{where}: {m}")
            checked.append(n)

    with on_every_draft(llm.engine, check):
        outputs = llm.engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * len(prompts))
    assert [p + o.output_ids for p, o in zip(prompts, outputs)] == [s[:len(p) + NEW] for p, s in
                                                                      zip(prompts, sequences)]
    assert len(checked) > len(prompts)


def test_the_tuners_replay_drafts_as_the_engine_does(tiny_dirs):
    """`fastspec tune` replays drafting over its own draft prefill (t_0's key included): for the target drafting
    for itself it predicts exactly the engine's rounds and tokens, every draft accepted."""
    target = str(tiny_dirs["qwen2"][0])
    shape = SpecParams(3, 1, 4)
    llm = llm_for(target, target, shape.num_steps, shape.topk, shape.num_draft_tokens, 1)
    engine, prompts = llm.engine, PROMPTS[:3]
    outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=True)] * len(prompts))
    recorded = [record(engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature, p,
                       o.output_ids, [shape]) for p, o in zip(prompts, outputs)]
    rounds, emitted = (sum(getattr(o.metrics, f) for o in outputs) for f in ("verify_rounds", "emitted_tokens"))
    assert replay_tau(recorded, shape) == (rounds, emitted)
    assert rounds == len(prompts) * -(-(NEW - 1) // 4)  # every round emits its 3 drafts and the bonus token


def test_the_tuners_replay_runs_on_the_models_device(tiny_dirs):
    """`fastspec tune` on CUDA replays over its engine's CUDA models: every tensor the replay makes is on their
    device, not the default one (it made them on the CPU: a device mismatch at its first forward on a GPU). Here
    the default device is meta and the models are on the CPU, so a tensor made on the default device fails."""
    target = str(tiny_dirs["qwen2"][0])
    shape = SpecParams(2, 2, 4)
    engine = llm_for(target, target, shape.num_steps, shape.topk, shape.num_draft_tokens, 1).engine
    prompt, output = PROMPTS[0], [5, 6, 7, 8, 9, 10]
    args = (engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature, prompt, output, [shape])
    expected = record(*args)
    with torch.device("meta"):
        assert record(*args) == expected
