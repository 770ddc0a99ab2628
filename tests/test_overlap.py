"""The overlap schedule: the next decode round launched (in the worker's thread) before the last one's tokens
are handed out. Its output must equal the serial engine's token for token, whatever finishes, stops, aborts,
waits or is preempted in between, and every KV slot must come back."""

import random

import pytest
import torch
from conftest import all_slots_free
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_speculative import PROMPTS, reference

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

# (family, algorithm, draft, num_steps, topk, num_draft_tokens, page_size, batch size)
CASES = [
    ("llama", "EAGLE", "eagle", 4, 2, 6, 1, 8),
    ("qwen3", "EAGLE", "eagle", 3, 2, 6, 16, 7),  # a paged tree: kept KV moves on the device
    ("llama", "EAGLE3", "eagle3", 3, 1, 4, 16, 5),
    ("llama", "STANDALONE", "self", 4, 1, 5, 16, 8),
    ("qwen2", "STANDALONE", "self", 3, 3, 10, 1, 6),
    ("qwen3", "NGRAM", None, None, None, 8, 16, 8),
    ("qwen3", "NONE", None, None, None, None, 1, 4),
]


def both(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size, **extra):
    """The same engine settings without and with the overlap schedule."""
    directory = str(tiny_dirs[family][0])
    draft_path = directory if draft == "self" else (str(draft_dirs[family][draft]) if draft else None)
    extra = {"max_total_tokens": 4096, **extra}
    return [fastspec.LLM(directory, speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                         topk=topk, num_draft_tokens=n, page_size=page_size, overlap_schedule=mode, **extra)
            for mode in ("off", "on")]


def mixed_params(plain: list[list[int]], stop_every: int = 3) -> list[SamplingParams]:
    """Mixed lengths, and a stop token inside the output of every `stop_every`-th request."""
    return [SamplingParams(max_new_tokens=5 + 3 * i, ignore_eos=True,
                           stop_token_ids=(out[4 + i % 3],) if i % stop_every == 0 else ())
            for i, out in enumerate(plain)]


@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size, bs", CASES)
def test_overlap_equals_serial_with_mixed_lengths_and_stops(tiny_dirs, draft_dirs, family, algorithm, draft, steps,
                                                            topk, n, page_size, bs):
    prompts = PROMPTS[:bs]
    plain = reference(tiny_dirs, family, page_size, prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    params = mixed_params(plain)
    serial, overlap = both(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page_size)
    expected = serial.engine.generate(prompts, params)
    got = overlap.engine.generate(prompts, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert [o.metrics for o in got] == [o.metrics for o in expected]
    for o, out, sp in zip(got, plain, params):  # and both are the target's own greedy output, cut where it stops
        stop = next((i for i, t in enumerate(out) if t in sp.stop_token_ids), len(out))
        assert o.output_ids == out[: min(stop + 1, sp.max_new_tokens)]
    assert all_slots_free(overlap.engine)
    overlap.engine.check_kv()


def test_overlap_launches_the_next_round_before_handing_out_the_last(tiny_dirs, draft_dirs):
    """Not a timing: the order of events. With overlap, decode round k+1 is submitted before round k's tokens
    are handed out (for every round but the last); without it, never."""
    for llm in both(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 3, 1, 4, 1):
        engine, events = llm.engine, []
        submit, hand_out = engine.thread.submit, engine._hand_out
        engine.thread.submit = lambda fn, *a: events.append(fn.__name__) or submit(fn, *a)
        engine._hand_out = lambda *a: events.append("hand_out") or hand_out(*a)
        engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=24, ignore_eos=True)] * 2)
        # at each hand-out, how many steps were submitted and not yet handed out: 2 = the next one is in flight
        in_flight = [events[:i].count("step") - events[:i].count("hand_out") for i, e in enumerate(events)
                     if e == "hand_out"]
        ahead = in_flight.count(2)
        assert ahead > len(in_flight) // 2 if engine.overlap else ahead == 0, " ".join(events)


@pytest.mark.parametrize("algorithm, draft, page_size, pool", [("STANDALONE", "self", 16, 224),
                                                               ("EAGLE3", "eagle3", 1, 128), ("NGRAM", None, 4, 128)])
def test_overlap_under_preemption_and_chunked_prefill(tiny_dirs, draft_dirs, algorithm, draft, page_size, pool):
    """More work than the pool holds, prompts prefilled a few tokens per step, some requests sampled."""
    steps, topk, n = (3, 2, 5) if draft else (None, None, 6)
    params = [SamplingParams(max_new_tokens=10 + 5 * i, ignore_eos=True,
                             **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 3 == 1 else {}))
              for i in range(len(PROMPTS))]
    serial, overlap = both(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, page_size,
                           chunked_prefill_size=3, speculative_fallback=False, max_total_tokens=pool)
    expected = serial.engine.generate(PROMPTS, params)
    got = overlap.engine.generate(PROMPTS, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert overlap.engine.preemptions > 0
    assert all_slots_free(overlap.engine)


def consume_with_aborts(engine, prompts, params, abort_after: dict[int, int]) -> dict[int, list[int]]:
    """Stream, aborting request i once it has been handed `abort_after[i]` tokens (as a stop string would)."""
    got = {i: [] for i in range(len(prompts))}
    for step in engine.stream(prompts, params):
        for out in step:
            got[out.index] += out.new_ids
            if out.finish_reason is None and len(got[out.index]) >= abort_after.get(out.index, 1 << 30):
                engine.abort(out.index)
    return got


def test_aborts_mid_round_hand_out_the_same_tokens(tiny_dirs, draft_dirs):
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 6
    abort_after = {0: 1, 2: 5, 3: 9, 5: 14}
    serial, overlap = both(tiny_dirs, draft_dirs, "qwen2", "STANDALONE", "self", 3, 2, 6, 1)
    expected = consume_with_aborts(serial.engine, PROMPTS[:6], params, abort_after)
    got = consume_with_aborts(overlap.engine, PROMPTS[:6], params, abort_after)
    assert got == expected
    assert all_slots_free(overlap.engine)


def test_an_abandoned_overlapped_stream_returns_every_slot(tiny_dirs, draft_dirs):
    _, overlap = both(tiny_dirs, draft_dirs, "llama", "NGRAM", None, None, None, 6, 1)
    stream = overlap.engine.stream(PROMPTS[:3], [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3)
    for _ in range(4):  # prefill, then rounds with the next one in flight; then the consumer walks away
        next(stream)
    stream.close()
    assert all_slots_free(overlap.engine)


def test_the_load_after_the_last_step_reads_the_pool_as_it_is(tiny_dirs, draft_dirs):
    """What a server's /metrics reads once every request has finished: nothing running or waiting, and the whole
    pool free (the releases the worker's thread applies after the last hand-out counted; it read 19% in use)."""
    serial, overlap = both(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, 2, 4, 4, max_total_tokens=256)
    for llm in (serial, overlap):
        llm.engine.generate(PROMPTS[:4], [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)
        assert llm.engine.load.running == llm.engine.load.waiting == 0
        assert llm.engine.load.free_kv == llm.engine.worker.available_kv() == 256


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_random_workloads_overlap_equals_serial(tiny_dirs, draft_dirs, seed):
    """Random batch, lengths, stops, aborts and sampling: the same tokens handed out, every slot returned."""
    rng = random.Random(seed)
    bs = rng.randint(1, 8)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 14))] for _ in range(bs)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 16), ignore_eos=True,
                             stop_token_ids=tuple(rng.sample(range(97), rng.randint(0, 3))),
                             **({"temperature": 0.9, "seed": rng.randrange(99)} if rng.random() < 0.3 else {}))
              for _ in range(bs)]
    abort_after = {i: rng.randint(1, 10) for i in range(bs) if rng.random() < 0.3}
    llms = _random_workload_llms(tiny_dirs, draft_dirs)
    expected = consume_with_aborts(llms[0].engine, prompts, params, abort_after)
    got = consume_with_aborts(llms[1].engine, prompts, params, abort_after)
    assert got == expected
    assert all_slots_free(llms[1].engine)


_llms = {}


def _random_workload_llms(tiny_dirs, draft_dirs):
    if "random" not in _llms:
        _llms["random"] = both(tiny_dirs, draft_dirs, "llama", "EAGLE", "eagle", 3, 2, 5, 1,
                               max_running_requests=4, speculative_fallback=False)
    return _llms["random"]


@pytest.mark.commands
def test_contradicting_overlap_flags_are_one_line():
    from typer.testing import CliRunner

    from fastspec.cli import app

    result = CliRunner().invoke(app, ["generate", "--input-ids", "1,2", "--overlap-schedule", "on",
                                      "--disable-overlap-schedule"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--disable-overlap-schedule" in result.stderr and "--overlap-schedule" in result.stderr
    with pytest.raises(FastspecError, match="^overlap_schedule must be auto, on or off"):
        fastspec.LLM(overlap_schedule="sometimes")


@pytest.mark.parametrize("algorithm, draft, topk, n, page_size, launched_ahead", [
    ("STANDALONE", "self", 1, 4, 16, True), ("EAGLE", "eagle", 2, 6, 1, True), ("EAGLE", "eagle", 2, 6, 16, True),
    ("EAGLE3", "eagle3", 1, 4, 1, True), ("NGRAM", None, None, 6, 1, False)])
def test_the_worker_launches_a_round_before_reading_the_last(tiny_dirs, draft_dirs, algorithm, draft, topk, n,
                                                             page_size, launched_ahead):
    """Not a timing: under overlap, round K+1 of an EAGLE-family drafter is launched (from the future maps)
    before round K's accept result is read; NGRAM drafts from the tokens themselves and never is. Each launch
    ahead reads, for every request, the length and root round K wrote: checked against the host's values
    once K is finished."""
    serial, overlap = both(tiny_dirs, draft_dirs, "llama", algorithm, draft, 3 if draft else None, topk, n,
                           page_size, speculative_fallback=False)
    worker, events = overlap.engine.worker, []
    launch, finish = worker.spec_rounds.launch, worker.spec_rounds.finish

    def launched(reqs, params, before):
        events.append("ahead" if before is not None else "launch")
        if before is not None:  # what K+1 resolves == what K leaves on the host, once finished
            rows = torch.tensor([r.row for r in reqs])
            events.append((before, reqs, *worker.futures.resolve(rows)))
        return launch(reqs, params, before)

    def finished(p):
        out = finish(p)
        for e in [e for e in events if isinstance(e, tuple) and e[0] is p]:
            _, reqs, seq, root = e
            assert seq.tolist() == [r.seq_len for r in reqs]
            # the root: the last token, for the requests the round did not stop (their run is cut there)
            assert [t for t, r in zip(root.tolist(), reqs) if r.done is None] == \
                [r.produced[-1] for r in reqs if r.done is None]
            events.remove(e)
        return out

    worker.spec_rounds.launch, worker.spec_rounds.finish = launched, finished
    params = [SamplingParams(max_new_tokens=12 + 4 * i, ignore_eos=True) for i in range(4)]
    got = overlap.engine.generate(PROMPTS[:4], params)
    assert [o.output_ids for o in got] == [o.output_ids for o in serial.engine.generate(PROMPTS[:4], params)]
    ahead = events.count("ahead")
    assert (ahead > events.count("launch") if launched_ahead else ahead == 0), events
    assert not [e for e in events if isinstance(e, tuple)]  # every resolved round was checked
    assert all_slots_free(overlap.engine)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), max_size=8), min_size=1, max_size=12))
def test_future_maps_resolve_what_the_last_round_over_a_row_wrote(batches):
    """Rounds over arbitrary (filtered, reordered) batches of table rows: each row resolves to exactly what the
    last round that ran it wrote, never a later or an earlier round's value."""
    from fastspec.speculative.future import FutureMaps

    maps, last = FutureMaps(8, "cpu"), {}
    for k, rows in enumerate(batches):
        rows = list(dict.fromkeys(rows))  # a batch holds a row once
        if not rows:
            continue
        index = torch.tensor(rows)
        seq, root = maps.resolve(index)
        assert seq.tolist() == [last.get(r, (0, 0))[0] for r in rows]
        assert root.tolist() == [last.get(r, (0, 0))[1] for r in rows]
        maps.write(index, torch.tensor([100 * k + r for r in rows]), torch.tensor([k] * len(rows)))
        last.update({r: (100 * k + r, k) for r in rows})


def test_no_round_is_launched_after_the_budget_is_spent(tiny_dirs, draft_dirs):
    """A round launched ahead is wasted when the round in flight ends every request by max_new_tokens: such a
    round is not launched (nor one for a request with one token left), so overlap runs as many rounds as the
    serial engine for requests that end by length."""
    counts = []
    for llm in both(tiny_dirs, draft_dirs, "llama", "STANDALONE", "self", 3, 1, 4, 1, speculative_fallback=False):
        rounds, launched = llm.engine.worker.spec_rounds, []
        real = rounds.launch
        rounds.launch = lambda reqs, params, before: launched.append(len(reqs)) or real(reqs, params, before)
        for bs, new in ((1, 20), (3, 17)):
            llm.engine.generate(PROMPTS[:bs], [SamplingParams(max_new_tokens=new, ignore_eos=True)] * bs)
        counts.append(launched)
    assert len(counts[1]) == len(counts[0]), counts


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_fallback_switching_modes_under_overlap_is_lossless(tiny_dirs, draft_dirs, page_size):
    """Plain rounds (the measured fallback's choice) between rounds launched ahead: each plain round finishes
    the round in flight first; the output is the target's own, every slot comes back."""
    from test_policy import Alternating

    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    _, overlap = both(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, 2, 5, page_size)
    overlap.engine.policy = Alternating(1)
    outputs = overlap.engine.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", page_size, PROMPTS, params)
    assert all_slots_free(overlap.engine)
