"""Lossy acceptance thresholds (below 1) relax only sampled requests: a greedy request (temperature 0 or top_k 1)
verified in the same batch takes the exact walk, so its output is the target's own token for token, and the engine
(LLM.generate / stream / chat, serve's HTTP requests) serves it. Where a command decodes only greedily the CLI
refuses the thresholds before loading (test_generate); with no speculative algorithm, the CLI and LLM refuse them."""

import json

import pytest
from serve_helpers import engine_settled, raw, start_server
from tiny_models import make_hf_model, write_word_tokenizer
from typer.testing import CliRunner

import fastspec
from fastspec import SamplingParams
from fastspec.cli import app
from fastspec.errors import FastspecError

SAMPLED = SamplingParams(temperature=0.8, seed=1, max_new_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
TOP_K_1 = SamplingParams(temperature=0.8, top_k=1, seed=2, max_new_tokens=12, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(lossy, plain): a tiny llama with a word-level tokenizer, drafted by a different random llama (STANDALONE,
    mostly wrong drafts) with threshold_single 0 (any draft accepted) and threshold_acc 0.2; and the same target
    decoding alone."""
    root = tmp_path_factory.mktemp("lossy")
    make_hf_model("llama").save_pretrained(root / "target")
    write_word_tokenizer(root / "target")
    make_hf_model("llama", seed=5, num_hidden_layers=1).save_pretrained(root / "draft")
    common = dict(max_total_tokens=2048, max_running_requests=4)
    lossy = fastspec.LLM(str(root / "target"), speculative_algorithm="STANDALONE", draft_model=str(root / "draft"),
                         num_steps=3, topk=2, num_draft_tokens=5, accept_threshold_single=0.0,
                         accept_threshold_acc=0.2, **common)
    return lossy, fastspec.LLM(str(root / "target"), speculative_algorithm="NONE", **common)


def test_a_greedy_request_beside_sampled_ones_decodes_as_the_target_alone(models):
    """One batch of a greedy, a sampled and a top_k 1 request: both greedy ones emit the target-only greedy tokens
    (threshold_single 0 read for them accepted every draft); the sampled one accepts drafts and draws as it does
    alone (seeded). stream and chat serve greedy requests too."""
    lossy, plain = models
    want = [c.output_ids for c in plain.generate([PROMPTS[0], PROMPTS[2]], GREEDY)]
    mixed = lossy.generate(PROMPTS, [GREEDY, SAMPLED, TOP_K_1])
    assert [mixed[0].output_ids, mixed[2].output_ids] == want
    assert all(c.metrics.verify_rounds > 0 for c in mixed)
    assert mixed[1].output_ids == lossy.generate([PROMPTS[1]], SAMPLED)[0].output_ids
    assert [c.output_ids for c in lossy.generate([PROMPTS[0], PROMPTS[2]], GREEDY)] == want  # (all greedy: exact)
    text = "".join(d.text for step in lossy.stream("w3 w4 w5", GREEDY) for d in step)
    assert text == plain.generate(["w3 w4 w5"], GREEDY)[0].text
    chat = [{"role": "user", "content": "w3"}]
    assert lossy.chat(chat, GREEDY)[0].output_ids == plain.chat(chat, GREEDY)[0].output_ids
    lossy.engine.check_kv()


def test_serve_answers_greedy_and_scoring_requests_with_lossy_thresholds(models):
    """temperature 0, top_k 1, a greedy chat, lm-eval's scoring (echo with max_tokens 0; max_tokens 1 at
    temperature 0) and sampled n choices are all a 200; the greedy completion is the target's own."""
    lossy, plain = models
    server, thread, service, url, _ = start_server(lossy, "lossy", max_queued=8)
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 4}
        asks = (("/v1/completions", body | {"temperature": 0}), ("/v1/completions", body | {"top_k": 1}),
                ("/v1/chat/completions", chat | {"temperature": 0}),
                ("/v1/completions", body | {"max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}),
                ("/v1/completions", body | {"max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}),
                ("/v1/completions", body | {"n": 2, "seed": 3, "temperature": 0.7}))
        answers = []
        for path, ask in asks:
            status, data = raw(url, "POST", path, json.dumps(ask).encode())
            assert status == 200 and len(data["choices"]) == ask.get("n", 1), (ask, data)
            answers.append(data)
        want = plain.generate([PROMPTS[0]], GREEDY)[0].text
        assert [answers[i]["choices"][0]["text"] for i in (0, 1)] == [want, want]
        assert engine_settled(service)
    finally:
        server.should_exit = True
        thread.join(10)
        service.stop()


def test_thresholds_without_speculation_are_refused_in_one_line(models, tmp_path):
    """NONE (given, or the default of a model without a shipped head) drafts nothing, so nothing would read the
    thresholds: LLM refuses them naming its keyword, the CLI naming its flag, before loading."""
    target = models[1].engine.model_dir
    for algorithm in ("NONE", None):
        with pytest.raises(FastspecError, match="^accept_threshold_single does not apply to speculative_algorithm "
                                                "NONE: it would be ignored$"):
            fastspec.LLM(str(target), speculative_algorithm=algorithm, accept_threshold_single=0.5)
    with pytest.raises(FastspecError, match="^accept_threshold_acc does not apply"):
        fastspec.LLM(str(target), speculative_algorithm="NONE", accept_threshold_acc=0.5)
    with pytest.raises(FastspecError, match="^num_steps does not apply to speculative_algorithm NONE"):
        fastspec.LLM(str(target), num_steps=3)  # (the tree options too: no head drafts by default here)
    for algorithm in (["--speculative-algorithm", "NONE"], []):
        result = CliRunner().invoke(app, ["generate", "--model", str(target), "--prompt", "w3", "--temperature",
                                          "0.7", *algorithm, "--speculative-accept-threshold-single", "0.5"])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert ("--speculative-accept-threshold-single does not apply to --speculative-algorithm NONE: it would be "
                "ignored") in result.stderr
    result = CliRunner().invoke(app, ["generate", "--model", str(target), "--prompt", "w3",
                                      "--speculative-num-draft-tokens", "4"])
    assert result.exit_code == 2 and "--speculative-num-draft-tokens does not apply" in result.stderr, result.output
