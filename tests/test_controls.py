"""Penalties, logit bias and min_p at every position: greedy output equals an independent reference (the
transformers model's logits with the controls applied by hand, token by token), speculative output equals
target-only output under the same controls, and sampled speculative output follows the controlled target
distribution (chi-square)."""

import pytest
import torch
from conftest import make_hf_model
from test_hybrid import oracle_drafter
from test_spec_sampling import triple_probs, triples_p_value

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [2 + 1], [28, 84, 19, 71]]
CONTROLS = [dict(repetition_penalty=1.6), dict(frequency_penalty=0.7, presence_penalty=0.4),
            dict(repetition_penalty=0.8, logit_bias={5: 3.0, 17: -2.0}, presence_penalty=-0.3)]


def controlled(logits, prompt, output, c):
    """The controls by hand, in float64 (the test's own implementation)."""
    logits = logits.double().clone()
    counts = torch.zeros_like(logits)
    for t in output:
        counts[t] += 1
    seen = counts > 0
    for t in prompt:
        seen[t] = True
    r = c.get("repetition_penalty", 1.0)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - c.get("frequency_penalty", 0.0) * counts - c.get("presence_penalty", 0.0) * (counts > 0)
    for t, v in c.get("logit_bias", {}).items():
        logits[t] += v
    return logits


def reference_greedy(hf, prompt, c, n):
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(controlled(logits, prompt, out, c).argmax()))
    return out


@pytest.mark.parametrize("c", CONTROLS)
def test_greedy_with_controls_equals_reference_and_speculation(tiny_dirs, draft_dirs, c):
    directory, hf = tiny_dirs["llama"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **c)
    plain = fastspec.LLM(str(directory), max_total_tokens=4096).engine.generate(PROMPTS, [params] * 4)
    assert [o.output_ids for o in plain] == [reference_greedy(hf, p, c, 12) for p in PROMPTS]
    unpenalized = fastspec.LLM(str(directory), max_total_tokens=4096).engine.generate(
        PROMPTS, [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)
    assert [o.output_ids for o in unpenalized] != [o.output_ids for o in plain]  # the controls did something
    for algorithm, draft, steps, topk, n in (("STANDALONE", str(directory), 4, 3, 8),
                                             ("EAGLE", str(draft_dirs["llama"]["eagle"]), 3, 1, 4),
                                             ("NGRAM", None, None, None, 8)):
        llm = fastspec.LLM(str(directory), speculative_algorithm=algorithm, draft_model=draft, num_steps=steps,
                           topk=topk, num_draft_tokens=n, max_total_tokens=4096)
        if algorithm == "NGRAM":  # the controlled continuation + wrong branches: every node's controls matter
            oracle_drafter(llm.engine, PROMPTS, [o.output_ids for o in plain], hf.config.vocab_size)
        outputs = llm.engine.generate(PROMPTS, [params] * 4)
        assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
        if algorithm == "NGRAM":  # 4-token runs: deeper nodes saw the drafts before them as output
            assert all(len(o.metrics.depth_counts) >= 4 for o in outputs)


VOCAB, PROMPT, SAMPLES = 8, [1, 5, 3], 3000


def test_sampled_speculation_follows_the_controlled_target(tmp_path):
    target = make_hf_model("llama", seed=3, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    target.save_pretrained(tmp_path / "target")
    make_hf_model("llama", seed=9, vocab_size=VOCAB, num_hidden_layers=1, bos_token_id=0,
                  eos_token_id=0).save_pretrained(tmp_path / "draft")
    c = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5, logit_bias={2: 1.0})
    min_p, temperature = 0.05, 0.9

    def dist(logits, output):
        p = torch.softmax(controlled(logits, PROMPT, output, c) / temperature, -1)
        p = torch.where(p < min_p * p.max(), 0, p)
        return p / p.sum()

    with torch.no_grad():
        first = dist(target(torch.tensor([PROMPT])).logits[0, -1], [])
        rows = target(torch.tensor([PROMPT + [t] for t in range(VOCAB)])).logits[:, -1]
        second = torch.stack([dist(rows[t], [t]) for t in range(VOCAB)])
    expected = (first[:, None] * second).flatten() * SAMPLES
    llm = fastspec.LLM(str(tmp_path / "target"), speculative_algorithm="STANDALONE",
                       draft_model=str(tmp_path / "draft"), num_steps=2, topk=2, num_draft_tokens=4,
                       max_total_tokens=20000, max_running_requests=256)
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=s, max_new_tokens=2, ignore_eos=True, **c)
              for s in range(SAMPLES)]
    outputs = llm.engine.generate([PROMPT] * SAMPLES, params)
    pairs = torch.tensor([o.output_ids[0] * VOCAB + o.output_ids[1] for o in outputs])
    observed = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()
    assert observed[expected == 0].sum() == 0  # min_p's dropped tokens never appear
    cells = expected > 5
    chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((int(cells.sum()) - 1) / 2.0), chi2 / 2))
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    assert p_value > 1e-3, f"chi2={float(chi2):.1f}"


@pytest.mark.parametrize("bad, message", [(dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                                          (dict(frequency_penalty=2.5), "frequency_penalty must be in"),
                                          (dict(min_p=1.5), "min_p must be in"),
                                          (dict(logit_bias={-1: 1.0}), "logit_bias must map")])
def test_out_of_range_controls_are_one_line_errors(bad, message):
    with pytest.raises(FastspecError, match=message):
        SamplingParams(**bad)


@pytest.mark.parametrize("bad", [dict(top_p=2.0), dict(top_k=0), dict(max_new_tokens=0), dict(temperature=-1.0),
                                 dict(seed=2**64), dict(stop=("a", "")), dict(repetition_penalty=0.0),
                                 dict(frequency_penalty=2.5), dict(presence_penalty=-3.0), dict(min_p=1.5),
                                 dict(logprobs=21), dict(prompt_logprobs=-1), dict(logit_bias={-1: 1.0})],
                         ids=lambda bad: next(iter(bad)))
def test_each_range_refusal_names_the_keyword_typed(bad):
    """A Python caller who typed top_p=2 reads `top_p must ...`, not `top-p` or `top p` (the CLI swaps the keyword
    for its flag, a server reads its request field from it: both need the keyword first)."""
    (name,) = bad
    with pytest.raises(FastspecError) as e:
        SamplingParams(**bad)
    assert str(e.value).startswith(f"{name} must "), str(e.value)


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=4.5), "max_new_tokens must be an integer"), (dict(max_new_tokens=True), "must be an integer"),
    (dict(top_k=2.5), "top_k must be an integer"), (dict(seed="1"), "seed must be an integer"),
    (dict(logprobs=True), "logprobs must be an integer"), (dict(temperature="0.5"), "temperature must be a number"),
    (dict(stop=None), "stop must be a string or a list"), (dict(stop=(1,)), "stop must be a string or a list"),
    (dict(stop_token_ids="5"), "stop_token_ids must be a token id or a list"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"), (dict(regex=5), "regex must be a string"),
    (dict(json_schema=["x"]), "json_schema must be a string"), (dict(logit_bias=5), "logit_bias must map"),
    (dict(logit_bias={5: "x"}), "logit_bias must map"), (dict(logit_bias={"5": 1, 3: 1}), "logit_bias must map"),
    (dict(logit_bias=[(5,)]), "logit_bias must map")])
def test_parameters_of_the_wrong_type_are_one_line_errors(bad, message):
    """(Before, 4.5 tokens ran as 5, a bool logprobs failed inside generate, a string max_new_tokens was a
    TypeError from a comparison, ignore_eos="no" ignored EOS, a logit bias of 5 was a TypeError.)"""
    with pytest.raises(FastspecError, match=message):
        SamplingParams(**bad)


def test_a_lone_stop_string_or_id_is_one_stop_not_a_sequence_of_them():
    """stop=", 5" is one stop string (as vLLM and the server take it), not the stops ",", " " and "5"."""
    import numpy as np

    params = SamplingParams(stop=", 5", stop_token_ids=np.int64(7), max_new_tokens=np.int64(3),
                            temperature=np.float32(1))
    assert params.stop == (", 5",) and params.stop_token_ids == (7,) and type(params.max_new_tokens) is int
    assert type(params.temperature) is float


@pytest.mark.commands
def test_cli_controls_and_bad_bias(tiny_dirs):
    from typer.testing import CliRunner

    from fastspec.cli import app

    directory, hf = tiny_dirs["llama"]
    c = dict(repetition_penalty=1.6, logit_bias={5: 3.0})
    args = ["generate", "--model", str(directory), "--input-ids", "3,14,15", "--max-new-tokens", "8", "--ignore-eos",
            "--repetition-penalty", "1.6", "--json", "--max-total-tokens", "512"]
    result = CliRunner().invoke(app, args + ["--logit-bias", "5:3.0"])
    assert result.exit_code == 0, result.output
    import json

    assert json.loads(result.stdout)["output_ids"] == reference_greedy(hf, [3, 14, 15], c, 8)
    for bias, message in (("5=3", "--logit-bias must be comma-separated id:bias pairs"),
                          ("500:1", "--logit-bias must name token ids in [0, ")):
        bad = CliRunner().invoke(app, args + ["--logit-bias", bias])
        assert bad.exit_code == 2 and message in bad.stderr, bad.output


@pytest.mark.commands
def test_an_id_past_the_vocabulary_is_named_as_typed(tiny_dirs):
    """The engine's refusal of a token id past the vocabulary names the field as the caller typed it: its keyword
    through the Python API, its flag through generate (it said `stop token ids must be in [0, V)`, no flag)."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    directory, _ = tiny_dirs["llama"]
    llm = fastspec.LLM(str(directory), max_total_tokens=512)
    v = llm.engine.worker.model.config.vocab_size
    cases = [([3, v], {}, "prompt must be token ids", ["--input-ids", f"3,{v}"], "--input-ids must be token ids"),
             ([3], dict(stop_token_ids=[v]), "stop_token_ids must be", ["--stop-token-ids", f"{v}"],
              "--stop-token-ids must be"),
             ([3], dict(logit_bias={v: 1.0}), "logit_bias must name token ids", ["--logit-bias", f"{v}:1"],
              "--logit-bias must name token ids")]
    for prompt, params, says, flags, cli_says in cases:
        with pytest.raises(FastspecError) as e:
            llm.generate([prompt], SamplingParams(max_new_tokens=2, **params))
        assert str(e.value) == f"{says} in [0, {v}), got {v}"
        args = ["generate", "--model", str(directory), "--max-total-tokens", "512", "--max-new-tokens", "2"]
        result = CliRunner().invoke(app, args + ([] if "--input-ids" in flags else ["--input-ids", "3"]) + flags)
        assert (result.exit_code, result.stderr) == (2, f"error: {cli_says} in [0, {v}), got {v}\n"), result.output


def test_min_p_is_taken_over_the_tokens_a_grammar_allows(tiny_dirs, tmp_path):
    """min_p after the grammar's mask: relative to the most likely token the grammar allows, so it never drops
    them all (it was taken before the mask: where the grammar wants EOS and EOS is below min_p x the best token,
    every token was masked and a NaN row drew a token the grammar refused, an AssertionError). The two letters'
    frequencies over seeds, target-only and speculative, chi-square tested against the masked, min_p'd target."""
    import shutil

    from tiny_models import write_char_tokenizer
    directory, hf = tiny_dirs["llama"]
    write_char_tokenizer(shutil.copytree(directory, tmp_path / "char"))
    prompt, letters, min_p, samples = [ord(c) - 30 for c in "go"], [ord(c) - 30 for c in "abcd"], 0.5, 1200

    def dist(logits):
        p = torch.softmax(logits[letters].double(), -1)
        p = torch.where(p < min_p * p.max(), 0, p)
        return p / p.sum()

    with torch.no_grad():
        first = dist(hf(torch.tensor([prompt])).logits[0, -1])
        second = torch.stack([dist(r) for r in hf(torch.tensor([prompt + [t] for t in letters])).logits[:, -1]])
    expected = (first[:, None] * second).flatten() * samples
    assert 0 < int((expected > 0).sum()) < 16  # min_p drops some pairs, not all
    params = [SamplingParams(temperature=1.0, min_p=min_p, seed=s, max_new_tokens=3, regex="[a-d]{2}")
              for s in range(samples)]
    for kw in ({}, dict(speculative_algorithm="STANDALONE", draft_model=str(directory), num_steps=2, topk=2,
                        num_draft_tokens=4)):
        llm = fastspec.LLM(str(tmp_path / "char"), max_total_tokens=40000, max_running_requests=256, **kw)
        outputs = llm.engine.generate([prompt] * samples, params)
        assert all(o.output_ids[2:] == [2] for o in outputs)  # complete after two letters: EOS, though below min_p
        pairs = torch.tensor([letters.index(o.output_ids[0]) * 4 + letters.index(o.output_ids[1]) for o in outputs])
        observed = torch.bincount(pairs, minlength=16).double()
        assert observed[expected == 0].sum() == 0
        cells = expected > 0
        chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
        p_value = float(torch.special.gammaincc(torch.tensor((int(cells.sum()) - 1) / 2.0), chi2 / 2))
        assert p_value > 1e-3, f"{kw}: chi2={float(chi2):.1f}"


@pytest.mark.parametrize("topk, steps, n, temperature, min_p", [(2, 3, 6, 1.0, 0.0), (1, 3, 4, 0.7, 0.1)])
def test_third_tokens_follow_the_target_controlled_by_the_draft_path(tmp_path, topk, steps, n, temperature, min_p):
    """Token 3 comes from a verify node below the root, whose controls count the draft token on its path as output
    (the first comes from the prefill, the second from the root's row: a two-token test never sees a path). 4000
    (t1, t2, t3) triples over seeds, chi-square tested (p > 1e-3) against the controlled target computed by hand;
    the target drafts for itself, so many third tokens are accepted drafts. Ignoring the path fails it (the
    tree at p = 3e-114, the chain on a triple min_p drops)."""
    vocab, samples, c = 6, 4000, dict(repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=1.0,
                                      logit_bias={2: 1.0})
    target = make_hf_model("llama", seed=3, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    target.save_pretrained(tmp_path / "target")

    def dist(logits, output):
        p = torch.softmax(controlled(logits, PROMPT, output, c) / temperature, -1)
        p = torch.where(p < min_p * p.max(), 0, p)
        return p / p.sum()

    expected = triple_probs(target, PROMPT, vocab, dist) * samples
    llm = fastspec.LLM(str(tmp_path / "target"), speculative_algorithm="STANDALONE",
                       draft_model=str(tmp_path / "target"), num_steps=steps, topk=topk, num_draft_tokens=n,
                       max_total_tokens=40000, max_running_requests=256)
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=s, max_new_tokens=3, ignore_eos=True, **c)
              for s in range(samples)]
    outputs = llm.engine.generate([PROMPT] * samples, params)
    assert sum(o.metrics.accepted_tokens for o in outputs) > samples / 4
    assert triples_p_value(outputs, vocab, expected) > 1e-3
