"""Hugging Face hub ids for models and draft heads, resolved against a hub cache laid out as huggingface_hub lays
it out (fake_hub.py writes it by hand): a model and its head by id, revisions (branch, tag, commit), a model or
revision not cached while offline, a snapshot missing a shard, a head that does not fit its target (refused before
its weights are read), and a download when the hub is reachable (huggingface_hub's download faked)."""

from __future__ import annotations

import json

import pytest
from fake_hub import add_snapshot, commit_id
from tiny_models import make_hf_model, write_chat_target
from typer.testing import CliRunner

import fastspec
from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.models import loader
from fastspec.models.heads import write_random_head
from fastspec.models.hub import CONFIG_FILES, MODEL_FILES, is_hub_id
from fastspec.models.sources import resolve_model_dir
from fastspec.sampling import SamplingParams

PROMPT = [1, 5, 9, 13]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
TARGET, HEAD = "tiny-org/chat-target", "tiny-org/eagle3-head"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The model directories the cache holds copies of: two targets (main and v2), a head, a head of another
    width, a sharded model."""
    root = tmp_path_factory.mktemp("hub-sources")
    dirs = {"target": write_chat_target(root / "target"), "v2": write_chat_target(root / "v2", seed=7)}
    dirs["head"] = write_random_head(root / "head", 64, 97, "eagle3", draft_vocab=40)
    dirs["wide"] = write_random_head(root / "wide", 32, 97, "eagle3", draft_vocab=40)
    make_hf_model("llama").save_pretrained(root / "sharded", max_shard_size="40KB")
    dirs["sharded"] = root / "sharded"
    dirs["bin-head"] = as_bin_only(dirs["head"], root / "bin-head")
    return dirs


def as_bin_only(head, out):
    """`head` as its authors publish many: the weights as pytorch_model.bin in float16 (d2t kept int64, t2d as a
    bool mask, as EAGLE-3's trainers save them), no safetensors."""
    import shutil

    import torch
    from safetensors.torch import load_file

    out.mkdir()
    shutil.copy(head / "config.json", out / "config.json")
    state = {k: v.half() if v.is_floating_point() else v for k, v in load_file(head / "model.safetensors").items()}
    state["t2d"] = torch.zeros(97, dtype=torch.bool)
    torch.save(state, out / "pytorch_model.bin")
    return out


@pytest.fixture
def cache(local, tmp_path, monkeypatch):
    cache = tmp_path / "hf-hub"
    add_snapshot(cache, TARGET, local["target"], commit_id(1))
    add_snapshot(cache, TARGET, local["v2"], commit_id(2), refs=("v2",))
    add_snapshot(cache, HEAD, local["head"], commit_id(3))
    add_snapshot(cache, "tiny-org/wide-head", local["wide"], commit_id(4))
    shards = sorted(p.name for p in local["sharded"].glob("model-*.safetensors"))
    assert len(shards) >= 2
    add_snapshot(cache, "tiny-org/sharded", local["sharded"], commit_id(5), skip=(shards[-1],))
    add_snapshot(cache, "tiny-org/bin-head", local["bin-head"], commit_id(6))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def generate(model, **kwargs) -> list[int]:
    llm = fastspec.LLM(str(model), max_total_tokens=512, tuned=False, **kwargs)
    return llm.engine.generate([PROMPT], [PARAMS])[0].output_ids


def test_a_model_and_its_head_by_hub_id_equal_their_directories(cache, local):
    eagle = dict(speculative_algorithm="EAGLE3", num_steps=2, topk=1, num_draft_tokens=3)
    by_id = fastspec.LLM(TARGET, draft_model=HEAD, max_total_tokens=512, tuned=False, **eagle)
    assert by_id.engine.model_dir == cache / f"models--tiny-org--chat-target/snapshots/{commit_id(1)}"
    got = by_id.engine.generate([PROMPT], [PARAMS])[0].output_ids
    assert got == generate(local["target"], draft_model=str(local["head"]), **eagle) == generate(local["target"])


def test_a_revision_picks_its_snapshot(cache):
    snapshots = cache / "models--tiny-org--chat-target" / "snapshots"
    assert resolve_model_dir(TARGET) == snapshots / commit_id(1)
    assert resolve_model_dir(TARGET, "v2") == resolve_model_dir(TARGET, commit_id(2)) == snapshots / commit_id(2)
    with pytest.raises(FastspecError, match=f"{TARGET} at revision nope is not in the Hugging Face cache {cache}"):
        resolve_model_dir(TARGET, "nope")
    with pytest.raises(FastspecError, match=r"a revision \(v2\) applies to a hub id \(org/name\), not to smollm2"):
        resolve_model_dir("smollm2-135m-instruct", "v2")  # (a local model has none: it was ignored)


@pytest.mark.commands
def test_the_cli_takes_hub_ids_and_revisions(cache, local):
    args = ["generate", "--input-ids", "1,5,9,13", "--max-new-tokens", "8", "--ignore-eos", "--json",
            "--max-total-tokens", "512", "--speculative-algorithm", "NONE"]
    by_id = CliRunner().invoke(app, [*args, "--model", TARGET, "--revision", "v2"])
    assert by_id.exit_code == 0, by_id.output
    assert json.loads(by_id.stdout)["output_ids"] == generate(local["v2"])
    missing = CliRunner().invoke(app, [*args, "--model", "tiny-org/missing"])
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1, missing.output
    assert "tiny-org/missing is not in the Hugging Face cache" in missing.stderr and str(cache) in missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stderr


def test_a_snapshot_missing_a_shard_is_refused(cache):
    with pytest.raises(FastspecError, match=r"tiny-org/sharded: the cached snapshot .* lacks 1 of \d+ weight shards"):
        resolve_model_dir("tiny-org/sharded")


@pytest.mark.commands
@pytest.mark.parametrize("skip, lacks", [("model.safetensors", "no *.safetensors or pytorch_model*.bin weights"),
                                         ("config.json", "no config.json")])
def test_a_snapshot_missing_its_weights_or_config_says_so_offline(cache, local, skip, lacks):
    """The snapshot is cached: what it lacks is the error, as a target and as a draft, not 'not in the cache'."""
    snapshot = add_snapshot(cache, "tiny-org/partial", local["head"], commit_id(7), skip=(skip,))
    args = ["generate", "--input-ids", "1,5,9,13", "--max-new-tokens", "4", "--max-total-tokens", "512"]
    for flags in (["--model", "tiny-org/partial", "--speculative-algorithm", "NONE"],
                  ["--model", TARGET, "--speculative-algorithm", "EAGLE3", "--draft", "tiny-org/partial"]):
        result = CliRunner().invoke(app, [*args, *flags])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert f"{snapshot}: {lacks}" in result.stderr and "not in the Hugging Face cache" not in result.stderr


@pytest.fixture
def online(cache, local, monkeypatch):
    """The hub reachable (HF_HUB_OFFLINE unset), huggingface_hub's download faked: a repo of `hosted` downloads
    the files its allow_patterns select into the cache; any other fails as a network error does. Returns the
    calls (repo id, allow_patterns, local_files_only)."""
    import fnmatch

    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    hosted = {"tiny-org/new": local["target"], "tiny-org/new-wide-head": local["wide"],
              "tiny-org/new-bin-head": local["bin-head"]}
    calls = []

    def snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False,
                          **_):
        calls.append((repo_id, tuple(allow_patterns or ()), local_files_only))
        repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
        if local_files_only:
            ref = repo / "refs" / (revision or "main")
            if not ref.is_file():
                raise LocalEntryNotFoundError("not cached")
            return str(repo / "snapshots" / ref.read_text())
        snapshot = repo / "snapshots" / commit_id(9)
        if repo_id not in hosted:
            raise OSError("Connection refused")
        source, done = hosted[repo_id], {f.name for f in snapshot.iterdir()} if snapshot.exists() else set()
        skip = tuple(f.name for f in source.iterdir()
                     if f.name in done or not any(fnmatch.fnmatch(f.name, p) for p in allow_patterns))
        add_snapshot(cache_dir, repo_id, source, commit_id(9), skip=skip)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_an_uncached_model_is_downloaded_when_online(online, local, cache):
    """Online, a model the cache lacks is downloaded into it (once: the second run reads the cache); a failed
    download is one line naming the id and the cache."""
    assert generate("tiny-org/new") == generate(local["target"]) == generate("tiny-org/new")
    assert [c for c in online if not c[2]] == [("tiny-org/new", tuple(MODEL_FILES), False)]
    with pytest.raises(FastspecError, match=f"tiny-org/gone: not in the Hugging Face cache {cache}, and "
                                            "downloading it failed: Connection refused"):
        resolve_model_dir("tiny-org/gone")


def test_a_head_that_does_not_fit_is_refused_before_its_weights_are_fetched(online, monkeypatch):
    """A hub head is checked against its target from its config.json alone: no weights downloaded or read."""
    read, real = [], loader.read_state_dict
    monkeypatch.setattr(loader, "read_state_dict", lambda d, *a, **k: read.append(d) or real(d, *a, **k))
    with pytest.raises(FastspecError, match="draft expects target features of width 32"):
        fastspec.LLM(TARGET, speculative_algorithm="EAGLE3", draft_model="tiny-org/new-wide-head",
                     max_total_tokens=512)
    fetched = [patterns for repo, patterns, local_only in online if repo == "tiny-org/new-wide-head" and not local_only]
    assert fetched == [tuple(CONFIG_FILES)] and not [d for d in read if "wide" in str(d)]


def test_a_local_directory_named_like_an_id_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name") and not is_hub_id("./org/name") and not is_hub_id("/abs/path")


def test_a_head_published_as_bin_only_loads_by_hub_id(cache, local):
    """A head repo without safetensors (its weights a float16 pytorch_model.bin): by hub id, from the cache, it
    drafts as the same weights from a directory do (the same tokens and accepted lengths)."""
    eagle = dict(speculative_algorithm="EAGLE3", num_steps=2, topk=1, num_draft_tokens=3, dtype="float16")
    by_id = fastspec.LLM(TARGET, draft_model="tiny-org/bin-head", max_total_tokens=512, tuned=False, **eagle)
    by_dir = fastspec.LLM(TARGET, draft_model=str(local["head"]), max_total_tokens=512, tuned=False, **eagle)
    a, b = (llm.engine.generate([PROMPT], [PARAMS])[0] for llm in (by_id, by_dir))
    assert a.output_ids == b.output_ids and a.metrics.accepted_tokens == b.metrics.accepted_tokens


def test_a_bin_only_head_is_downloaded_with_its_bin_files(online, local):
    """Online: the safetensors patterns find no weights, so the .bin files are fetched after them."""
    from fastspec.models.hub import BIN_FILES

    path = resolve_model_dir("tiny-org/new-bin-head")
    assert (path / "pytorch_model.bin").is_file()
    fetched = [patterns for repo, patterns, local_only in online if repo == "tiny-org/new-bin-head" and not local_only]
    assert fetched == [tuple(MODEL_FILES), tuple(BIN_FILES)]


def test_eagle1_and_speculators_heads_by_hub_id_draft_as_their_directories(cache, local, tmp_path):
    """An EAGLE-1 head labelled LlamaForCausalLM and a speculators head, cached by id: each drafts as the same
    directory does (the EAGLE-1 one's config passes the width check before its weights are read)."""
    from test_draft_formats import as_speculators, rewrite

    eagle2 = write_random_head(tmp_path / "e2", 64, 97, "eagle")
    eagle1 = rewrite(eagle2, tmp_path / "e1", {"architectures": ["LlamaForCausalLM"], "bias": True})
    speculators = as_speculators(local["head"], tmp_path / "spec")
    add_snapshot(cache, "tiny-org/eagle1-head", eagle1, commit_id(7))
    add_snapshot(cache, "tiny-org/speculators-head", speculators, commit_id(8))
    for head, directory, algorithm in (("tiny-org/eagle1-head", eagle1, "EAGLE"),
                                       ("tiny-org/speculators-head", speculators, "EAGLE3")):
        eagle = dict(speculative_algorithm=algorithm, num_steps=2, topk=1, num_draft_tokens=3)
        by_id = fastspec.LLM(TARGET, draft_model=head, max_total_tokens=512, tuned=False, **eagle)
        by_dir = fastspec.LLM(TARGET, draft_model=str(directory), max_total_tokens=512, tuned=False, **eagle)
        a, b = (llm.engine.generate([PROMPT], [PARAMS])[0] for llm in (by_id, by_dir))
        assert a.output_ids == b.output_ids and a.metrics.accepted_tokens == b.metrics.accepted_tokens
