"""`fastspec bench` on the embedded model: its --json report, its table in 80 columns, a bad prompts file named by
line, `--profile`'s split of a step by category (and profile_step's arithmetic over scripted runs), and --url
refusing the flags of a model loaded here."""

import json

import pytest
from typer.testing import CliRunner

from fastspec.benchmark.profile import CATEGORIES
from fastspec.cli import app

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_bench_json_shape():
    result = CliRunner().invoke(app, ["bench", "--batch-sizes", "1,2", "--max-new-tokens", "6", "--num-prompts", "3",
                                      "--trials", "1", "--warmup", "0", "--speculative-algorithm", "NGRAM",
                                      "--max-total-tokens", "4096", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    # the prompts given, and the requests each batch size ran (cycled to fill every batch: 3 prompts -> 2 batches of 2)
    assert report["config"]["num_prompts"] == 3 and [r["requests"] for r in report["results"]] == [3, 4]
    for r in report["results"]:
        assert r["baseline_tok_s"] > 0 and r["spec_tok_s"] > 0 and r["tau"] >= 1
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["baseline_tok_s"], rel=0.01)
    assert report["config"]["algorithm"] == "NGRAM" and "no speculation" not in result.stderr


def test_bench_says_when_no_speculation_was_asked_for():
    """--speculative-algorithm NONE benches plain against plain: the table read as a speedup (noise) and tau 0.00
    with nothing said (found by the QA pass of bench)."""
    result = CliRunner().invoke(app, ["bench", "--batch-sizes", "1", "--max-new-tokens", "4", "--num-prompts", "1",
                                      "--trials", "1", "--warmup", "0", "--speculative-algorithm", "NONE",
                                      "--max-total-tokens", "1024", "--json"])
    assert result.exit_code == 0, result.output
    assert "NONE: no speculation, so both columns decode plainly" in result.stderr


def test_bench_table_fits_80_columns_with_every_figure_whole(capsys, monkeypatch):
    """An 80-column terminal shows each figure whole (rich cut them to `1234…` before): acceptance at four depths in
    percent, the round's split in tenths of a millisecond."""
    from types import SimpleNamespace

    from fastspec.cli.bench import print_bench_table

    monkeypatch.setenv("COLUMNS", "80")
    row = SimpleNamespace(batch_size=16, baseline_tok_s=1234.5, spec_tok_s=12345.6, speedup=10.0, tau=2.31,
                          spec_tok_s_per_request=771.6, acceptance_by_depth=[0.91, 0.72, 0.55, 0.41, 0.3],
                          ms_per_round={"draft": 0.48, "verify": 12.91, "draft_extend": 0.49, "catch_up": 0.33,
                                        "host": 0.12}, rounds={"speculative": 40.0, "plain": 0.0})
    print_bench_table({"algorithm": "EAGLE3", "num_steps": 5, "topk": 4, "num_draft_tokens": 8}, [row])
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 80 and "…" not in out
    for figure in ("1234.5", "12345.6", "10.00x", "771.6", "2.31", "91 72 55 41", "0.5·12.9·0.5·0.3·0.1"):
        assert figure in out, figure


def test_bench_table_shows_no_round_figures_where_no_speculative_round_ran(capsys, monkeypatch):
    """A batch size that decoded plainly (a tuned file's plain tier, or the fallback at every step) ran no round:
    its tau, acceptance and round split are '-', not 'tau 0.00' and '0.0·0.0·0.0·0.0' beside a tree's row."""
    from types import SimpleNamespace

    from fastspec.cli.bench import print_bench_table

    monkeypatch.setenv("COLUMNS", "80")
    rows = [SimpleNamespace(batch_size=1, baseline_tok_s=700.0, spec_tok_s=690.0, speedup=0.99, tau=0.0, shape="plain",
                            spec_tok_s_per_request=690.0, acceptance_by_depth=[], ms_per_round={"host": 0.0},
                            rounds={"speculative": 0.0, "plain": 8.0}),
            SimpleNamespace(batch_size=2, baseline_tok_s=1400.0, spec_tok_s=1500.0, speedup=1.07, tau=3.5,
                            shape="3/2/9", spec_tok_s_per_request=750.0, acceptance_by_depth=[1.0, 0.5],
                            ms_per_round={"draft": 1.2, "verify": 1.4, "draft_extend": 0.6, "catch_up": 0.4,
                                          "host": 0.8}, rounds={"speculative": 3.0, "plain": 0.0})]
    print_bench_table({"algorithm": "EAGLE3", "tuned": True}, rows)
    plain, tree = (line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith(("1 ", "2 ")))
    assert "0.00" not in plain and "0.0·0.0" not in plain and plain.split()[-5:] == ["-", "-", "-", "(no", "rounds)"]
    assert "3.50" in tree and "100 50" in tree and "1.2·1.4·0.6·0.4·0.8" in tree


def test_bench_reports_the_bad_jsonl_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": 3}\n')
    result = CliRunner().invoke(app, ["bench", "--prompts", str(bad), "--max-total-tokens", "1024"])
    assert result.exit_code == 2 and f"{bad}:2:" in result.stderr


def test_bench_profile_splits_a_plain_step_and_a_round_by_category():
    # (the fallback typed off and --max-running-requests typed at the largest batch size are what it runs with)
    result = CliRunner().invoke(app, ["bench", "--profile", "--batch-sizes", "1", "--max-total-tokens", "4096",
                                      "--no-speculative-fallback", "--max-running-requests", "1", "--json"])
    assert result.exit_code == 0, result.output
    plain, spec = json.loads(result.stdout)["profile"]
    assert (plain["name"], spec["name"]) == ("plain step", "speculative round")
    for p in (plain, spec):
        assert p["device"] == "cpu" and p["batch_size"] == 1 and p["ms_per_step"] > 0 and p["launches_per_step"] > 0
        by = p["ms_by_category"]
        assert list(by) == list(CATEGORIES)
        assert by["gemm"] > 0 and by["attention"] >= 0  # (a small category's difference of two runs reads as 0 on
        # a loaded machine: the split's arithmetic over each category is test_profile_step_is_the_difference...'s)
        assert sum(by.values()) <= p["ms_per_step"] * 1.05  # operator self times are parts of the wall time
        # the host's share is the wall time the categories leave, but for rounding and for a category whose
        # difference came out negative on a busy machine (it reads as 0, so the categories leave less)
        left = max(0.0, 1 - sum(by.values()) / p["ms_per_step"])
        assert left - 0.005 <= p["host_share"] <= left + 0.05
    assert plain["gemm_kernels"]["target"] and "draft" not in plain["gemm_kernels"]
    assert sum(spec["gemm_kernels"]["draft"].values()) >= 3  # the EAGLE-3 head's fc, attention and MLP projections
    assert plain["steps"] == 16  # the two profiled runs are 16 tokens apart
    assert spec["steps"] == int(spec["steps"]) and 1 <= spec["steps"] <= 16  # whole rounds, a token at least each


def test_profile_step_is_the_difference_of_two_runs_per_step(monkeypatch):
    """profile_step's arithmetic over two scripted recordings (short, long): (wall s, device-busy s, seconds by
    category, launches, verify rounds)."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from fastspec.benchmark import profile

    runs = {4: (0.30, 0.20, Counter(gemm=0.10, attention=0.05, sampling=0.01, copies=0.04), 400, 6),
            20: (1.10, 0.84, Counter(gemm=0.50, attention=0.21, sampling=0.05, copies=0.02, other=0.06), 1200, 22)}
    monkeypatch.setattr(profile, "_generate", lambda *args: None)
    monkeypatch.setattr(profile, "_recorded", lambda llm, prompt, bs, tokens: runs[tokens])
    for enabled, per in ((False, 16), (True, 8)):  # plain: the 16 tokens asked for; speculative: 16 rounds / bs 2
        worker = SimpleNamespace(model=torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2)),
                                 draft_model=torch.nn.Linear(2, 2, dtype=torch.bfloat16))
        spec = SimpleNamespace(enabled=enabled, params_for=lambda bs: "a tree")  # (speculates at every batch size)
        engine = SimpleNamespace(spec=spec, config=SimpleNamespace(device="cpu"), worker=worker)
        p = profile.profile_step(SimpleNamespace(engine=engine), [1, 2, 3], bs=2, steps=16)
        assert (p.device, p.steps) == ("cpu", per)
        assert p.ms_per_step == pytest.approx(800 / per, abs=1e-3) and p.launches_per_step == 800 / per
        expected = {"gemm": 400, "attention": 160, "norm/elementwise": 0, "copies": 0, "sampling": 40, "other": 60}
        assert p.ms_by_category == pytest.approx({c: ms / per for c, ms in expected.items()}, abs=1e-3)  # copies < 0
        assert p.host_share == pytest.approx(1 - 0.64 / 0.80, abs=1e-3)  # wall time without a recorded operator
        draft = {"draft": {"F.linear bfloat16": 1}} if enabled else {}
        assert p.gemm_kernels == {"target": {"F.linear float32": 2}} | draft


def test_profile_step_takes_each_lengths_fastest_run(monkeypatch):
    """A stall in one short run (a busy machine) would make the difference negative: each length's fastest of its
    three runs is used."""
    from collections import Counter
    from types import SimpleNamespace

    import torch

    from fastspec.benchmark import profile

    walls = iter([2.0, 1.1, 0.3, 1.2, 0.35, 1.15])  # short, long, short, long, ...: the first short run stalled
    monkeypatch.setattr(profile, "_generate", lambda *args: None)
    monkeypatch.setattr(profile, "_recorded", lambda llm, prompt, bs, tokens: (next(walls), 0.1, Counter(), 10, 0))
    worker = SimpleNamespace(model=torch.nn.Linear(2, 2), draft_model=None)
    engine = SimpleNamespace(spec=SimpleNamespace(enabled=False), config=SimpleNamespace(device="cpu"), worker=worker)
    p = profile.profile_step(SimpleNamespace(engine=engine), [1, 2, 3], bs=1, steps=16)
    assert p.ms_per_step == pytest.approx((1.1 - 0.3) / 16 * 1e3, abs=1e-3)


@pytest.mark.parametrize("flags, named", [(["--profile"], "--profile is"), (["--batch-sizes", "1"], "--batch-sizes is"),
                                          (["--trials", "3", "--quantization", "none"], "--trials, --quantization are"),
                                          (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm is")])
def test_bench_url_refuses_the_flags_of_a_model_loaded_here(flags, named):
    """--url measures the server's model: a flag for a model loaded here is one line before any request, not ignored."""
    result = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert named + " for a model loaded here; --url measures the server's model" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "4"], "--request-rate is for --url (a running server)"),
    (["--max-concurrency", "2", "--request-rate", "3"], "--request-rate, --max-concurrency are for --url"),
    (["--speculative-accept-threshold-acc", "0.9"], "--speculative-accept-threshold-acc is not used: fastspec bench "
                                                    "decodes greedily"),
    (["--profile", "--trials", "3", "--num-prompts", "2"], "--num-prompts, --trials are not used by --profile"),
    (["--prompts", "p.jsonl", "--prompt-set", "chat"], "--prompts and --prompt-set both name the prompts"),
    (["--batch-sizes", "1,4", "--max-running-requests", "2"],
     "--max-running-requests 2 is below the largest --batch-sizes, 4: bench runs batches of each size"),
    (["--profile", "--speculative-fallback"], "--speculative-fallback is not used by --profile (it profiles a "
                                              "speculative round at every batch size, with the fallback off)")])
def test_bench_refuses_a_flag_it_would_ignore(flags, message):
    """A local run took --request-rate / --max-concurrency, lossy thresholds (greedy decoding never reads them),
    --profile's unused counts, --prompt-set beside --prompts, a --max-running-requests below the largest batch size
    (raised to it) and --speculative-fallback with --profile (turned off), and measured as if they were not given."""
    result = CliRunner().invoke(app, ["bench", *flags])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output


def test_bench_runs_only_full_batches(monkeypatch):
    """3 prompts at batch size 2 ran a batch of 2 and one of 1, yet per-request tok/s and rounds were divided by 2
    (found by the QA pass of bench): the prompts are cycled to fill every batch."""
    from types import SimpleNamespace

    from fastspec.benchmark import offline
    from fastspec.spec_config import SpecConfig
    from fastspec.utils.metrics import SpecMetrics

    batches = []

    def generate(prompts, params):
        batches.append(len(prompts))
        return [SimpleNamespace(output_ids=[1], metrics=SpecMetrics()) for _ in prompts]

    engine = SimpleNamespace(generate=generate, flush_cache=lambda: None, spec=SpecConfig(),
                             times=SimpleNamespace(reset=lambda: None))
    monkeypatch.setattr(offline, "_phase_split", lambda *args: offline.PhaseSplit({}, {}, 1))
    llm = SimpleNamespace(engine=engine)
    results = offline.run_bench(llm, llm, [[1], [2], [3]], [2, 4], max_new_tokens=4, trials=1, warmup=0)
    assert batches == [2, 2, 2, 2, 4, 4]  # bs 2: 4 prompts in 2 batches, each engine; bs 4: one batch of 4 each
    assert [r.requests for r in results] == [4, 4]  # what --json reports beside the 3 prompts given


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "-1"], "--request-rate must be > 0 (requests per second; inf: all at once), got -1"),
    (["--request-rate", "nan"], "--request-rate must be > 0 (requests per second; inf: all at once), got nan"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0")])
def test_bench_url_names_the_flag_and_value_it_refuses(flags, message):
    result = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", *flags])
    assert result.exit_code == 2 and result.stderr == f"error: {message}\n"
