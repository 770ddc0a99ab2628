"""Drafters made for a hybrid target: Qwen3-Next's own MTP layer (NEXTN), tune's replay of recorded rounds and a
head train-draft trains on the hybrid target's features; each decodes exactly what the target alone does.
(test_hybrid.py: the fixtures and the NGRAM / EAGLE / STANDALONE drafts.)"""

import pytest
from test_hybrid import GREEDY, PROMPTS, hybrid  # noqa: F401  (hybrid: a fixture)

import fastspec
from fastspec.errors import FastspecError


@pytest.fixture(scope="module")
def qwen3_next_with_mtp(tmp_path_factory):
    from tiny_models import write_qwen3_next_mtp

    root = tmp_path_factory.mktemp("qwen3-next-mtp")
    write_qwen3_next_mtp(root)
    return root


@pytest.mark.parametrize("steps, topk, n, page_size, bs", [(None, None, None, 1, 8), (3, 2, 6, 16, 5), (2, 4, 8, 1, 3)])
def test_nextn_drafts_with_the_checkpoints_mtp_layer(qwen3_next_with_mtp, steps, topk, n, page_size, bs):
    """Qwen3-Next's own MTP layer (an attention layer: no recurrent state) drafts; output equals target-only."""
    root = str(qwen3_next_with_mtp)
    plain = fastspec.LLM(root, max_total_tokens=4096).engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    llm = fastspec.LLM(root, speculative_algorithm="NEXTN", num_steps=steps, topk=topk, num_draft_tokens=n,
                       page_size=page_size, max_total_tokens=4096)
    assert type(llm.engine.drafter.model).__name__ == "Qwen3NextMTP"
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    llm.engine.check_kv()


def test_nextn_on_a_checkpoint_without_mtp_is_a_one_line_error(hybrid):
    root, hf = hybrid
    with pytest.raises(FastspecError, match=f"NEXTN drafts with the checkpoint's MTP layer, and this "
                                            f"{type(hf).__name__} checkpoint has none"):
        fastspec.LLM(str(root / "target"), speculative_algorithm="NEXTN", max_total_tokens=512)


def test_tune_replay_and_train_draft_on_a_hybrid_target(hybrid, tmp_path, monkeypatch):
    """tune's replay (one target forward per recorded sequence, fresh recurrent states) predicts the engine's
    rounds exactly; train-draft extracts features from the hybrid target and its head decodes losslessly."""
    from test_train import tiny_config
    from tiny_models import write_chat_target, write_prompt_file

    from fastspec.train.trainer import train_draft
    from fastspec.tune.replay import candidate_params, record, replay_tau

    root, hf = hybrid
    target = str(root / "target")
    plain = fastspec.LLM(target).engine.generate(PROMPTS[:3], [GREEDY] * 3)
    probe = fastspec.LLM(target, speculative_algorithm="EAGLE", draft_model=str(root / "eagle"), num_steps=3, topk=2,
                         num_draft_tokens=5)
    e = probe.engine
    recorded = [record(e.model, e.drafter.model, e.drafter.hot_token_id, e.feature, o.prompt_ids, o.output_ids,
                       candidate_params(3, (1, 2), 5)) for o in plain]
    outs = e.generate(PROMPTS[:3], [GREEDY] * 3)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    rounds, emitted = (sum(getattr(o.metrics, f) for o in outs) for f in ("verify_rounds", "emitted_tokens"))
    assert replay_tau(recorded, e.spec.params) == (rounds, emitted)

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    chat = write_chat_target(tmp_path / "chat", family=hf.config.model_type)  # the same model, with a tokenizer
    report = train_draft(tiny_config(tmp_path / "head", chat, write_prompt_file(tmp_path / "p.jsonl"), epochs=3))
    assert report["steps"] > 0
    spec = fastspec.LLM(str(chat), speculative_algorithm="EAGLE3", draft_model=str(tmp_path / "head"), num_steps=2,
                        topk=2, num_draft_tokens=4).engine.generate(PROMPTS[:2], [GREEDY] * 2)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain[:2]]
