"""A tokenizer given apart from the model (LLM(tokenizer=...), --tokenizer): it reads the prompts' text and writes
the answer's, ends an answer on its own eos too, comes from a directory, a hub id or a .gguf file, and one that names
nothing or does not fit the model is a one-line refusal. (test_llm_inputs.py: the checkpoint without a tokenizer and
the word-level tokenizer these tests share.)"""

import json
import re
import shutil

import pytest
from fake_hub import add_snapshot, commit_id
from test_llm_inputs import PARAMS, PROMPTS, bare_dir, bare_llm, words_dir, words_llm  # noqa: F401  (fixtures)
from tiny_models import WORDS, write_word_tokenizer
from tokenizers import Tokenizer
from typer.testing import CliRunner

import fastspec
from fastspec import SamplingParams
from fastspec.cli import app
from fastspec.errors import FastspecError
from fastspec.text.tokenizer import Tokenizer as FastTokenizer
from fastspec.models.hub import resolve_tokenizer_dir, tokenizer_eos_ids


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
