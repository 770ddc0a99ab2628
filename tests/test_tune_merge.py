"""How `fastspec tune` adds its tiers to the tuned file already there (fastspec.speculative.tuned.merge_tiers,
add_tiers): which tiers are kept, when the file is replaced instead, two tunes at once, and what the command shows of
the kept tiers. The file's format and how it is loaded: test_tune_file.py."""

from __future__ import annotations

import json

import pytest
from test_train import chat_target  # noqa: F401  (fixture)
from test_tune_file import head  # noqa: F401  (fixture)

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

CPU = {"graphs": "eager", "page_size": 1, "attention_backend": "torch", "graph_buckets": None}  # the CLI's defaults


def _tier(bs: int, params, why: str) -> dict:
    return {"max_batch_size": bs, "params": params, "why": why}


def test_a_tune_adds_its_tiers_to_a_file_of_the_same_fingerprint_and_settings(tmp_path):
    """Tuning bs 4, 16 after bs 1, 4, 8: 4 is measured again, 1 and 8 kept with their own `why`, sorted by batch
    size. Graph buckets merge when every tier still runs in the graph it was measured in."""
    from fastspec.speculative.tuned import Merged, merge_tiers, save_tuned

    path, print_ = tmp_path / "t.json", {"hardware": "cpu", "model": "a"}
    before = [_tier(1, [3, 2, 5], "old 1"), _tier(4, [3, 1, 4], "old 4"), _tier(8, None, "old 8")]
    new = [_tier(16, None, "new 16"), _tier(4, None, "new 4")]
    assert merge_tiers(path, print_, new, CPU) == Merged((new[1], new[0]), CPU)  # no file: this run's, sorted
    save_tuned(path, print_, before, CPU)
    merged = merge_tiers(path, print_, new, CPU)
    assert [(t["max_batch_size"], t["why"]) for t in merged.tiers] == [(1, "old 1"), (4, "new 4"), (8, "old 8"),
                                                                        (16, "new 16")]
    assert (merged.kept, merged.note, merged.settings) == ((1, 8), None, CPU)
    graphs = CPU | {"graphs": "cuda"}
    save_tuned(path, print_, before, graphs | {"graph_buckets": [1, 2, 4, 8]})
    smaller = merge_tiers(path, print_, [_tier(1, None, "new 1")], graphs | {"graph_buckets": [1, 2]})
    assert smaller.kept == (4, 8) and smaller.settings["graph_buckets"] == [1, 2, 4, 8]


GRAPHS = CPU | {"graphs": "cuda", "graph_buckets": [1, 2, 3]}


@pytest.mark.parametrize("fingerprint, recorded, here, note", [
    ({"hardware": "gpu"}, CPU, CPU, "were measured with a different hardware"),
    ({}, CPU | {"page_size": 2}, CPU, "were measured with --page-size 2 (here 1)"),
    ({}, None, CPU, "were measured under engine settings it does not record"),
    ({}, GRAPHS | {"graph_buckets": [1, 4]}, GRAPHS,  # the kept bs 3 ran in graph 4, here it would run in 3
     "were measured with --cuda-graph-bs / --cuda-graph-max-bs, graphs run at bs 3: 4 (here bs 3: 3)"),
    ({}, GRAPHS | {"graph_buckets": [1, 4]}, GRAPHS | {"graph_buckets": [2, 4]},  # bs 3 in graph 4 alike, but bs 1
     "were measured with graph buckets [1, 4], that and this run's [2, 4] cannot be recorded together"),  # ran in 2
    ({}, "damaged", CPU, "unreadable")])
def test_a_file_measured_under_something_else_is_replaced_with_one_note(tmp_path, fingerprint, recorded, here, note):
    from fastspec.speculative.tuned import merge_tiers, save_tuned

    path, print_ = tmp_path / "t.json", {"hardware": "cpu", "model": "a"}
    save_tuned(path, print_ | fingerprint, [_tier(3, [3, 2, 5], "old")], recorded)
    if recorded == "damaged":
        path.write_text("{")
    merged = merge_tiers(path, print_, [_tier(1, None, "new")], here)
    assert [t["why"] for t in merged.tiers] == ["new"] and merged.kept == () and merged.settings == here
    assert str(path) in merged.note and note in merged.note, merged.note


def test_tune_keeps_the_tiers_it_did_not_tune_and_says_which(chat_target, head, tmp_path, monkeypatch):  # noqa: F811
    """`fastspec tune --batch-sizes 4,16` after a tune of 1, 4, 8: the file holds 1 and 8 from before, 4 and 16 from
    this run, and the last line names the kept ones; under other settings it is replaced, with one note. (The
    tuner is a stand-in: this reads what the command writes, not what it measures.)"""
    from typer.testing import CliRunner

    import fastspec.tune.tuner
    from fastspec.cli import app
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path
    from fastspec.tune.tuner import Candidate, TuneResult

    def stand_in(llm, prompts, cfg, say=None):
        winners = {bs: Candidate(bs, None, 1.0, 10.0 * bs, measured=10.0 * bs, measured_tau=1.0, measured_tokens=8)
                   for bs in cfg.batch_sizes}
        return TuneResult(winners, {bs: f"new {bs}" for bs in winners}, confirmed=list(winners.values()))

    monkeypatch.setattr(fastspec.tune.tuner, "tune", stand_in)
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    path, print_ = tuned_path(chat_target, head, "float32", "cpu"), fingerprint(chat_target, head, "float32", "cpu")
    before = [_tier(1, [3, 2, 5], "old 1") | {"tau": 2.25, "measured_tok_s": 12.5}, _tier(4, [3, 1, 4], "old 4"),
              _tier(8, [2, 1, 3], "old 8")]
    args = ["tune", "--model", str(chat_target), "--speculative-algorithm", "EAGLE3", "--draft", str(head),
            "--batch-sizes", "4,16", "--num-prompts", "2", "--plot", str(tmp_path / "p.png")]
    save_tuned(path, print_, before, CPU)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads(path.read_text())
    assert [(t["max_batch_size"], t["params"], t["why"]) for t in saved["tiers"]] == [
        (1, [3, 2, 5], "old 1"), (4, None, "new 4"), (8, [2, 1, 3], "old 8"), (16, None, "new 16")]
    assert saved["settings"] == CPU and saved["fingerprint"] == print_
    last = " ".join(result.stderr.split())  # (soft-wrapped)
    assert "bs <= 1: 3/2/5 · bs <= 4: plain · bs <= 8: 2/1/3 · bs <= 16: plain" in last
    assert "kept from the earlier tune: bs 1, 8" in last and "replacing" not in last
    rows = [line.replace("│", " ").split() for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row[0] for row in rows] == ["1", "4", "8", "16"]  # the kept tiers are in the table, as the file has them
    assert rows[0] == ["1", "3/2/5", "2.25", "-", "-", "12.5", "-", "kept"]
    assert rows[2] == ["8", "2/1/3", "-", "-", "-", "-", "-", "kept"] and rows[1][-1] == "✓"
    caption = " ".join(result.stdout.split())
    assert "bs 1, kept from the earlier tune: old 1" in caption and "bs 4: new 4" in caption
    save_tuned(path, print_, before, CPU | {"page_size": 2})
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert [t["max_batch_size"] for t in json.loads(path.read_text())["tiers"]] == [4, 16]
    said = " ".join(result.stderr.split())
    assert said.count("replacing") == 1 and "kept from" not in said
    assert (f"replacing tuned file {path}, not adding to it: its tiers for bs 1, 8 were measured with --page-size 2 "
            "(here 1)") in said


def test_two_tunes_at_once_each_add_their_tiers(tmp_path, monkeypatch):
    """Two tunes of one model at once (bs 4 and bs 8, after bs 1): each read the file, merged and wrote it, unlocked,
    so the one that read first and wrote last dropped the other's tier. Now the read-merge-write holds the folder's
    lock. (The other tune runs in a thread started once this one has read the file, to its end, or until it waits
    for the lock: what an unlucky schedule of two processes does.)"""
    import fcntl
    import threading

    from fastspec.speculative import tuned

    path, print_ = tmp_path / "tuned" / "t.json", {"hardware": "cpu", "model": "a"}
    tuned.save_tuned(path, print_, [_tier(1, [3, 2, 5], "old 1")], CPU)
    real_read, real_flock, waiting, started = tuned.read_tuned, fcntl.flock, threading.Event(), []
    other = threading.Thread(target=lambda: (tuned.add_tiers(path, print_, [_tier(8, None, "other 8")], CPU),
                                             waiting.set()))

    def flock(fd, operation):  # the other tune's lock says when it would wait for this one's
        if threading.current_thread() is other and operation == fcntl.LOCK_EX:
            try:
                return real_flock(fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting.set()
        return real_flock(fd, operation)

    def read_tuned(p):
        data = real_read(p)
        if threading.current_thread() is not other and not started:
            started.append(other.start())
            assert waiting.wait(60), "the other tune neither finished nor waited"
        return data

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(tuned, "read_tuned", read_tuned)
    tuned.add_tiers(path, print_, [_tier(4, None, "this 4")], CPU)
    other.join()
    assert [t["why"] for t in json.loads(path.read_text())["tiers"]] == ["old 1", "this 4", "other 8"]
    assert sorted(p.name for p in path.parent.glob(".*")) == [".fastspec-tuned.lock"]  # (its own name there)


def test_the_plot_shows_the_kept_tiers_it_has_figures_for(tmp_path, monkeypatch):
    """The PNG drew this run's batch sizes only; the kept tiers the file measured are points of their own. (matplotlib
    stands in: what is drawn, not how it looks.)"""
    import sys
    from types import SimpleNamespace

    from fastspec.cli.tune import _plot
    from fastspec.tune.tuner import Candidate, TuneResult

    drawn = []
    ax = SimpleNamespace(plot=lambda *args, **kw: drawn.append((args, kw.get("label"))),
                         **{name: lambda *args, **kw: None for name in ("set_xlabel", "set_ylabel", "set_xscale",
                                                                         "legend", "set_title")})
    fig = SimpleNamespace(tight_layout=lambda: None, savefig=lambda path, dpi: None)
    pyplot = SimpleNamespace(subplots=lambda figsize: (fig, ax), close=lambda fig: None)
    monkeypatch.setitem(sys.modules, "matplotlib", SimpleNamespace(use=lambda backend: None, pyplot=pyplot))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    plain = Candidate(4, None, 1.0, 40.0, measured=40.0)
    kept = [_tier(1, [3, 2, 5], "old 1") | {"measured_tok_s": 12.5}, _tier(8, None, "old 8")]  # (8: no figure)
    _plot(TuneResult({4: plain}, confirmed=[plain]), kept, tmp_path / "p.png", SimpleNamespace(print=print))
    assert [(args[:2], label) for args, label in drawn] == [
        (([4], [40.0]), "no speculation"), (([4], [40.0]), "tuned"), (((1,), (12.5,)), "kept from the earlier tune")]
