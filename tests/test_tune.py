"""`fastspec tune`: replayed acceptance against the engine's own measurement, on a tiny target with a head
trained by train-draft (so drafts are accepted often enough for the comparison to mean something)."""

from __future__ import annotations

import json
import re
from pathlib import Path

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


def test_tuned_file_round_trips_and_guards_its_fingerprint(tmp_path):
    from fastspec.speculative.tuned import load_schedule, read_tuned, save_tuned

    path, print_ = tmp_path / "t.json", {"hardware": "cpu", "model": "a", "draft": "b", "dtype": "float32"}
    tiers = [{"max_batch_size": 1, "params": [5, 4, 8]}, {"max_batch_size": 4, "params": [3, 1, 4]},
             {"max_batch_size": 8, "params": None}]
    save_tuned(path, print_, tiers)
    assert load_schedule(path, print_) == (((1, SpecParams(5, 4, 8)), (4, SpecParams(3, 1, 4)), (8, None)), False)
    said = []
    assert load_schedule(path, print_ | {"hardware": "other"}, said.append) is None
    assert "hardware" in said[0]
    save_tuned(path, print_, [{"max_batch_size": 1, "params": None}])
    assert load_schedule(path, print_) == ((), True)  # every tier off: decode plainly
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temporary file left behind
    for damaged, why in ((json.dumps({"version": 1, "fingerprint": print_, "tiers": [
            {"max_batch_size": 1, "params": [2, 1, 7]}]}), "impossible tree"),
            ('{"version": 1, "fingerprint": {"hard', "unreadable"), ("[]", "unreadable"),
            (json.dumps({"version": 1, "tiers": []}), "no fingerprint")):
        path.write_text(damaged)
        said = []
        assert load_schedule(path, print_, said.append) is None  # ignored, with one note naming the file
        assert len(said) == 1 and str(path) in said[0] and why in said[0], said
        with pytest.raises(FastspecError, match=why):  # refused when asked for by name
            read_tuned(path)


def test_tune_end_to_end_on_the_tiny_target(chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    from fastspec.tune.tuner import TuneConfig, schedule_from, tune

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    cfg = TuneConfig(batch_sizes=(1, 3), max_steps=3, topks=(1, 2), max_draft_tokens=6, max_new_tokens=16,
                     confirm=2, budget=120)
    llm = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head), num_steps=3,
                       topk=2, num_draft_tokens=6, tuned=False)
    result = tune(llm, PROMPTS, cfg)
    assert set(result.winners) == {1, 3}
    for bs, winner in result.winners.items():
        tried = [c for c in result.confirmed if c.bs == bs]
        final = {c.params: c.measured for c in tried[-2:]}  # the last shape and plain: their medians
        assert None in final and len(final) == 2
        assert winner.measured == final[winner.params] == max(final.values())
    # the chosen schedule is lossless on new prompts
    schedule = schedule_from(result.winners)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = fastspec.LLM(model=str(chat_target), speculative_algorithm="NONE").generate(PROMPTS, params)
    if any(p is not None for _, p in schedule):
        tuned = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head),
                             schedule=schedule).generate(PROMPTS, params)
        assert [o.output_ids for o in tuned] == [o.output_ids for o in plain]


def test_cli_emits_sglang_flags_from_the_tuned_file_and_llm_loads_it(chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    from typer.testing import CliRunner

    from fastspec.cli import app
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    args = ["tune", "--model", str(chat_target), "--speculative-algorithm", "EAGLE3", "--draft", str(head),
            "--emit", "sglang", "--from-tuned"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "run fastspec tune first" in result.output
    tiers = [{"max_batch_size": 1, "params": [3, 2, 5]}, {"max_batch_size": 4, "params": None}]
    save_tuned(tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu"),
               tiers)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ("--speculative-num-steps 3 --speculative-eagle-topk 2 --speculative-num-draft-tokens 5"
            in result.output)
    path, print_ = tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu")
    save_tuned(path, print_ | {"hardware": "another machine"}, tiers)  # stale: refused, as the docs say
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "measured with a different hardware; run fastspec tune again" in result.stderr
    save_tuned(path, print_, tiers)
    llm = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head))
    assert llm.engine.spec.schedule == ((1, SpecParams(3, 2, 5)), (4, None))
    explicit = fastspec.LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head), topk=1)
    assert explicit.engine.spec.schedule == ()  # explicit tree flags win over the tuned file


def test_from_tuned_takes_quantization_none_on_a_quantised_target(chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    """--quantization none (dequantised) means the same to --from-tuned as to a plain tune: the float tuned file."""
    import shutil

    from quant_writers import quantise_dir
    from typer.testing import CliRunner

    from fastspec.cli import app
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    awq = shutil.copytree(chat_target, tmp_path / "awq")
    quantise_dir(awq, "awq")
    save_tuned(tuned_path(awq, head, "float32", "cpu"), fingerprint(awq, head, "float32", "cpu"),
               [{"max_batch_size": 1, "params": [2, 1, 3]}])
    result = CliRunner().invoke(app, ["tune", "--model", str(awq), "--speculative-algorithm", "EAGLE3", "--draft",
                                      str(head), "--emit", "sglang", "--from-tuned", "--quantization", "none"])
    assert result.exit_code == 0, result.output
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in result.output


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
     "--speculative-accept-threshold-single: fastspec tune measures greedy decoding"),
    (["--emit", "sglang", "--from-tuned", "--speculative-eagle-topk", "1"],
     "--speculative-eagle-topk: fastspec tune chooses the tree shapes itself (--from-tuned: the tuned file's)")])
def test_each_bad_tune_flag_is_named_in_one_line(flags, message):
    from typer.testing import CliRunner

    from fastspec.cli import app

    result = CliRunner().invoke(app, ["tune", *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output


@pytest.mark.parametrize("tiers, shapes", [([[1, [3, 2, 5]], [2, None]], ["3/2/5", "plain"]),
                                           ([[2, None]], ["plain", "plain"])])
def test_bench_names_the_shape_a_tuned_schedule_runs_at_each_batch_size(chat_target, head, prompt_file, tmp_path,
                                                                         monkeypatch, tiers, shapes):  # noqa: F811
    """bench's title and JSON named one shape (the schedule's maxima) for every batch size, and NONE where the
    tuned file decodes plainly at every batch size, while each batch size ran its own."""
    from typer.testing import CliRunner

    from fastspec.cli import app
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    save_tuned(tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu"),
               [{"max_batch_size": bs, "params": params} for bs, params in tiers])
    args = ["bench", "--model", str(chat_target), "--speculative-algorithm", "EAGLE3", "--draft", str(head),
            "--prompts", str(prompt_file), "--batch-sizes", "1,2", "--num-prompts", "2", "--max-new-tokens", "8",
            "--trials", "1", "--warmup", "0"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["algorithm"] == "EAGLE3" and report["config"]["tuned"] is True
    assert [r["shape"] for r in report["results"]] == shapes
    assert [r["tau"] >= 1 for r in report["results"]] == [s != "plain" for s in shapes]
    title = " ".join(CliRunner().invoke(app, args).stdout.split())  # (wrapped to the table's width)
    assert f"fastspec bench · EAGLE3 tuned (bs 1: {shapes[0]} · bs 2: {shapes[1]}) vs no speculation" in title


def test_the_schedule_is_printed_as_shapes_per_batch_size():
    from fastspec.tune.tuner import describe_schedule

    assert describe_schedule(((1, SpecParams(3, 2, 5)), (4, None))) == (
        "bs <= 1: 3/2/5 · bs <= 4: plain (steps/topk/draft tokens; larger batches: the last)")


def test_tuned_files_are_one_per_model_whatever_its_folder_is_called(tmp_path, monkeypatch):
    """Two folders named alike, `--model .` and hub snapshots each get their own file, found again for the same
    model."""
    from fastspec.speculative.tuned import tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    a, b, head = tmp_path / "a" / "target", tmp_path / "b" / "target", tmp_path / "head"
    snapshots = [tmp_path / "hub" / "models--org--tiny" / "snapshots" / rev for rev in ("abc123", "def456")]
    for d in (a, b, head, *snapshots):
        d.mkdir(parents=True)
    names = [tuned_path(d, head, "float32", "cpu").name for d in (a, b, *snapshots)]
    assert len(set(names)) == 4 and names[0].startswith("target-") and names[2].startswith("tiny-")
    monkeypatch.chdir(a)
    here = tuned_path(Path("."), head, "float32", "cuda:1")
    assert here.name.startswith("target-") and here == tuned_path(a, head, "float32", "cuda")


def test_a_draft_the_schedule_never_uses_at_the_engines_batch_sizes_is_not_loaded(chat_target, head, tmp_path,
                                                                                   monkeypatch):  # noqa: F811
    """A tuned file that decodes plainly at batch 1 and a chat (one request at a time): the draft is never
    loaded, the banner still says what was tuned, and the output is plain decoding's."""
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path
    from fastspec.text.conversation import decoding

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    save_tuned(tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu"),
               [{"max_batch_size": 1, "params": None}, {"max_batch_size": 4, "params": [3, 2, 5]}])
    kwargs = dict(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head))
    alone = fastspec.LLM(**kwargs, max_running_requests=1)
    assert not alone.engine.spec.enabled and alone.engine.worker.draft_model is None
    assert decoding(alone.planned_spec, False) == "EAGLE3 · plain at batch 1 (tuned)"
    batched = fastspec.LLM(**kwargs, max_running_requests=4)
    assert batched.engine.spec.schedule == ((1, None), (4, SpecParams(3, 2, 5)))
    assert batched.engine.worker.draft_model is not None
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = fastspec.LLM(model=str(chat_target), speculative_algorithm="NONE").generate(PROMPTS[:1], params)
    assert alone.generate(PROMPTS[:1], params)[0].output_ids == plain[0].output_ids


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
