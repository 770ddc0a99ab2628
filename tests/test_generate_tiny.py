"""Generation on the tiny test models, through LLM and `fastspec generate`: token ids without a tokenizer, malformed
API input (one line, the LLM still usable), the model argument's types, a stop string the last allowed token
completes, and the load a server reads while a step runs. (The embedded model against transformers:
test_generate.py.)"""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import all_slots_free
from tiny_models import write_char_tokenizer
from typer.testing import CliRunner

import fastspec
from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_a_model_without_a_tokenizer_generates_from_ids(tiny_dirs):
    """Token ids need no tokenizer: the tiny test models ship none (text is null in --json, ids otherwise)."""
    model = str(tiny_dirs["llama"][0])
    expected = fastspec.LLM(model, max_total_tokens=512).engine.generate(
        [[1, 2, 3]], [SamplingParams(max_new_tokens=5, ignore_eos=True)])[0].output_ids
    args = ["generate", "--model", model, "--input-ids", "1,2,3", "--max-new-tokens", "5", "--ignore-eos",
            "--max-total-tokens", "512"]
    record = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert record["output_ids"] == expected and record["text"] is None
    assert (record["verify_rounds"], record["plain_tokens"]) == (0, 5)  # (no draft: every token decoded plainly)
    from fastspec.cli.generate import as_record
    from fastspec.utils.metrics import SpecMetrics

    drafted = SimpleNamespace(output_ids=[5, 6, 7, 8], text=None, finish_reason="length", prompt_ids=[1],
                              logprobs=None, metrics=SpecMetrics().add_round(2, 3))  # the prefill's token + 3
    assert as_record([drafted])["plain_tokens"] == 1
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0 and plain.stdout.strip() == ",".join(map(str, expected))


def test_malformed_api_input_is_one_line_and_the_llm_stays_usable(tiny_dirs):
    """LLM.generate's prompts and params, LLM's draft and ngram options: each malformed value a FastspecError naming
    it (were AttributeError / TypeError / a zip ValueError from inside), and the LLM answers afterwards."""
    model = str(tiny_dirs["llama"][0])
    llm = fastspec.LLM(model, speculative_algorithm="NGRAM", ngram={"max_bfs_breadth": 2}, max_total_tokens=512)
    assert llm.engine.spec.ngram.max_bfs_breadth == 2  # a dict of NgramParams' fields
    for args, message in ((([[1, 2], [3]], [SamplingParams()] * 3), "3 SamplingParams for 2 prompts"),
                          (([1, "w2"],), "prompts mixes token ids with other prompts: give one prompt's ids as a "
                                          "list of ints, or several prompts"), (([[1, 2], 3],), "prompts mixes"),
                          (([True, False],), r"prompts: token ids must be ints, got a bool"),
                          (([[1, True]],), "got a bool"), (([1, 2.0],), "prompts must be a string, a list of token "
                                                                      r"ids \(one prompt\), a list of strings or"),
                          (([[1, 2.5]],), "prompts must be"), ((None,), "prompts must be"),
                          (([[1, 2]], {"max_new_tokens": 3}), "params must be a SamplingParams or a list of them")):
        with pytest.raises(FastspecError, match=message):
            llm.generate(*args)
    with pytest.raises(FastspecError, match="chat=True applies the chat template to text prompts"):
        llm.generate([[1, 2]], chat=True)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0].output_ids
    assert llm.generate([(5, 6, 7)], params)[0].output_ids == expected
    # a flat list of ints is one prompt's ids, as vLLM reads it, in generate and stream alike
    flat = llm.generate([5, 6, 7], params)
    assert len(flat) == 1 and (flat[0].prompt_ids, flat[0].output_ids) == ([5, 6, 7], expected)
    assert llm.generate((5, 6, 7), params)[0].output_ids == expected
    assert sum((d.new_ids for step in llm.stream([5, 6, 7], params) for d in step), []) == expected
    for kwargs, message in ((dict(draft_model=model), r"draft_model needs speculative_algorithm \(EAGLE, EAGLE3 or "
                                                      "STANDALONE\\): without it the draft would be ignored"),
                            (dict(draft_model=model, speculative_algorithm="NGRAM"), "draft_model with "
                                                      "speculative_algorithm NGRAM, which drafts without one"),
                            (dict(speculative_algorithm="NONE", num_steps=3), "num_steps does not apply to "
                                                      "speculative_algorithm NONE: it would be ignored"),
                            (dict(speculative_algorithm="NGRAM", topk=2), "topk does not apply"),
                            (dict(speculative_algorithm="EAGLE3", draft_model=model, token_map=__file__),
                             "token_map does not apply to speculative_algorithm EAGLE3.*bring their own d2t"),
                            (dict(draft_revision="v2"), "draft_revision needs draft_model"),
                            (dict(ngram={"max_bfs_breadth": 2}), "ngram does not apply to speculative_algorithm unset"),
                            (dict(speculative_algorithm="EAGLE3", num_steps=0), r"num_steps must be in \[1, 64\]"),
                            (dict(speculative_algorithm="NGRAM", ngram={"nope": 1}), "ngram has no key 'nope'")):
        with pytest.raises(FastspecError, match=message):
            fastspec.LLM(model, max_total_tokens=512, **kwargs)


def test_the_model_argument_takes_a_path_or_none_and_refuses_other_types(tiny_dirs):
    from pathlib import Path

    directory = tiny_dirs["llama"][0]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    as_path = fastspec.LLM(Path(directory), max_total_tokens=512).engine.generate([[1, 2, 3]], [params])[0]
    as_str = fastspec.LLM(str(directory), max_total_tokens=512).engine.generate([[1, 2, 3]], [params])[0]
    assert as_path.output_ids == as_str.output_ids
    assert fastspec.LLM(None, speculative_algorithm="NONE", max_total_tokens=512).sources.model_dir.is_dir()  # embedded
    with pytest.raises(FastspecError, match="model must be a directory, a hub id.*got int"):
        fastspec.LLM(3)


def last_token_stop(text: str) -> str:
    """The shortest end of `text` found nowhere earlier in it: a stop string that only its last tokens complete."""
    return next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)


def test_a_stop_string_the_last_token_allowed_completes_is_a_stop_not_length(tiny_dirs, tmp_path):
    """A stop string found in the token that reaches max_new_tokens trims the text as any stop string does, and the
    answer ended at the stop string: finish reason stop (as vLLM reports it), not length."""
    import shutil

    model_dir = tmp_path / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    llm = fastspec.LLM(str(write_char_tokenizer(model_dir)), speculative_algorithm="NONE", max_total_tokens=1024)
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=((0, -100), (1, -100), (2, -100)))
    text = llm.generate([[5, 6, 7]], plain)[0].text  # (no special tokens: every token shows a character)
    stop = last_token_stop(text)
    got = llm.generate([[5, 6, 7]], replace(plain, stop=(stop,)))[0]
    assert (got.text, got.finish_reason) == (text[: -len(stop)], "stop")
    deltas = [d for step in llm.stream([[5, 6, 7]], replace(plain, stop=(stop,))) for d in step]
    assert "".join(d.text for d in deltas) == text[: -len(stop)] and deltas[-1].finish_reason == "stop"
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("max_running, expected", [(4, (2, 0)), (1, (1, 1))])
def test_the_load_counts_what_is_admitted_while_its_first_step_runs(tiny_dirs, monkeypatch, max_running, expected):
    """A server's gauges read Engine.load from another thread while a step runs: admitted requests count as running
    (the others as waiting) from the start of their prefill, not once it is done (a long prefill read 0 running)."""
    engine = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="NONE", max_total_tokens=4096,
                          max_running_requests=max_running).engine
    seen, step = [], engine.worker.step

    def recording(batch, prefill):
        seen.append((engine.load.running, engine.load.waiting))
        return step(batch, prefill)

    monkeypatch.setattr(engine.worker, "step", recording)
    engine.generate([[3, 4, 5], [6, 7]], [SamplingParams(max_new_tokens=2)] * 2)
    assert seen[0] == expected


@pytest.mark.parametrize("options, api, flags, cli", [
    (dict(page_size=3), "page_size must be a power of two >= 1, got 3", ["--page-size", "3"],
     "--page-size must be a power of two >= 1, got 3"),
    (dict(max_total_tokens=2, page_size=4), "max_total_tokens must be >= page_size=4, got 2",
     ["--max-total-tokens", "2", "--page-size", "4"], "--max-total-tokens must be >= --page-size 4, got 2"),
    (dict(graphs="cuda", device="cpu"), "graphs='cuda' needs a CUDA device, got device='cpu'",
     ["--graphs", "cuda", "--device", "cpu"], "--graphs cuda needs a CUDA device, got --device cpu"),
    (dict(quantization="gptq"), "quantization='gptq': ", ["--quantization", "gptq"], "--quantization gptq: "),
    (dict(speculative_algorithm="EAGLE", num_steps=2, topk=2, num_draft_tokens=9),
     "num_draft_tokens=9 is infeasible with num_steps=2, topk=2: it must be in [2, 7]",
     ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-eagle-topk", "2",
      "--speculative-num-draft-tokens", "9"],
     "--speculative-num-draft-tokens 9 is infeasible with --speculative-num-steps 2, --speculative-eagle-topk 2: "
     "it must be in [2, 7]")])
def test_an_engine_option_refused_is_named_as_the_caller_typed_it(tiny_dirs, options, api, flags, cli):
    """An engine option's refusal names it by LLM's keyword for a Python caller (with its value as Python writes
    it) and by its flag in a command: the flags' words were once the API's too (`--page-size must be ...` to a
    caller of LLM(page_size=3)). The model's quantisation (read from its checkpoint) is checked past the flags."""
    model = str(tiny_dirs["llama"][0])
    with pytest.raises(FastspecError) as e:
        fastspec.LLM(model, **options)
    assert str(e.value).startswith(api)
    result = CliRunner().invoke(app, ["generate", "--model", model, "--input-ids", "1", *flags])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {cli}") and result.stderr.count("\n") == 1
