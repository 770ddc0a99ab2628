"""`fastspec export-draft`'s --verifier: whatever --model takes (an embedded model's name, a directory, a .gguf file,
a hub id), resolved in --model's order by the same function, recorded as what another engine loads and checked against
the head wherever the target is on this machine. Refusals are one line."""

from __future__ import annotations

import json

import pytest
from gguf_writers import tiny_model, write_gguf
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.models.heads import write_random_head


def export(head, verifier, out):
    """(the result, the verifier the written config records or False)."""
    result = CliRunner().invoke(app, ["export-draft", str(head), str(out), "--verifier", verifier])
    recorded = (out / "config.json").is_file() and json.loads(
        (out / "config.json").read_text())["speculators_config"]["verifier"]
    return result, recorded


@pytest.mark.commands
def test_export_checks_the_verifier_where_it_resolves_and_records_it(tiny_dirs, draft_dirs, tmp_path, monkeypatch):
    """A local verifier is stored absolute, with its architectures, and must fit the head; a hub id is checked the
    same where the hub cache holds it, else kept as given (vLLM resolves it); anything else is one line."""
    from fake_hub import add_snapshot, commit_id

    target, head = tiny_dirs["llama"][0], draft_dirs["llama"]["eagle3"]
    architectures = json.loads((target / "config.json").read_text())["architectures"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    add_snapshot(tmp_path / "hub", "tiny-org/target", target, commit_id(1))
    monkeypatch.chdir(target.parent)
    wide = write_random_head(tmp_path / "wide", 32, 97, "eagle3")

    for verifier, out, expected in ((target.name, "local", {"name_or_path": str(target.resolve()),
                                                            "architectures": architectures}),
                                    ("tiny-org/target", "cached", {"name_or_path": "tiny-org/target",
                                                                   "architectures": architectures}),
                                    ("tiny-org/elsewhere", "kept", {"name_or_path": "tiny-org/elsewhere",
                                                                    "architectures": []})):
        result, recorded = export(head, verifier, tmp_path / out)
        assert result.exit_code == 0 and recorded == expected, (verifier, result.output)
    for bad_head, verifier, message in ((head, "nope_dir", "--verifier 'nope_dir' is neither a directory, a .gguf"),
                                        (wide, str(target), "draft expects target features of width 32"),
                                        (wide, "tiny-org/target", "draft expects target features of width 32"),
                                        (head, str(head), "is a draft head, not a target model")):
        result, recorded = export(bad_head, verifier, tmp_path / "refused")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output
        assert not (tmp_path / "refused").exists()


def test_export_records_an_embedded_models_repository_as_the_verifier(tmp_path):
    """The shipped head exported for vLLM with --verifier smollm2-135m-instruct (the name every other command takes)
    was refused as neither a directory nor a hub id (found by the QA pass of export-draft): it records the model's
    own repository, which vLLM can load, checked against the converted model here."""
    from fastspec.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_head

    result, recorded = export(embedded_head(DEFAULT_MODEL), DEFAULT_MODEL, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert recorded == {"name_or_path": EMBEDDED_MODELS[DEFAULT_MODEL].hub_id, "architectures": ["LlamaForCausalLM"]}


@pytest.mark.commands
def test_a_gguf_verifier_is_converted_as_model_takes_it_and_recorded_by_its_path(tmp_path, monkeypatch):
    """--verifier refused a .gguf file, which --model takes: it is converted once (the same conversion --model reads),
    the head is checked against it, and the file's absolute path is recorded (vLLM loads a .gguf path)."""
    from fastspec.models.sources import resolve_model_dir

    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    model = tiny_model("llama", num_hidden_layers=3)  # (the head reads layers 0, 1, 2)
    path = write_gguf(tmp_path / "target.gguf", model)
    head = write_random_head(tmp_path / "head", model.config.hidden_size, model.config.vocab_size, "eagle3")
    wide = write_random_head(tmp_path / "wide", model.config.hidden_size + 8, model.config.vocab_size, "eagle3")
    monkeypatch.chdir(tmp_path)
    result, recorded = export(head, "target.gguf", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert recorded == {"name_or_path": str(path.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert [p.name for p in (tmp_path / "cache" / "gguf").glob("[!.]*")] == [resolve_model_dir(str(path)).name]
    for verifier, message in ((str(path), "draft expects target features of width"),
                              ("missing.gguf", "--verifier file missing.gguf does not exist")):
        result, recorded = export(wide, verifier, tmp_path / "refused")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.output
        assert not (tmp_path / "refused").exists()


def test_an_embedded_name_wins_over_a_directory_of_that_name_as_for_model(tmp_path, monkeypatch):
    """--verifier looked for a directory before an embedded model's name, where --model (resolve_model_dir) takes the
    embedded model first: a directory named like it in the working directory now changes neither."""
    from fastspec.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_head

    (tmp_path / DEFAULT_MODEL).mkdir()
    (tmp_path / DEFAULT_MODEL / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    monkeypatch.chdir(tmp_path)
    result, recorded = export(embedded_head(DEFAULT_MODEL), DEFAULT_MODEL, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert recorded == {"name_or_path": EMBEDDED_MODELS[DEFAULT_MODEL].hub_id, "architectures": ["LlamaForCausalLM"]}
