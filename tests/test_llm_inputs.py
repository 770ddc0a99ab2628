"""fastspec.LLM's inputs as a vLLM user gives them: token ids streamed from a checkpoint without a tokenizer, prompts
as numpy / torch arrays, a tokenizer given apart from the model (LLM(tokenizer=...), --tokenizer), and a chat's
last message continued (continue_final_message, in LLM.chat and serve)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from fake_hub import add_snapshot, commit_id
from serve_helpers import raw, start_server
from tiny_models import WORDS, make_hf_model, write_word_tokenizer
from tokenizers import Tokenizer
from typer.testing import CliRunner

import fastspec
from fastspec import SamplingParams
from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.text.tokenizer import Tokenizer as FastTokenizer
from fastspec.models.hub import resolve_tokenizer_dir, tokenizer_eos_ids

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """A tiny llama checkpoint shipped without a tokenizer (config and weights only)."""
    directory = tmp_path_factory.mktemp("bare-target")
    make_hf_model("llama").save_pretrained(directory)
    assert not (directory / "tokenizer.json").exists()
    return directory


@pytest.fixture(scope="module")
def bare_llm(bare_dir):
    return fastspec.LLM(str(bare_dir), speculative_algorithm="NGRAM", max_total_tokens=512)


def test_token_ids_stream_without_a_tokenizer_as_they_generate(bare_llm):
    """generate of ids needs no tokenizer (text None); stream of the same ids yields the same tokens step by step,
    text None, each prompt finished once with generate's reason (it failed loading tokenizer.json). Stop strings
    are text: a one-line refusal."""
    expected = bare_llm.generate(PROMPTS, PARAMS)
    assert all(c.text is None for c in expected)
    got, reasons = [[], []], {}
    for step in bare_llm.stream(PROMPTS, PARAMS):
        for delta in step:
            assert delta.text is None and delta.index not in reasons
            got[delta.index] += delta.new_ids
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
    assert got == [c.output_ids for c in expected]
    assert reasons == {i: c.finish_reason for i, c in enumerate(expected)} == {0: "length", 1: "length"}
    with pytest.raises(FastspecError, match="cannot load the tokenizer"):
        next(bare_llm.stream(PROMPTS, SamplingParams(max_new_tokens=8, stop=("x",))))
    assert [c.output_ids for c in bare_llm.generate(PROMPTS, PARAMS)] == got  # (the refused stream left nothing)


def test_numpy_and_torch_prompts_are_token_id_lists(bare_llm):
    """A 1-D integer array is one prompt's ids (as a flat list of ints is), a 2-D one a batch, and arrays may stand in
    a list of prompts; the output is the lists' output. Bool and float arrays (and bools in a list), and arrays of the
    wrong rank, are one-line refusals."""
    expected = [c.output_ids for c in bare_llm.generate(PROMPTS, PARAMS)]

    def outputs(prompts):
        return [c.output_ids for c in bare_llm.generate(prompts, PARAMS)]

    assert outputs(np.array(PROMPTS)) == outputs(torch.tensor(PROMPTS, dtype=torch.int32)) == expected
    assert outputs([np.array(PROMPTS[0], dtype=np.uint16), torch.tensor(PROMPTS[1])]) == expected
    assert outputs(np.array(PROMPTS[1])) == outputs(torch.tensor(PROMPTS[1])) == expected[1:]
    assert outputs(list(np.array(PROMPTS[1]))) == expected[1:]  # (numpy's ints in a flat list: one prompt too)
    assert bare_llm.generate(np.array(PROMPTS[0]), PARAMS)[0].prompt_ids == PROMPTS[0]  # Python ints
    assert type(bare_llm.generate(np.array(PROMPTS[0]), PARAMS)[0].prompt_ids[0]) is int
    streamed = [d.new_ids for step in bare_llm.stream(torch.tensor(PROMPTS[:1]), PARAMS) for d in step]
    assert sum(streamed, []) == expected[0]
    array = "prompts as an array must"
    for prompts, message in ((np.array(PROMPTS, dtype=np.float16), f"{array} hold integer token ids, got float16"),
                             (torch.tensor([True, False]), f"{array} hold integer token ids, got bool"),
                             ([torch.tensor([1.0, 2.0])], "a prompt as an array must hold integer token ids"),
                             (np.zeros((1, 2, 3), dtype=np.int64), f"{array} be 1-D .* or 2-D .*, got 3-D"),
                             ([np.array(PROMPTS)], r"a prompt as an array must be 1-D \(one prompt's ids\), got 2-D"),
                             (np.ma.array(PROMPTS[0], mask=[0, 1, 0, 0]), f"{array} hold integer token ids, got mask"),
                             (torch.tensor(PROMPTS[0], device="meta"), "prompts as an array cannot be read"),
                             ([np.True_, np.False_], "prompts: token ids must be ints, got a bool"),
                             (np.int64(3), r"prompts must be a string, a list of token ids \(one prompt\), a list of "
                                           "strings or a list of token-id lists")):
        with pytest.raises(FastspecError, match=f"^{message}"):
            bare_llm.generate(prompts, PARAMS)


TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<user>{% else %}<bot>{% endif %} {{ m.content }} </s> "
            "{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}")


@pytest.fixture(scope="module")
def words_dir(tmp_path_factory):
    """A tokenizer of its own (no model): word-level, `wN` is id N, with a chat template that tells roles apart."""
    return write_word_tokenizer(tmp_path_factory.mktemp("words") / "tokenizer", template=TEMPLATE)


@pytest.fixture(scope="module")
def words_llm(bare_dir, words_dir):
    return fastspec.LLM(str(bare_dir), tokenizer=words_dir, speculative_algorithm="NGRAM", max_total_tokens=512)


def test_a_tokenizer_given_apart_from_the_model_reads_and_writes_its_text(bare_llm, words_llm, words_dir):
    """LLM(tokenizer=dir) on a checkpoint without one: text prompts are its ids (wN -> N), the answer is the ids the
    model gives those ids and their text in that tokenizer, streamed or not."""
    theirs = Tokenizer.from_file(str(words_dir / "tokenizer.json"))
    expected = bare_llm.generate(PROMPTS, PARAMS)
    got = words_llm.generate(["w3 w4 w5 w6", "w7 w8 w9 w10"], PARAMS)
    assert [c.prompt_ids for c in got] == PROMPTS
    assert [c.output_ids for c in got] == [c.output_ids for c in expected]
    assert [c.text for c in got] == [" " + theirs.decode(c.output_ids) for c in expected]  # (after the prompt's words)
    streamed = ["", ""]
    for step in words_llm.stream(["w3 w4 w5 w6", "w7 w8 w9 w10"], PARAMS):
        for delta in step:
            streamed[delta.index] += delta.text
    assert streamed == [c.text for c in got]
    # grammars read it too (this word-level one llguidance cannot use; the model's own: "needs the model's tokenizer")
    with pytest.raises(FastspecError, match=re.escape(f"{words_dir / 'tokenizer.json'}: structured output cannot")):
        words_llm.generate([[3, 4]], SamplingParams(max_new_tokens=1, regex="w(41|42)"))


def test_a_tokenizer_that_names_nothing_or_does_not_fit_is_one_line(bare_dir, words_dir, tmp_path, monkeypatch):
    """A path that is neither a directory nor a hub id, a directory without tokenizer.json, an empty name (it read
    the current directory), a .gguf file that is not there, or a tokenizer with ids past the model's vocabulary (97;
    here an embedded model's, which is taken): a FastspecError before any weight is read. A hub id is its tokenizer
    files in the hub cache (offline and not cached: one line too). SGLang's tokenizer_path names fastspec's keyword."""
    big = write_word_tokenizer(tmp_path / "big", words=[f"w{i}" for i in range(3, 120)])
    for tokenizer, message in ((tmp_path / "nope", "is neither a directory with tokenizer.json, a Hugging Face hub id"),
                               (bare_dir, "has no tokenizer.json"), ("", "tokenizer is empty: give a directory with "
                                                                         "tokenizer.json, a Hugging Face hub id"),
                               (" ", "tokenizer is empty"), (tmp_path / "x.gguf", "tokenizer file .* does not exist"),
                               ("smollm2-135m-instruct", "does not fit the model: it has token ids up to 491"),
                               (big, "does not fit the model: it has token ids up to 121, the model's vocabulary 97"),
                               ("tiny-org/uncached", "tiny-org/uncached's tokenizer.json is not in the Hugging Face "
                                                     "cache .* and HF_HUB_OFFLINE is set")):
        with pytest.raises(FastspecError, match=f"^(tokenizer {tokenizer} )?{message}"):
            fastspec.LLM(str(bare_dir), tokenizer=str(tokenizer), max_total_tokens=256)
    with pytest.raises(FastspecError, match="LLM has no option 'tokenizer_path'; use tokenizer$"):
        fastspec.LLM(str(bare_dir), tokenizer_path=str(words_dir))
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, "tiny-org/words", words_dir, commit_id(1))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_tokenizer_dir("tiny-org/words", 97) == snapshot


def test_a_tokenizer_given_apart_ends_an_answer_with_its_own_eos(bare_dir, bare_llm, tmp_path):
    """A tokenizer given apart from the model, or the model's own, ends an answer on its eos token as well as on the
    model's config's (vLLM stops on the tokenizer's eos too): here the word the model greedily writes at some step
    is that tokenizer's eos, so the answer stops there (reason stop) and is the model's own up to it. Only an id the
    model's vocabulary holds counts."""
    expected = bare_llm.generate(PROMPTS[:1], PARAMS)[0].output_ids
    model_eos = bare_llm.engine.worker.eos_ids
    at = next(i for i, t in enumerate(expected) if i > 0 and 3 <= t < 3 + len(WORDS) and t not in expected[:i]
              and not model_eos & set(expected[:i + 1]))
    eos_dir = write_word_tokenizer(tmp_path / "eos")
    config = json.loads((eos_dir / "tokenizer_config.json").read_text())
    (eos_dir / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": WORDS[expected[at] - 3]}))
    assert tokenizer_eos_ids(eos_dir, 97) == {expected[at]} and tokenizer_eos_ids(eos_dir, expected[at]) == set()
    llm = fastspec.LLM(str(bare_dir), tokenizer=str(eos_dir), speculative_algorithm="NGRAM", max_total_tokens=512)
    assert llm.engine.worker.eos_ids == model_eos | {expected[at]}
    got = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8))[0]
    assert (got.output_ids, got.finish_reason) == (expected[:at + 1], "stop")
    assert llm.generate(PROMPTS[:1], PARAMS)[0].output_ids == expected  # (ignore_eos: on to the length)
    own = shutil.copytree(bare_dir, tmp_path / "own")  # the same tokenizer as the model's own counts the same
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(eos_dir / f, own / f)
    llm = fastspec.LLM(str(own), speculative_algorithm="NGRAM", max_total_tokens=512)
    assert llm.engine.worker.eos_ids == model_eos | {expected[at]}


def test_the_cli_takes_a_tokenizer(bare_dir, words_dir, words_llm):
    """--tokenizer (SGLang's --tokenizer-path too) on the model commands: generate's text prompt is read with it and
    its answer written with it, as the LLM's; one that names nothing is a one-line usage error before any loading."""
    expected = words_llm.generate(["w3 w4 w5"], PARAMS)[0]
    args = ["generate", "--model", str(bare_dir), "--prompt", "w3 w4 w5", "--max-new-tokens", "8", "--ignore-eos",
            "--max-total-tokens", "512", "--speculative-algorithm", "NGRAM", "--json"]
    done = CliRunner().invoke(app, [*args, "--tokenizer-path", str(words_dir)])
    assert done.exit_code == 0, done.output
    record = json.loads(done.stdout)
    assert (record["output_ids"], record["text"]) == (expected.output_ids, expected.text)
    refused = CliRunner().invoke(app, [*args, "--tokenizer", str(bare_dir / "nope")])
    assert refused.exit_code != 0 and "is neither a directory with tokenizer.json, a Hugging Face hub" in refused.output
    empty = CliRunner().invoke(app, [*args, "--tokenizer", ""])
    assert empty.exit_code != 0 and "tokenizer is empty: give a directory" in empty.output


def test_a_gguf_files_tokenizer_is_read_alone(tmp_path):
    """LLM(tokenizer=a .gguf file): its tokenizer files alone are written once into the models' cache (no weights, as
    a model's conversion would write), and read text as the file's conversion does, chat template included."""
    from gguf_writers import TEMPLATE as GGUF_TEMPLATE, tiny_llama, write_gguf

    from fastspec.models.gguf import convert_gguf

    path = write_gguf(tmp_path / "t.gguf", tiny_llama(True))
    model_dir = tmp_path / "bare"
    tiny_llama(True).save_pretrained(model_dir)
    llm = fastspec.LLM(str(model_dir), tokenizer=str(path), max_total_tokens=256)
    directory = llm.sources.tokenizer_dir
    assert sorted(f.name for f in directory.iterdir()) == ["fastspec_source.json", "tokenizer.json",
                                                          "tokenizer_config.json"]
    converted = FastTokenizer(convert_gguf(path, tmp_path / "converted"))
    for text in ("the 12 ll", "<custom> hello"):
        assert llm.encode(text) == converted.encode(text, add_special_tokens=True)
    assert llm.tokenizer.chat_template == converted.chat_template == GGUF_TEMPLATE
    again = fastspec.LLM(str(model_dir), tokenizer=str(path), max_total_tokens=256)
    assert again.sources.tokenizer_dir == directory  # (written once)


CONVERSATIONS = [[{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5 w6"}],
                 [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w5 w6 "}],  # (seen before)
                 [{"role": "user", "content": "w7"}]]


def transformers_template(directory, template: str, messages: list[dict], **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), chat_template=template)
    return theirs.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_continues_the_final_message_as_transformers_templates_it(bare_llm, words_llm, words_dir, tmp_path):
    """continue_final_message (vLLM's LLM.chat keyword): the prompt is transformers' apply_chat_template(...,
    continue_final_message=True) text, which ends inside the last message (no end of turn, no new turn), also where
    that text appeared before and where the template trims it; the answer is the model's for those ids.
    add_generation_prompt=False alone ends after the last turn. Both at once, or a template that does not show the
    content, are one-line refusals; the caller's messages are left as they were."""
    theirs = Tokenizer.from_file(str(words_dir / "tokenizer.json"))
    for messages in CONVERSATIONS:
        text = transformers_template(words_dir, TEMPLATE, messages, continue_final_message=True,
                                     add_generation_prompt=False)
        assert words_llm.tokenizer.apply_chat_template(messages, continue_final_message=True) == text
        ids = theirs.encode(text, add_special_tokens=False).ids
        for kwargs in ({}, {"add_generation_prompt": False}):
            got = words_llm.chat(messages, PARAMS, continue_final_message=True, **kwargs)[0]
            assert got.prompt_ids == ids and got.output_ids == bare_llm.generate([ids], PARAMS)[0].output_ids
        ended = transformers_template(words_dir, TEMPLATE, messages, add_generation_prompt=False)
        assert words_llm.encode_chat(messages, add_generation_prompt=False) == theirs.encode(
            ended, add_special_tokens=False).ids
    assert words_llm.encode_chat(CONVERSATIONS[0])[-1] == 91  # (by default: a new assistant turn, <bot>)
    trimmed = "{% for m in messages %}<user> {{ m.content | trim }}</s>{% endfor %}"
    directory = write_word_tokenizer(tmp_path / "trimmed", template=trimmed)
    assert (FastTokenizer(directory).apply_chat_template(CONVERSATIONS[1], continue_final_message=True)
            == transformers_template(directory, trimmed, CONVERSATIONS[1], continue_final_message=True,
                                     add_generation_prompt=False) == "<user> w5 w6</s><user> w5 w6")
    original = [dict(m) for m in CONVERSATIONS[0]]
    with pytest.raises(FastspecError, match="^continue_final_message continues the last message, "
                                            "add_generation_prompt starts a new one: give add_generation_prompt=False"):
        words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True, add_generation_prompt=True)
    hidden = write_word_tokenizer(tmp_path / "hidden", template="{% for m in messages %}<user>{% endfor %}")
    with pytest.raises(FastspecError, match="^continue_final_message: the chat template does not show the last "):
        FastTokenizer(hidden).apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    assert CONVERSATIONS[0] == original


def test_serve_takes_continue_final_message(words_llm):
    """vLLM's chat-completion extras continue_final_message and add_generation_prompt: the answer is LLM.chat's
    continuation of the last message; a wrong type or both set is a 400 naming them."""
    expected = words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True)[0]
    streamed = "".join(d.text for step in words_llm.stream([expected.prompt_ids], PARAMS) for d in step)
    assert streamed == expected.text
    server, thread, service, url, _ = start_server(words_llm, "words", max_queued=8)
    try:
        body = {"messages": CONVERSATIONS[0], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        continued = {"continue_final_message": True}
        for extra in (continued, continued | {"add_generation_prompt": False}):
            status, data = raw(url, "POST", "/v1/chat/completions", json.dumps(body | extra).encode())
            assert status == 200, data
            assert data["choices"][0]["message"]["content"] == expected.text
            assert data["usage"]["prompt_tokens"] == len(expected.prompt_ids)
        for extra, message, param in (
                ({"continue_final_message": "yes"}, "continue_final_message must be of type bool",
                 "continue_final_message"),
                ({"continue_final_message": True, "add_generation_prompt": True},
                 "continue_final_message continues the last message, add_generation_prompt starts",
                 "add_generation_prompt"),
                ({"messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": [
                    {"type": "text", "text": "w4"}]}], "continue_final_message": True}, None, None)):
            status, data = raw(url, "POST", "/v1/chat/completions", json.dumps(body | extra).encode())
            if message is None:  # (serve joins text parts: a continued message of parts is continued as its text)
                assert status == 200, data
                continue
            assert status == 400 and data["error"]["message"].startswith(message), data
            assert data["error"]["param"] == param, data
    finally:
        server.should_exit = True
        thread.join(10)
        service.stop()


def test_generate_writes_the_text_a_stream_shows_with_or_without_stop_strings(words_llm, words_dir):
    """A completion's text is its tokens decoded after the prompt's, as stream, serve and generate with stop strings
    write it: a word-level tokenizer (as SentencePiece's) writes the space before the first word, so a continued
    message's content + the answer's text is the message continued (generate without stop strings decoded the output
    alone: 'w12 ...' where its stream said ' w12 ...')."""
    theirs = Tokenizer.from_file(str(words_dir / "tokenizer.json"))
    never = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=("w999",))
    plain = words_llm.generate("w3 w4 w5 w6", PARAMS)[0]
    streamed = "".join(d.text for step in words_llm.stream("w3 w4 w5 w6", PARAMS) for d in step)
    assert plain.text == words_llm.generate("w3 w4 w5 w6", never)[0].text == streamed
    assert plain.text == " " + theirs.decode(plain.output_ids)
    content = CONVERSATIONS[0][-1]["content"]
    continued = words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True)[0]
    assert content + continued.text == theirs.decode(theirs.encode(content).ids + continued.output_ids)
