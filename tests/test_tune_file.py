"""The tuned file `fastspec tune` writes: its format and fingerprint, where it lives, and how `--from-tuned`, the
LLM and bench load it (the tuner that chooses its shapes: test_tune.py). A random head drafts here: these tests
read which shape runs where, never how often a draft is accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import chat_target, prompt_file  # noqa: F401  (fixtures)
from test_tune import PROMPTS

import fastspec
from fastspec.errors import FastspecError
from fastspec.models.heads import write_random_head
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


@pytest.fixture(scope="module")
def head(chat_target, tmp_path_factory):  # noqa: F811
    config = json.loads((chat_target / "config.json").read_text())
    return write_random_head(tmp_path_factory.mktemp("tune-file-head") / "head", config["hidden_size"],
                             config["vocab_size"], "eagle3")


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
            (json.dumps({"version": 1, "tiers": [{"max_batch_size": 1, "params": None}]}), "no fingerprint"),
            (json.dumps({"version": 1, "fingerprint": print_, "tiers": []}), "tiers must be a non-empty list")):
        path.write_text(damaged)
        said = []
        assert load_schedule(path, print_, said.append) is None  # ignored, with one note naming the file
        assert len(said) == 1 and str(path) in said[0] and why in said[0], said
        with pytest.raises(FastspecError, match=why):  # refused when asked for by name
            read_tuned(path)


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
    assert f"fastspec bench · EAGLE3 tuned (bs 1: {shapes[0]} · bs 2: {shapes[1]}) vs plain" in title


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
    save_tuned(tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu"),
               [{"max_batch_size": 4, "params": None}])  # plain at every batch size: no speculation is planned
    never = fastspec.LLM(**kwargs, max_running_requests=1)
    assert decoding(never.planned_spec, False, never.tuned_schedule == ()) == "plain decoding (tuned)"


def test_a_file_measured_under_other_engine_settings_is_used_with_one_note(chat_target, head, tmp_path,
                                                                           monkeypatch):  # noqa: F811
    """The graphs, page size, attention backend and graph buckets shift a round's cost, not what is decoded: a file
    measured under others still sets the schedule, and one note names each that differs. A file written before it
    recorded them (or recording them damaged) says nothing of them."""
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    path, print_ = tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu")
    tiers = [{"max_batch_size": 1, "params": [3, 2, 5]}]
    kwargs = dict(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(head))
    for recorded, note in (({"graphs": "compile", "page_size": 2, "attention_backend": "torch"},
                            "--graphs compile (here eager), --page-size 2 (here 1): its shapes may not be the fastest"),
                           ({"graphs": "eager", "page_size": 1, "attention_backend": "torch"}, None),
                           ({"graph_buckets": [1, 2, 4]}, "--cuda-graph-bs / --cuda-graph-max-bs, graphs run at "
                                                           "bs 1: 1 (here bs 1: eager): its shapes may not be the "
                                                           "fastest"),
                           ({"graph_buckets": None}, None),
                           (None, None), ("damaged", None)):
        save_tuned(path, print_, tiers, recorded)
        said = []
        llm = fastspec.LLM(**kwargs, say=said.append)
        assert llm.tuned_schedule == ((1, SpecParams(3, 2, 5)),)
        assert said == ([] if note is None else [f"tuned file {path} was measured with {note} here; fastspec tune "
                                                 "with this run's flags measures them"]), said
        assert ("settings" in json.loads(path.read_text())) == (recorded is not None)


def test_graph_buckets_differ_only_where_a_tuned_batch_size_runs_in_another_graph():
    """A tuned batch size's cost depends on the graph it runs in (the smallest bucket holding it, beyond the largest:
    eager), not on buckets no tuned size uses: a larger --max-running-requests adds buckets and says nothing."""
    from fastspec.graphs import default_buckets
    from fastspec.speculative.tuned import other_settings

    data = {"settings": {"graph_buckets": default_buckets(8)},
            "tiers": [{"max_batch_size": 1, "params": [3, 2, 5]}, {"max_batch_size": 8, "params": None}]}
    assert other_settings(data, {"graph_buckets": default_buckets(48)}) is None
    assert other_settings(data, {"graph_buckets": [1, 2, 4, 16]}) == (
        "--cuda-graph-bs / --cuda-graph-max-bs, graphs run at bs 1: 1, bs 8: 8 (here bs 1: 1, bs 8: 16)")
    assert other_settings(data, {"graph_buckets": [1, 2, 4]}).endswith("(here bs 1: 1, bs 8: eager)")
    assert other_settings(data | {"settings": {"graph_buckets": "damaged"}}, {"graph_buckets": None}) is None


def test_bench_profile_profiles_a_tuned_plain_tier_as_the_plain_step_it_runs(chat_target, head, tmp_path,
                                                                              monkeypatch):  # noqa: F811
    """bench --profile refused a tuned file whose tier at a batch size decodes plainly ("no speculative rounds
    ran"), though that is the tuned configuration's choice there: that batch size profiles the plain step the tuned
    engine runs, named so, and the others their rounds."""
    from typer.testing import CliRunner

    from fastspec.cli import app
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    save_tuned(tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu"),
               [{"max_batch_size": 1, "params": None}, {"max_batch_size": 2, "params": [2, 1, 3]}])
    args = ["bench", "--profile", "--model", str(chat_target), "--speculative-algorithm", "EAGLE3", "--draft",
            str(head), "--batch-sizes", "1,2"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = [(p["batch_size"], p["name"], "draft" in p["gemm_kernels"]) for p in json.loads(result.stdout)["profile"]]
    assert rows == [(1, "plain step", False), (1, "plain step of the tuned schedule", False),
                    (2, "plain step", False), (2, "speculative round", True)]
