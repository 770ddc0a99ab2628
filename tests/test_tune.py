"""`fastspec tune`: replayed acceptance against the engine's own measurement, on a tiny target with a head
trained by train-draft (so drafts are accepted often enough for the comparison to mean something); the tuner's
choices and its flags. The tuned file it writes, and how commands load it: test_tune_file.py."""

from __future__ import annotations

import json
import re

import pytest
from conftest import all_slots_free
from test_train import chat_target, prompt_file, tiny_config  # noqa: F401  (fixtures)

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecParams
from fastspec.train.trainer import train_draft
from fastspec.tune.replay import candidate_params, record, replay_tau

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

PROMPTS = [[1, 5, 9, 13, 40], [1, 40, 41], [1, 7, 7, 8, 22, 60, 61], [1, 33]]
NEW = 40


@pytest.fixture(scope="module")
def head(chat_target, prompt_file, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tune-head") / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=20))
    return out


def test_end_to_end_candidates_span_several_tree_sizes():
    """The confirmed shapes hedge the cost model: the best predicted per num_draft_tokens first, then the rest."""
    from fastspec.tune.tuner import Candidate, _diverse

    shapes = [(2, 4, 7), (2, 8, 7), (3, 4, 7), (2, 4, 4), (2, 2, 4), (2, 4, 8)]  # best predicted first
    ranked = [Candidate(4, SpecParams(*p), 1.5, 40.0 - i) for i, p in enumerate(shapes)]
    picked = [c.params for c in _diverse(ranked, 3)]
    assert picked == [SpecParams(2, 4, 7), SpecParams(2, 4, 4), SpecParams(2, 4, 8)]
    assert [c.params for c in _diverse(ranked[:3], 3)] == [SpecParams(*p) for p in shapes[:3]]  # one N: by rank


def test_candidate_params_are_the_feasible_trees():
    params = candidate_params(3, (1, 2), 6)
    assert SpecParams(3, 1, 4) in params and SpecParams(2, 1, 4) not in params  # topk 1: chains only
    assert [p.num_draft_tokens for p in params if p.topk == 2 and p.num_steps == 1] == [2, 3]  # 2 nodes + root
    assert max(p.num_draft_tokens for p in params) == 6


def test_replayed_tau_equals_the_engine_exactly(chat_target, head):  # noqa: F811
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = fastspec.LLM(model=str(chat_target), speculative_algorithm="NONE").generate(PROMPTS, params)
    probe = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                         num_steps=4, topk=3, num_draft_tokens=10)
    engine = probe.engine
    grid = candidate_params(4, (1, 3), 10)
    recorded = [record(engine.model, engine.drafter.model, engine.drafter.hot_token_id, engine.feature,
                       o.prompt_ids, o.output_ids, grid) for o in plain]
    checked = 0
    for p in (SpecParams(4, 1, 5), SpecParams(2, 1, 3), SpecParams(4, 3, 10), SpecParams(3, 3, 6)):
        llm = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                           num_steps=p.num_steps, topk=p.topk, num_draft_tokens=p.num_draft_tokens)
        outs = llm.generate(PROMPTS, params)
        assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
        rounds = sum(o.metrics.verify_rounds for o in outs)
        emitted = sum(o.metrics.emitted_tokens for o in outs)
        assert replay_tau(recorded, p) == (rounds, emitted), p
        checked += emitted > rounds  # some drafts were accepted: the comparison is not vacuous
    assert checked >= 2


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_batch_size_schedule_switches_tree_shapes_losslessly(chat_target, head, overlap):  # noqa: F811
    """Tiers: bs 1 a chain, bs 2 plain, bs 3+ a tree; requests of different lengths finish at different
    times, so rounds move between all three tiers while requests keep their draft state (under overlap, a round
    launched ahead may take another tier's shape than the round in flight)."""
    from fastspec.spec_config import SpecConfig

    prompts = PROMPTS + [[1, 70, 71, 72]]
    lengths = [64, 8, 25, 14, 33]  # the longest runs alone for a while: every tier is used
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    plain = fastspec.LLM(model=str(chat_target), speculative_algorithm="NONE").generate(prompts, params)
    schedule = ((1, SpecParams(4, 1, 5)), (2, None), (8, SpecParams(3, 3, 6)))
    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model=str(head)).with_schedule(schedule)
    assert (spec.num_steps, spec.topk, spec.num_draft_tokens) == (4, 3, 6) and spec.params_for(2) is None
    scheduled = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                             schedule=schedule, overlap_schedule=overlap)
    seen = []
    for p, d in scheduled.engine.drafters.items():
        real = d.draft
        d.draft = lambda batch, real=real, p=p: seen.append((batch.size, p)) or real(batch)
    outs = scheduled.generate(prompts, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    assert {p for _, p in seen} == {SpecParams(4, 1, 5), SpecParams(3, 3, 6)}
    assert all((bs == 1) == (p.topk == 1) and bs != 2 for bs, p in seen)
    assert all_slots_free(scheduled.engine)


def test_tune_end_to_end_on_the_tiny_target(chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    from fastspec.tune.tuner import MIN_MARGIN, TuneConfig, schedule_from, tune

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    cfg = TuneConfig(batch_sizes=(1, 3), max_steps=3, topks=(1, 2), max_draft_tokens=6, max_new_tokens=16,
                     confirm=2, budget=120)
    llm = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head), num_steps=3,
                       topk=2, num_draft_tokens=6, tuned=False)
    result = tune(llm, PROMPTS, cfg)
    assert set(result.winners) == {1, 3} == set(result.why)
    for bs, winner in result.winners.items():
        tried = [c for c in result.confirmed if c.bs == bs]
        final = {c.params: c.measured for c in tried[-2:]}  # the last shape and plain: their medians
        assert None in final and len(final) == 2
        assert winner.measured == final[winner.params]
        shape = next(p for p in final if p is not None)
        margin = float(re.search(r"noise margin ([0-9.]+)%", result.why[bs]).group(1)) / 100
        assert result.why[bs].startswith(f"{shape.shape} ") and margin >= MIN_MARGIN
        if winner.params is None:  # plain: the tree was slower, or faster by no more than the noise (as said)
            assert final[shape] <= final[None] * (1 + margin) * 1.001
            assert result.why[bs].endswith("within noise, plain kept" if final[shape] > final[None] else "faster")
        else:  # a tree replaces plain only when faster by more than the margin
            assert final[shape] > final[None] * (1 + margin) * 0.999 and result.why[bs].endswith("beyond the noise")
        # the final rematch runs full length, the halving rounds before it fewer tokens; each row says which
        assert [c.measured_tokens for c in tried[-2:]] == [16, 16] and min(c.measured_tokens for c in tried) == 8
        finalist = next(c for c in tried[-2:] if c.params is not None)  # its tau: a full-length run's, as the
        batch = [PROMPTS[i % len(PROMPTS)] for i in range(bs)]  # engine counts it alone
        alone = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                             schedule=((1 << 30, finalist.params),), tuned=False)
        outs = alone.engine.generate(batch, [SamplingParams(max_new_tokens=16, ignore_eos=True)] * bs)
        assert finalist.measured_tau == pytest.approx(sum((o.metrics for o in outs[1:]), outs[0].metrics).tau)
    # the chosen schedule is lossless on new prompts
    schedule = schedule_from(result.winners)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = fastspec.LLM(model=str(chat_target), speculative_algorithm="NONE").generate(PROMPTS, params)
    if any(p is not None for _, p in schedule):
        tuned = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                             schedule=schedule).generate(PROMPTS, params)
        assert [o.output_ids for o in tuned] == [o.output_ids for o in plain]


def _measured(shape: str | None, rate: float):
    from fastspec.tune.tuner import Candidate

    params = None if shape is None else SpecParams(*map(int, shape.split("/")))
    return Candidate(1, params, 1.0, rate, measured=rate)


@pytest.mark.parametrize("rates, margin, order", [
    ({None: 100, "3/1/4": 102}, 0.03, [None, "3/1/4"]),  # +2%: a coin toss, plain kept
    ({None: 100, "3/1/4": 104}, 0.03, ["3/1/4", None]),  # +4%: beyond the margin
    ({None: 100, "3/1/4": 104}, 0.05, [None, "3/1/4"]),  # ... but not beyond a 5% spread
    ({None: 100, "3/1/4": 90}, 0.03, [None, "3/1/4"]),
    ({"2/1/3": 100, "3/2/6": 102, "5/2/8": 110}, 0.03, ["5/2/8", "2/1/3", "3/2/6"]),
    ({"2/1/3": 99, "3/2/6": 102, "5/2/8": 103}, 0.03, ["3/2/6", "5/2/8", "2/1/3"]),  # 103 ties 102 (not 99)
    ({"3/2/6": 102, "2/1/3": 100}, 0.0, ["3/2/6", "2/1/3"])])  # no margin: by rate alone
def test_a_larger_candidate_replaces_a_simpler_one_only_beyond_the_margin(rates, margin, order):
    from fastspec.tune.tuner import rank

    ranked = rank([_measured(shape, rate) for shape, rate in rates.items()], margin)
    assert [None if c.params is None else c.params.shape for c in ranked] == order


def test_the_rematch_margin_is_the_runs_spread_or_the_minimum_and_says_why():
    from fastspec.tune.tuner import MIN_MARGIN, spread, verdict

    assert spread([100.0]) == 0 and spread([98.0, 100.0, 104.0]) == pytest.approx(0.06)
    plain = _measured(None, 100)
    for rate, margin, winner, why in (
            (102, MIN_MARGIN, None, "3/1/4 +2.0% vs plain, noise margin 3.0%: within noise, plain kept"),
            (104, MIN_MARGIN, "3/1/4", "3/1/4 +4.0% vs plain, noise margin 3.0%: faster beyond the noise"),
            (104, 0.06, None, "3/1/4 +4.0% vs plain, noise margin 6.0%: within noise, plain kept"),
            (95, MIN_MARGIN, None, "3/1/4 -5.0% vs plain, noise margin 3.0%: plain is faster")):
        chosen, said = verdict(_measured("3/1/4", rate), plain, margin)
        assert (None if chosen.params is None else chosen.params.shape, said) == (winner, why)


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "0"], "--batch-sizes must all be >= 1, got '0'"),
    (["--batch-sizes", "1,4,1"], "--batch-sizes names a batch size twice: '1,4,1'"),
    (["--batch-sizes", "1,,2"], "--batch-sizes must be comma-separated integers, got '1,,2'"),
    (["--batch-sizes", "1,2,"], "--batch-sizes must be comma-separated integers"),
    (["--budget", "0"], "--budget must be > 0, got 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 8, got 0"),
    (["--speculative-num-steps", "2"], "--speculative-num-steps: fastspec tune chooses the tree shapes itself; drop"),
    (["--speculative-accept-threshold-single", "0.5"],  # (greedy acceptance never reads it; the file would not say)
     "--speculative-accept-threshold-single is not used: fastspec tune measures greedy decoding"),
    (["--speculative-fallback"], "--speculative-fallback: fastspec tune measures with it off (it times each tree"),
    (["--radix-cache"], "--radix-cache: fastspec tune measures with it off (its runs repeat the same prompts"),
    (["--batch-sizes", "1,4", "--max-running-requests", "2"],
     "--max-running-requests 2 is below the largest --batch-sizes, 4: tune runs batches of each size"),
    (["--emit", "sglang", "--from-tuned", "--speculative-eagle-topk", "1"],
     "--speculative-eagle-topk: fastspec tune chooses the tree shapes itself (--from-tuned: the tuned file's)")])
def test_each_bad_tune_flag_is_named_in_one_line(flags, message, monkeypatch):
    from typer.testing import CliRunner

    import fastspec.llm
    import fastspec.tune.tuner
    from fastspec.cli import app

    def no_tune(*args, **kwargs):  # a refusal that broke fails here at once, not after a real tune
        raise AssertionError(f"tune went on past {flags}")

    monkeypatch.setattr(fastspec.llm.LLM, "__init__", no_tune)
    monkeypatch.setattr(fastspec.tune.tuner, "tune", no_tune)
    result = CliRunner().invoke(app, ["tune", *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output


def test_the_schedule_is_printed_as_shapes_per_batch_size():
    from fastspec.tune.tuner import describe_schedule

    assert describe_schedule(((1, SpecParams(3, 2, 5)), (4, None))) == (
        "bs <= 1: 3/2/5 · bs <= 4: plain (steps/topk/draft tokens; larger batches: the last)")


def test_tune_tries_deeper_and_wider_trees_on_a_gpu_and_refuses_a_budget_spent_before_confirming(
        chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    from fastspec.tune.tuner import TuneConfig, tune

    assert (TuneConfig.for_device("cuda:0").max_draft_tokens, TuneConfig.for_device("cuda").max_steps) == (32, 8)
    assert TuneConfig.for_device("cpu") == TuneConfig() and TuneConfig.for_device("cuda", max_steps=3).max_steps == 3
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    cfg = TuneConfig(batch_sizes=(1,), max_steps=2, topks=(1,), max_draft_tokens=3, max_new_tokens=8, budget=1e-3)
    llm = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head), num_steps=2,
                       topk=1, num_draft_tokens=3, tuned=False)
    with pytest.raises(FastspecError, match=r"--budget 0.001 s was spent before any tree shape could be confirmed"
                       ) as refused:
        tune(llm, PROMPTS[:2], cfg)
    took = float(re.search(r"costs took ([0-9.]+) s", str(refused.value)).group(1))
    assert took > 0  # (whole seconds said "took 0 s" of a budget it had overrun)


def test_tune_runs_under_the_engine_flags_it_can_honour_and_records_its_settings(chat_target, head, prompt_file,
                                                                                tmp_path, monkeypatch):  # noqa: F811
    """--max-running-requests (at least the largest batch size) sizes tune's engine; the fallback and the prefix
    cache typed off are what it measures with anyway (typed on: refused in one line, above). The tuned file records
    the graphs, page size, attention backend and graph buckets its costs were measured under, and the table each
    row's run length. (A budget no loaded machine spends: the end-to-end stage's few 8-token runs end it.)"""
    from typer.testing import CliRunner

    import fastspec.llm
    from fastspec.cli import app
    from fastspec.speculative.tuned import tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    built = []

    class Recorded(fastspec.llm.LLM):
        def __init__(self, **kwargs):
            built.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(fastspec.llm, "LLM", Recorded)
    result = CliRunner().invoke(app, [
        "tune", "--model", str(chat_target), "--speculative-algorithm", "EAGLE3", "--draft", str(head), "--prompts",
        str(prompt_file), "--num-prompts", "2", "--batch-sizes", "1,2", "--max-new-tokens", "8", "--budget", "3600",
        "--max-running-requests", "3", "--disable-radix-cache", "--no-speculative-fallback", "--page-size", "2"])
    assert result.exit_code == 0, result.output
    assert [(k["max_running_requests"], k["radix_cache"], k["speculative_fallback"], k["page_size"])
            for k in built] == [(3, False, False, 2)]
    saved = json.loads(tuned_path(chat_target, head, "float32", "cpu").read_text())
    assert saved["settings"] == {"graphs": "eager", "page_size": 2, "attention_backend": "torch",
                                 "graph_buckets": None}  # (eager: no graph, whatever the buckets)
    assert all(t["measured_tokens"] == 8 and "noise margin" in t["why"] for t in saved["tiers"])
    assert "bs 2: " in result.stdout and "noise margin" in result.stdout  # the table's caption: each verdict
    header = next(line for line in result.stdout.splitlines() if "measured tau" in line)
    assert "tokens" in header and "chosen" in header
