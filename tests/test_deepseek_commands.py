"""fastspec's commands on a DeepSeek-V3 target (MLA, MoE, an MTP layer): `fastspec bench` with NEXTN against plain,
tune's offline replay, and train-draft's EAGLE-3 head. The model itself: test_deepseek."""

import json

import pytest
from test_deepseek import GREEDY, PROMPTS

import fastspec


@pytest.mark.commands
def test_bench_and_tune_run_on_a_deepseek_target(tmp_path, monkeypatch):
    """`fastspec bench` (NEXTN against plain) and `fastspec tune`'s replay on an MLA target with its MTP layer."""
    from tiny_models import write_chat_target
    from typer.testing import CliRunner

    from fastspec.cli import app
    from fastspec.tune.replay import candidate_params, record, replay_tau

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    target = write_chat_target(tmp_path / "target", family="deepseek_v3")
    result = CliRunner().invoke(app, ["bench", "--model", str(target), "--speculative-algorithm", "NEXTN",
                                      "--batch-sizes", "1,2", "--max-new-tokens", "6", "--num-prompts", "2",
                                      "--trials", "1", "--warmup", "0", "--max-total-tokens", "4096", "--json",
                                      "--prompts", str(_word_prompts(tmp_path / "p.jsonl"))])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["algorithm"] == "EAGLE" and all(r["tau"] >= 1 for r in report["results"])
    # tune's offline replay predicts the engine's rounds exactly on this target too
    plain = fastspec.LLM(str(target), speculative_algorithm="NONE").engine.generate(PROMPTS[:3], [GREEDY] * 3)
    probe = fastspec.LLM(str(target), speculative_algorithm="NEXTN", num_steps=3, topk=2, num_draft_tokens=5)
    e = probe.engine
    grid = candidate_params(3, (1, 2), 5)
    recorded = [record(e.model, e.drafter.model, e.drafter.hot_token_id, e.feature, o.prompt_ids, o.output_ids, grid)
                for o in plain]
    outs = probe.engine.generate(PROMPTS[:3], [GREEDY] * 3)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    rounds, emitted = (sum(getattr(o.metrics, f) for o in outs) for f in ("verify_rounds", "emitted_tokens"))
    assert replay_tau(recorded, probe.engine.spec.params) == (rounds, emitted)


def _word_prompts(path):
    from tiny_models import WORDS

    path.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i:i + 5])}) + "\n" for i in (0, 10, 20)))
    return path


def test_train_draft_on_a_deepseek_target(tmp_path, monkeypatch):
    """train-draft reads an MLA target's EAGLE-3 features; the head it exports decodes losslessly."""
    from test_train import tiny_config
    from tiny_models import write_chat_target, write_prompt_file

    from fastspec.train.trainer import train_draft

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    target = write_chat_target(tmp_path / "target", family="deepseek_v3")
    report = train_draft(tiny_config(tmp_path / "head", target, write_prompt_file(tmp_path / "p.jsonl"), epochs=4))
    assert report["steps"] > 0
    plain = fastspec.LLM(str(target), speculative_algorithm="NONE").engine.generate(PROMPTS[:2], [GREEDY] * 2)
    spec = fastspec.LLM(str(target), speculative_algorithm="EAGLE3", draft_model=str(tmp_path / "head"), num_steps=3,
                        topk=2, num_draft_tokens=5).engine.generate(PROMPTS[:2], [GREEDY] * 2)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
