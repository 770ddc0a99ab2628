"""`fastspec export-draft`: SGLang <-> speculators round trips that keep the draft logits, refusals in one line, a
failed write that leaves nothing behind, and --verifier: whatever --model takes (an embedded model's name, a
directory, a .gguf file, a hub id), resolved in --model's order by the same function, recorded as what another engine
loads and checked against the head wherever the target is on this machine."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_writers import tiny_model, write_gguf
from safetensors.torch import load_file
from test_draft_formats import eagle_twins, head_logits, rewrite  # noqa: F401 (eagle_twins: a fixture)
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


def test_export_round_trips_through_speculators_and_back(tiny_dirs, draft_dirs, tmp_path):
    """SGLang -> speculators -> SGLang: the same draft logits at each stage (norm_before_residual and the aux ids
    carried over); the speculators copy holds what vLLM reads (layers.0, d2t, t2d, the verifier)."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    target = tiny_dirs["llama"][0]
    head = rewrite(draft_dirs["llama"]["eagle3"], tmp_path / "head", {"norm_before_residual": True})
    run = CliRunner().invoke
    result = run(app, ["export-draft", str(head), str(tmp_path / "spec"), "--verifier", "tiny-org/target"])
    assert result.exit_code == 0, result.output
    back = run(app, ["export-draft", str(tmp_path / "spec"), str(tmp_path / "back"), "--format", "sglang"])
    assert back.exit_code == 0, back.output
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DraftModel"] and config["norm_before_residual"] is True
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-org/target"
    keys = set(load_file(tmp_path / "spec" / "model.safetensors"))
    assert {"d2t", "t2d", "layers.0.hidden_norm.weight"} <= keys and not any(k.startswith("midlayer.") for k in keys)
    expected = head_logits(target, head)
    for d in ("spec", "back"):
        assert torch.equal(head_logits(target, tmp_path / d), expected)
    # what came back is the config it left as: model_type included, which transformers' AutoConfig (so SGLang)
    # needs to read it at all; only the speculators format's explicit defaults are added
    original, back = (json.loads((d / "config.json").read_text()) for d in (head, tmp_path / "back"))
    assert {k: v for k, v in back.items() if k in original} == original and back["model_type"] == "llama"
    assert set(back) - set(original) <= {"model_type", "bias", "norm_before_fc", "target_hidden_size",
                                         "draft_vocab_size"}


def test_export_of_an_eagle1_head_writes_sglangs_eagle2_format(tiny_dirs, eagle_twins, tmp_path):
    from typer.testing import CliRunner

    from fastspec.cli import app

    sglang, eagle1 = eagle_twins
    result = CliRunner().invoke(app, ["export-draft", str(eagle1), str(tmp_path / "out"), "--format", "sglang"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    target = tiny_dirs["llama"][0]
    assert torch.equal(head_logits(target, tmp_path / "out", "EAGLE"), head_logits(target, sglang, "EAGLE"))


@pytest.mark.commands
def test_export_refusals_are_one_line(tiny_dirs, eagle_twins, tmp_path):
    from typer.testing import CliRunner

    from fastspec.cli import app

    run = lambda *a: CliRunner().invoke(app, ["export-draft", *map(str, a)])  # noqa: E731
    target = tiny_dirs["llama"][0]
    for args, message in (((eagle_twins[0], tmp_path / "a", "--verifier", target), "only EAGLE-3 heads have a "
                                                                                  "speculators form"),
                          ((eagle_twins[0], tmp_path / "b"), "give --verifier"),
                          ((tiny_dirs["llama"][0], tmp_path / "c", "--format", "sglang"), "is not a draft head"),
                          ((eagle_twins[0], tmp_path / "d", "--format", "gguf"), "--format must be sglang or"),
                          ((eagle_twins[0], tiny_dirs["llama"][0] / "config.json", "--format", "sglang"),
                           "exists and is not a directory"),
                          ((eagle_twins[0], "/proc/no/such/dir", "--format", "sglang"), "cannot write /proc/no"),
                          ((eagle_twins[0], tiny_dirs["llama"][0] / "config.json" / "out", "--format", "sglang"),
                           "config.json is a file, not a directory"),
                          ((eagle_twins[0], tmp_path / "e", "--format", "sglang", "--verifier", "t"),
                           "--verifier is recorded by --format speculators only"),
                          ((tmp_path / "nope", tmp_path / "f", "--format", "sglang"),
                           "is neither a directory nor a Hugging Face hub id (org/name)"),
                          ((tmp_path / "h.gguf", tmp_path / "h", "--format", "sglang"), "is neither a directory nor"),
                          (("smollm2-135m-instruct", tmp_path / "i", "--format", "sglang"), "is neither a directory"),
                          ((tmp_path, tmp_path / "g", "--format", "sglang"), "draft head directory")):
        result = run(*args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, args


def test_an_export_that_fails_midway_leaves_no_directory(eagle_twins, tmp_path, monkeypatch):
    """export-draft writes model.safetensors and config.json into a hidden sibling renamed to --out at the end: a
    write that fails after the weights (here config.json's, as a full disk would) leaves neither --out nor the
    sibling; an empty --out is filled."""
    from typer.testing import CliRunner

    import fastspec.utils.files as files
    from fastspec.cli import app

    where, written = tmp_path / "exports", []
    where.mkdir()

    def fail_on_config(directory, write):
        if written:
            raise OSError(28, "No space left on device")
        written.append(directory)
        return real(directory, write)

    real = files._write_temp
    monkeypatch.setattr(files, "_write_temp", fail_on_config)
    export = ["export-draft", str(eagle_twins[1]), str(where / "out"), "--format", "sglang"]
    result = CliRunner().invoke(app, export)
    assert result.exit_code == 2 and "No space left on device" in result.output, result.output
    assert list(where.iterdir()) == []
    monkeypatch.setattr(files, "_write_temp", real)
    (where / "out").mkdir()
    result = CliRunner().invoke(app, export)
    assert result.exit_code == 0 and sorted(p.name for p in (where / "out").iterdir()) == ["config.json",
                                                                                            "model.safetensors"]
    assert list(where.iterdir()) == [where / "out"] and oct((where / "out").stat().st_mode)[-3:] == "755"
