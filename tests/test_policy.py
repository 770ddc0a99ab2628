"""Falling back to plain decoding where speculation is slower: the choice follows measured rates, and switching
modes mid-generation keeps the output exact (the draft catches up on what plain rounds produced before it
speculates again)."""

import random

import pytest
from conftest import all_slots_free
from draft_reference import DraftChecker
from test_speculative import PROMPTS, reference, spec_llm

from fastspec.sampling import SamplingParams
from fastspec.speculative.policy import SpecPolicy


def test_policy_picks_the_faster_mode_and_probes_the_other():
    policy = SpecPolicy(probe_every=10, warmup_rounds=2)
    choices = []
    for _ in range(40):
        spec = policy.speculate(4)
        choices.append(spec)
        # speculation: 2 tokens per request in 0.3 s; plain: 1 token in 0.1 s -> plain is faster
        policy.record(4, spec, 2.0 if spec else 1.0, 0.3 if spec else 0.1)
    assert choices[:2] == [True, True] and choices[2] is False  # warm-up, then the first plain probe
    # plain leads from round 4: speculation is probed 10 rounds later, then 20 after that (it still loses)
    assert [n for n, c in enumerate(choices, 1) if c and n > 2] == [14, 34]
    spec_rate, plain_rate = policy.rates(4)
    assert plain_rate == pytest.approx(10.0) and spec_rate == pytest.approx(2 / 0.3)
    assert policy.speculate(1)  # other batch sizes are measured separately


def test_probes_of_a_losing_mode_back_off_and_restart_when_the_lead_changes():
    """alpha 1: each mode's rate is its last round's. Plain leads until round 60 (speculation probed 4 rounds after
    plain takes the lead, then 8, then every 16); then speculation is faster, leads from the first decision that
    sees it, and plain is probed 4, 8, 16, 16 rounds after that."""
    policy = SpecPolicy(probe_every=4, max_probe_every=16, warmup_rounds=0, alpha=1.0)
    chose = {}
    for n in range(1, 111):
        chose[n] = policy.speculate(1)
        fast = not chose[n] if n <= 60 else chose[n]
        policy.record(1, chose[n], 1.0, 0.1 if fast else 0.3)
    assert chose[1] and not chose[2]  # the first round of each mode
    assert [n for n in range(3, 61) if chose[n]] == [7, 15, 31, 47]  # plain leads from round 3
    assert chose[61] is False and all(chose[n] for n in range(62, 66))  # 61 measures plain slow: a new leader
    assert [n for n in range(62, 111) if not chose[n]] == [66, 74, 90, 106]


def test_rates_are_kept_per_context_length_and_a_new_length_starts_from_the_nearest():
    """Speculation pays over short contexts and not over long ones (a verify attends every draft token to the whole
    context): the policy speculates at 300 tokens and decodes plainly at 3000, each length measured apart; a length
    seen for the first time next to a measured one (1500, next to 3000's bucket) starts from its rates, without
    warm-up rounds of its own."""
    policy = SpecPolicy(probe_every=50, warmup_rounds=2, alpha=1.0)

    def run(context: int, rounds: int) -> list[bool]:
        chose = []
        for _ in range(rounds):
            chose.append(policy.speculate(1, context))
            fast = chose[-1] == (context < 1000)
            policy.record(1, chose[-1], 1.0, 0.1 if fast else 0.3, context)
        return chose

    assert run(300, 10) == [True] * 2 + [False] + [True] * 7  # warm-up, a plain probe, then speculation leads
    assert run(3000, 10) == [True] * 2 + [False] * 8  # its own warm-up: 3000's bucket is not next to 300's
    assert policy.rates(1, 300) == (10.0, 1 / 0.3) and policy.rates(1, 3000) == (1 / 0.3, 10.0)
    assert run(1500, 3) == [False] * 3  # from 3000's rates (bucket 11 is next to 12): plain from its first round
    assert policy.rates(1, 100) == policy.rates(1, 511) != policy.rates(1, 512)  # buckets: powers of two from 256


def test_policy_keeps_speculating_when_it_pays():
    policy = SpecPolicy(probe_every=8)
    choices = []
    for _ in range(30):
        spec = policy.speculate(1)
        choices.append(spec)
        policy.record(1, spec, 3.0 if spec else 1.0, 0.1)
    assert sum(not c for c in choices) <= 1 + 30 // 8


class Alternating:
    def __init__(self, seed):
        self.rng = random.Random(seed)

    def speculate(self, bs, context=0):
        return self.rng.random() < 0.5

    def record(self, *args):
        pass


@pytest.mark.parametrize("algorithm, draft, steps, topk, n", [("EAGLE3", "eagle3", 3, 2, 5),
                                                              ("STANDALONE", "self", 4, 1, 5),
                                                              ("NGRAM", None, None, None, 6)])
def test_switching_modes_mid_generation_is_lossless(tiny_dirs, draft_dirs, algorithm, draft, steps, topk, n):
    params = SamplingParams(max_new_tokens=21, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, 1)
    llm.engine.policy = Alternating(0)
    outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, PROMPTS, params)
    assert all_slots_free(llm.engine)
    if draft == "self":  # after plain rounds the draft state is exact: speculation still accepts runs
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)


class PlainFor:
    """Plain for the first `n` rounds, speculative after."""

    def __init__(self, n: int):
        self.n, self.rounds = n, 0

    def speculate(self, bs, context=0):
        self.rounds += 1
        return self.rounds > self.n

    def record(self, *args):
        pass


def count_extends(llm) -> list:
    """The drafter's `extend` calls from now on, as (decode_round, rows)."""
    calls, drafter = [], llm.engine.drafter
    original = drafter.extend

    def counting(batch, decode_round):
        calls.append((decode_round, int(batch.extend_lens.sum())))
        return original(batch, decode_round)

    drafter.extend = counting
    return calls


def eager_catch_up(llm) -> None:
    """The draft catches up right after every plain round: what it did before the backlog (an extend per plain
    round), the reference the backlog must match."""
    worker = llm.engine.worker
    rounds = worker.plain_rounds
    original = type(rounds).__call__

    def run(reqs):
        out = original(rounds, reqs)
        worker.backlog.catch_up(worker.drafter, reqs, worker.config.device)
        return out

    rounds.__call__ = run
    worker.plain_rounds = lambda reqs: rounds.__call__(reqs)


def test_plain_rounds_leave_the_draft_alone_and_it_catches_up_before_speculating(tiny_dirs, draft_dirs):
    """Prefill and plain rounds run no draft at all (their rows wait in the draft's backlog); before the first
    speculative round the draft catches up in one extend over them, to the state a draft extended every round has: a
    self-draft (STANDALONE with the target itself) then accepts exactly what it accepts that way. The output
    equals target-only decoding."""
    prompts, params = PROMPTS[:2], SamplingParams(max_new_tokens=24, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = spec_llm(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 4, 1, 5, 1, radix_cache=False)
        llm.engine.policy = PlainFor(8)
        if eager:
            eager_catch_up(llm)
        calls = count_extends(llm)
        outputs = llm.engine.generate(prompts, [params] * len(prompts))
        assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, prompts, params)
        assert all_slots_free(llm.engine)
        runs.append(([o.metrics for o in outputs], calls))
    (metrics, calls), (eager_metrics, eager_calls) = runs
    prompt_rows = len(prompts[0]) + len(prompts[1])
    assert calls == [(False, prompt_rows + 2 * 8)]  # one catch-up over the prompts and the 8 plain rounds
    assert len(eager_calls) == 8 and metrics == eager_metrics and metrics[0].verify_rounds > 1
    always_plain = spec_llm(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 4, 1, 5, 1, radix_cache=False)
    always_plain.engine.policy = PlainFor(10**6)
    calls = count_extends(always_plain)
    outputs = always_plain.engine.generate(prompts, [params] * len(prompts))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", 1, prompts, params)
    assert calls == []  # the draft never ran
    assert not any(always_plain.engine.worker.backlog.behind(rid) for rid in range(len(prompts)))  # released: none


def test_a_request_leaving_for_the_prefix_cache_completes_its_draft_kv_first(tiny_dirs, draft_dirs):
    """A request decoded plainly to its end catches its draft up as it goes into the prefix cache: a later request
    continuing its conversation starts from the cached target and draft KV and drafts exactly as it does after a
    draft extended every round (draft KV left unwritten would make it guess)."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    seconds = []
    for eager in (False, True):
        llm = spec_llm(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 4, 1, 5, 1, radix_cache=True)
        llm.engine.policy = PlainFor(10**6)
        if eager:
            eager_catch_up(llm)
        [first] = llm.engine.generate(PROMPTS[:1], [params])
        llm.engine.policy = None
        follow = [PROMPTS[0] + first.output_ids + PROMPTS[1]]
        [second] = llm.engine.generate(follow, [params])
        assert llm.engine.worker.reused_tokens >= len(PROMPTS[0]) + len(first.output_ids) - 2
        assert second.output_ids == reference(tiny_dirs, "llama", 1, follow, params)[0]
        seconds.append(second.metrics)
    assert seconds[0] == seconds[1] and seconds[0].accepted_tokens > 0


def test_a_backlog_never_grows_past_its_bound(tiny_dirs, draft_dirs):
    """The backlog holds fewer than chunked_prefill_size rows per request (its features take memory): past that the
    draft catches up at once, in extends of at most that many rows. After 12 plain rounds (the bound reached twice
    over) speculation resumes from a draft whose KV and state equal a fresh prefill's, losslessly."""
    prompts, params = PROMPTS[:3], SamplingParams(max_new_tokens=24, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, 2, 4, 1, radix_cache=False,
                   chunked_prefill_size=5)
    llm.engine.policy = PlainFor(12)
    calls = count_extends(llm)
    expected = reference(tiny_dirs, "llama", 1, prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    checker = DraftChecker(llm.engine, [p + out for p, out in zip(prompts, expected)])
    most, outputs = {}, {i: [] for i in range(len(prompts))}
    for step in llm.engine.stream(prompts, [params] * len(prompts)):
        for out in step:
            outputs[out.index] += out.new_ids
        for rid in range(len(prompts)):
            most[rid] = max(most.get(rid, 0), llm.engine.worker.backlog.behind(rid))
    assert sorted(most) == [0, 1, 2] and max(most.values()) < 5  # every request's backlog, at every step
    assert calls and all(rows <= 5 and not graph for graph, rows in calls)  # catch-ups, a bounded extend each
    assert checker.checked >= len(prompts)  # then speculation, every request from an exact draft
    assert [outputs[i] for i in range(len(prompts))] == [out[:24] for out in expected]
    assert not any(llm.engine.worker.backlog.behind(rid) for rid in range(len(prompts)))

