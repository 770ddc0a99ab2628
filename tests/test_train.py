"""`fastspec train-draft` on a tiny random target: the objective, the data layout, the job end to end.

The tiny target gets a word-level tokenizer and a chat template so the whole job (chat-templated prompts ->
the target's own answers -> features -> TTT -> SGLang-format head) runs as a user runs it, in seconds.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.llm import LLM
from fastspec.models.loader import read_config
from fastspec.sampling import SamplingParams
from fastspec.train.data import Features, choose_draft_vocab, pack
from fastspec.train.trainer import TrainConfig, train_draft
from fastspec.train.ttt import NO_LABEL, TTTAttention, make_batch

WORDS = [f"w{i}" for i in range(3, 90)]


@pytest.fixture(scope="module")
def chat_target(tiny_dirs, tmp_path_factory):
    """The tiny llama target with a word-level tokenizer (ids 0..89) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("chat-target")
    for f in tiny_dirs["llama"][0].iterdir():
        shutil.copy(f, d / f.name)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i for i, w in enumerate(WORDS, start=3)}
    vocab |= {"<user>": 90, "<bot>": 91}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    template = "{% for m in messages %}<user> {{ m.content }} {% endfor %}<bot>"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"prompt": " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (n,), generator=gen))})
             for n in (3, 5, 8, 4, 6, 7, 3, 9, 5, 4, 6, 8)]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config(out, target, prompts, **overrides) -> TrainConfig:
    return TrainConfig(**dict(out=out, model=str(target), prompts=prompts, max_new_tokens=24, draft_vocab_size=40,
                              ttt_steps=3, epochs=12, lr=3e-3, batch_tokens=128, val_fraction=0.2,
                              checkpoint_every=4, generate_batch=8, bf16=False) | overrides)


@pytest.fixture(scope="module")
def trained(chat_target, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head"
    events = []
    report = train_draft(tiny_config(out, chat_target, prompt_file), events.append)
    return out, events, report


def test_training_lowers_the_loss(trained):
    _, events, report = trained
    losses = [e.info["loss"] for e in events if e.phase == "train"]
    assert len(losses) == report["steps"] > 10
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert 0 < report["val_acceptance"][0] <= 1 and report["val_chain_tau"] >= 1


def test_exported_head_is_the_eagle3_format_and_decodes_losslessly(trained, chat_target):
    out, _, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    assert read_config(out).is_eagle3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        d2t, t2d, head = f.get_tensor("d2t"), f.get_tensor("t2d"), f.get_tensor("lm_head.weight")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"} <= keys
    assert not any(k.startswith("embed_tokens") for k in keys)  # shared with the target, as in SGLang
    assert head.dtype == torch.bfloat16 and head.shape[0] == 40
    hot = d2t + torch.arange(40)  # draft id -> target id, ascending, and exactly the t2d set
    assert bool((hot[1:] > hot[:-1]).all()) and torch.equal(t2d.nonzero().flatten(), hot)
    prompts = [[1, 5, 9, 13], [1, 40, 41]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = LLM(model=str(chat_target)).generate(prompts, params)
    spec = LLM(model=str(chat_target), speculative_algorithm="EAGLE3", draft_model=str(out), num_steps=3, topk=2,
               num_draft_tokens=5).generate(prompts, params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


def test_an_interrupted_run_resumes_from_its_last_checkpoint(chat_target, prompt_file, tmp_path):
    out = tmp_path / "head"
    cfg = tiny_config(out, chat_target, prompt_file, epochs=3)

    def interrupt(p):
        if p.phase == "train" and p.done == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_draft(cfg, interrupt)
    with pytest.raises(FastspecError, match="--resume"):
        train_draft(cfg)
    events = []
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=3, resume=True), events.append)
    steps = [e.done for e in events if e.phase == "train"]
    assert steps[0] == 5  # checkpoint at 4, steps 5 and 6 redone
    assert [e for e in events if e.phase == "generate"][-1].done == 12  # no conversation generated twice


def test_bad_prompt_line_and_existing_dir_are_one_line_errors(chat_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w3 w4"}\n{"prompt": 5}\n')
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "o"), "--model", str(chat_target),
                                      "--prompts", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:2" in result.output and "Traceback" not in result.output
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["train-draft", "--out", str(tmp_path / "mine"), "--model", str(chat_target),
                                      "--overwrite"])
    assert result.exit_code == 2 and "refusing" in result.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_ttt_attention_equals_a_per_row_oracle():
    """Step k at p attends step-0 keys at q <= p of its own sequence, then its own keys of steps 1..k at p."""
    torch.manual_seed(0)
    T, Hq, Hkv, D, S = 7, 4, 2, 8, 3
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    attn = TTTAttention(doc)
    qs, ks, vs = torch.randn(S, T, Hq, D), torch.randn(S, T, Hkv, D), torch.randn(S, T, Hkv, D)
    outs = [attn.attend(0, qs[k], ks[k], vs[k], 0.3) for k in range(S)]
    for k in range(S):
        for p in range(T):
            prefix = [q for q in range(T) if doc[q] == doc[p] and q <= p]
            keys = torch.cat([ks[0, prefix], ks[1:k + 1, p]])  # [n, Hkv, D]
            values = torch.cat([vs[0, prefix], vs[1:k + 1, p]])
            for h in range(Hq):
                g = h // (Hq // Hkv)
                w = torch.softmax(keys[:, g] @ qs[k, p, h] * 0.3, dim=0)
                torch.testing.assert_close(outs[k][p, h], w @ values[:, g])


def test_batch_layout_on_a_hand_worked_conversation():
    # one conversation: prompt [10, 11], response [12, 13, 14]; the target's greedy labels: 11 12 13 99 15
    features = Features(tokens=torch.tensor([10, 11, 12, 13, 14]), aux=torch.zeros(5, 6),
                        labels=torch.tensor([11, 12, 13, 99, 15]), offsets=torch.tensor([0, 5]),
                        prompt_lens=torch.tensor([2]))
    t2d = torch.full((100,), -1)
    t2d[[12, 13, 15]] = torch.tensor([0, 1, 2])  # 99 is outside the draft vocabulary
    batch = make_batch(features, [0], t2d, steps=2)
    # step 0 at p is fed token p+1 and predicts token p+2 (label at p+1): responses start at position 2
    assert batch.inputs[0].tolist() == [11, 12, 13, 14, 0]
    assert batch.labels[0].tolist() == [0, 1, 3, NO_LABEL, NO_LABEL]  # 3 = Vd: a label the head cannot hit
    assert batch.inputs[1].tolist() == [12, 13, 14, 0, 0]
    assert batch.labels[1].tolist() == [1, 3, NO_LABEL, NO_LABEL, NO_LABEL]


def test_draft_vocab_is_the_most_frequent_labels_and_packing_keeps_order():
    labels = torch.tensor([5, 5, 5, 7, 7, 2, 9, 9, 9, 9, 3, 3])
    assert choose_draft_vocab(labels, 10, 3).tolist() == [3, 5, 9]  # 9x4, 5x3, then 3 and 7 tie: lower id
    assert pack([5, 3, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]


def test_resuming_with_another_target_is_a_one_line_error(chat_target, prompt_file, tiny_dirs, tmp_path):
    """A run (its answers, features and head) belongs to the target it was made for."""
    out = tmp_path / "head"
    train_draft(tiny_config(out, chat_target, prompt_file, epochs=1))
    other = tmp_path / "other"
    shutil.copytree(tiny_dirs["qwen3"][0], other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_target / name, other / name)
    with pytest.raises(FastspecError, match="was made for the target"):
        train_draft(tiny_config(out, other, prompt_file, epochs=2, resume=True))
