"""Plain generation end to end on the embedded SmolLM2-135M-Instruct: transformers' greedy `generate` is the
oracle; batching, paging and seeding must not change tokens; bad input is one line and exit code 2. (The tiny test
models' edges, through LLM and the command: test_generate_tiny.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import all_slots_free
from draft_reference import DraftChecker
from typer.testing import CliRunner

import fastspec
from fastspec.cli import app
from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why they are prime."]
NEW = 20


@pytest.fixture(scope="module")
def llm():
    return fastspec.LLM(quantization=None, max_total_tokens=4096, speculative_algorithm="NONE")


@pytest.fixture(scope="module")
def hf_greedy(embedded_dir, llm):
    from fastspec.models.reference import (
        transformers_model,  # (a converted GGUF keeps blocks as blocks only)
    )

    hf = transformers_model(embedded_dir)
    out = {}
    for q in QUESTIONS:
        ids = llm.encode(q, chat=True)
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, eos_token_id=2,
                              pad_token_id=2, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out[q] = gen[0, len(ids):].tolist()
    return out


def test_cli_generate_equals_transformers_greedy(hf_greedy):
    for q in QUESTIONS[:2]:
        result = CliRunner().invoke(app, ["generate", "--chat", "--prompt", q, "--max-new-tokens", str(NEW),
                                          "--max-total-tokens", "2048", "--quantization", "none", "--json"])
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["output_ids"] == hf_greedy[q]
        assert record["text"].strip()


@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_generation_equals_transformers(hf_greedy, page_size):
    llm = fastspec.LLM(quantization=None, max_total_tokens=4096, page_size=page_size, speculative_algorithm="NONE")
    outputs = llm.generate(QUESTIONS, SamplingParams(max_new_tokens=NEW), chat=True)
    assert [o.output_ids for o in outputs] == [hf_greedy[q] for q in QUESTIONS]
    assert "Paris" in outputs[0].text
    assert all_slots_free(llm.engine)  # no slot leaked
    llm.engine.check_kv()


def test_queueing_when_the_pool_is_small(hf_greedy):
    """A pool that holds one request at a time still finishes all of them, in order, with the same tokens."""
    llm = fastspec.LLM(quantization=None, max_total_tokens=96, speculative_algorithm="NONE")
    outputs = llm.generate(QUESTIONS, SamplingParams(max_new_tokens=NEW), chat=True)
    assert [o.output_ids for o in outputs] == [hf_greedy[q] for q in QUESTIONS]


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_new_tokens=12, ignore_eos=True)
    alone = llm.generate([QUESTIONS[0]], params, chat=True)[0]
    prompts = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[0]]
    batched = llm.generate(prompts, [params, SamplingParams(max_new_tokens=5), params], chat=True)
    assert batched[0].output_ids == alone.output_ids == batched[2].output_ids
    assert len(alone.output_ids) == 12 and alone.finish_reason == "length"
    other = llm.generate([QUESTIONS[0]], SamplingParams(temperature=0.9, seed=8, max_new_tokens=12), chat=True)[0]
    assert other.output_ids != alone.output_ids


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/dir", "--prompt", "hi"], "neither a directory"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "0.5", "--seed", "99999999999999999999"], "--seed must be a 64-bit integer"),
    (["--prompt", "hi", "--temperature", "1", "--top-k", "9223372036854775808"], "--top-k must be -1 (off) or in"),
    (["--prompt", "hi", "--stop-token-ids", "99999999"], "error: --stop-token-ids must be in [0, "),
    (["--prompt", "hi", "--max-new-tokens", "abc"], "error: Invalid value for '--max-new-tokens'"),  # (click's
    (["--prompt", "hi", "--no-such-flag"], "error: No such option: --no-such-flag"),  # errors too: one line)
    (["--prompt", "hi", "--speculative-algorithm", "NGRAM", "--draft", "/tmp"], "drafts without one"),
    (["--prompt", "hi", "--speculative-algorithm", "NONE", "--speculative-num-steps", "3"],
     "--speculative-num-steps does not apply to --speculative-algorithm NONE"),
    (["--prompt", "hi", "--speculative-algorithm", "NGRAM", "--speculative-draft-model-revision", "v9"],
     "--speculative-draft-model-revision needs --speculative-draft-model-path"),
    (["--prompt", "hi", "--speculative-algorithm", "NONE", "--speculative-ngram-max-bfs-breadth", "3"],
     "--speculative-ngram-* options does not apply to --speculative-algorithm NONE"),
    (["--prompt", "hi", "--speculative-algorithm", "NGRAM", "--speculative-ngram-min-bfs-breadth", "0"],
     "error: --speculative-ngram-min-bfs-breadth 0 must be >= 1\n"),
    (["--prompt", "hi", "--speculative-algorithm", "NGRAM", "--speculative-token-map", __file__],
     "--speculative-token-map does not apply to --speculative-algorithm NGRAM"),
    (["--prompt", "hi", "--speculative-algorithm", "EAGLE3", "--draft", __file__], "is a file, not a model"),
    (["--prompt", "hi", "--page-size", "3"], "--page-size must be a power of two"),
    (["--prompt", "hi", "--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    # SamplingParams' checks name the flag typed, as every other check does
    (["--prompt", "hi", "--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1, got 0"),
    (["--prompt", "hi", "--top-p", "0"], "error: --top-p must be in (0, 1]"),
    (["--prompt", "hi", "--min-p", "2"], "error: --min-p must be in [0, 1]"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "error: --repetition-penalty must be > 0"),
    (["--input-ids", "1,x"], "comma-separated integers"),
    (["--prompt", "hi", "--input-ids", "1"], "exactly one of --prompt or --input-ids"),
    (["--input-ids", "1,999999"], "error: --input-ids must be token ids in [0, "),
    (["--prompt", "hi", "--max-new-tokens", "99999"], "exceeds the context length"),
    (["--prompt", "hi", "--dtype", "int8"], "unknown dtype"),
    (["--prompt", "hi", "--kv-cache-dtype", "fp4_e2m1"], "--kv-cache-dtype must be one of"),
    (["--prompt", "hi", "--kv-cache-dtype", "bf16", "--attention-backend", "flashinfer"],
     "--kv-cache-dtype bf16 needs --attention-backend torch"),
    (["--prompt", "hi", "--graphs", "cuda", "--device", "cpu"], "--graphs cuda needs a CUDA device, got --device cpu"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(app, ["generate", *args, "--max-total-tokens", "512"])
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


@pytest.mark.parametrize("chat", [False, True])
def test_an_answer_ended_at_once_without_chat_says_why(monkeypatch, chat):
    """A chat model given a raw --prompt often ends at once (EOS first): the empty answer comes with a note that
    --chat applies the template; with --chat, or an answer, no note."""

    from fastspec.llm import LLM

    def generate(self, prompts, params, chat=False, should_stop=None):
        return [SimpleNamespace(output_ids=[2], text="", finish_reason="stop"),
                SimpleNamespace(output_ids=[5, 6], text="Paris", finish_reason="length")]

    monkeypatch.setattr(LLM, "generate", generate)
    args = ["generate", "--prompt", "Capital of France?", "--prompt", "x", "--max-total-tokens", "512"]
    result = CliRunner().invoke(app, args + (["--chat"] if chat else []))
    assert result.exit_code == 0, result.output
    assert result.stdout == "--- answer 1 of 2 ---\n\n--- answer 2 of 2 ---\nParis\n"
    assert ("--chat applies its chat template" in result.stderr) != chat


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("sampling, flags", [
    ([], ["--speculative-accept-threshold-acc", "0.5"]),
    (["--temperature", "0.7", "--top-k", "1"], ["--speculative-accept-threshold-single", "0.3",
                                                "--speculative-accept-threshold-acc", "0.5"])])
def test_lossy_thresholds_are_refused_where_decoding_is_greedy(command, sampling, flags):
    """Greedy acceptance (temperature 0, or top-k 1) is exact whatever the thresholds: generate and chat ran as if
    they were not given, where bench and tune refuse them."""
    prompt = ["--prompt", "hi"] if command == "generate" else []
    result = CliRunner().invoke(app, [command, *prompt, *sampling, *flags], input="hi\n")
    named = ", ".join(flag for flag in flags if flag.startswith("--"))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert (f"{named} {'are' if ', ' in named else 'is'} not used: fastspec {command} decodes greedily here "
            "(--temperature 0 or --top-k 1), where acceptance is exact whatever the thresholds") in result.stderr


def test_missing_model_directory_files(tmp_path):
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert result.exit_code == 2 and "has no config.json" in result.stderr


@pytest.mark.parametrize("algorithm, steps, topk, n", [("EAGLE3", 3, 2, 4), ("EAGLE", 2, 1, 3), ("NGRAM", None, None, 6)])
def test_speculative_on_the_embedded_model_equals_transformers(hf_greedy, embedded_dir, tmp_path, algorithm, steps,
                                                               topk, n):
    """An untrained (random) head or NGRAM on SmolLM2-135M-Instruct: greedy output unchanged."""
    from fastspec.models.heads import write_random_head
    from fastspec.models.loader import read_config

    c = read_config(embedded_dir)
    kind = "eagle3" if algorithm == "EAGLE3" else "eagle"
    head = (write_random_head(tmp_path / kind, c.hidden_size, c.vocab_size, kind, draft_vocab=2048)
            if algorithm != "NGRAM" else None)
    llm = fastspec.LLM(quantization=None, speculative_algorithm=algorithm, draft_model=str(head) if head else None, num_steps=steps,
                       topk=topk, num_draft_tokens=n, max_total_tokens=4096)
    outputs = llm.generate(QUESTIONS, SamplingParams(max_new_tokens=NEW), chat=True)
    assert [o.output_ids for o in outputs] == [hf_greedy[q] for q in QUESTIONS]
    assert all(o.metrics.verify_rounds > 0 for o in outputs)
    assert all_slots_free(llm.engine)


def test_the_shipped_eagle3_head_is_the_default_and_is_trained(hf_greedy):
    """`fastspec.LLM()` on the embedded model speculates with the head in fastspec/heads: lossless, and it
    accepts drafts."""
    from fastspec.models.embedded import DEFAULT_MODEL, embedded_head
    from fastspec.tune.replay import record, replay_tau

    llm = fastspec.LLM(quantization=None, max_total_tokens=4096, tuned=False)
    e = llm.engine
    assert e.spec.algorithm == "EAGLE3"
    assert e.spec.draft_model == str(embedded_head(DEFAULT_MODEL))
    e.policy = None  # every round speculates (no timing decides), so the replay below walks the same rounds
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    # the draft's KV and state before every round equal a fresh draft prefill's (30 layers round further apart
    # than the tiny models: ~2e-4 here, a wrong position or row changes them by O(0.1))
    checker = DraftChecker(e, [p + hf_greedy[q] for p, q in zip(prompts, QUESTIONS)], dict(atol=2e-3, rtol=2e-3))
    outputs = llm.generate(QUESTIONS, SamplingParams(max_new_tokens=NEW), chat=True)
    assert [o.prompt_ids for o in outputs] == prompts and checker.trees >= checker.checked / 2 > 0
    assert [o.output_ids for o in outputs] == [hf_greedy[q] for q in QUESTIONS]
    metrics = sum((o.metrics for o in outputs[1:]), outputs[0].metrics)
    # acceptance pinned exactly: the replay drafts each round from one draft prefill of the sequence (no backlog,
    # extend or graph of the engine's), and its rounds accept what the engine's did
    recorded = [record(e.model, e.drafter.model, e.drafter.hot_token_id, e.feature, o.prompt_ids, o.output_ids,
                       [e.spec.params]) for o in outputs]
    assert replay_tau(recorded, e.spec.params) == (metrics.verify_rounds, metrics.emitted_tokens)
    assert metrics.tau > 1.3  # the head is trained: a random head of the same shape stays at ~1.0
