"""Start-up resolves the models once (fastspec.models.sources): the engine and its worker read the LLM's ModelSources,
a draft that cannot run is refused before any weight is read, and every drafter implements the Drafter front."""

import pytest
import torch

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling.params import SamplingParams
from fastspec.speculative.drafter import Drafter

PROMPTS = [[5, 9, 2, 7, 11], [3, 3, 8]]


def test_the_worker_reads_what_start_up_resolved(tiny_dirs, draft_dirs, monkeypatch):
    from fastspec.engine import worker

    def again(*args, **kwargs):
        raise AssertionError("the worker resolved the models a second time")

    monkeypatch.setattr(worker, "resolve_sources", again)
    head = draft_dirs["llama"]["eagle3"]
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="EAGLE3", draft_model=str(head),
                       num_steps=2, topk=2, num_draft_tokens=4, max_total_tokens=1024)
    sources = llm.sources
    assert llm.engine.worker.sources is sources
    assert sources.model_dir == tiny_dirs["llama"][0] and sources.draft_dir == head
    assert sources.draft_config.is_eagle3 and sources.scheme is None and sources.quantization is None
    assert llm.engine.model_dir == sources.model_dir and llm.engine.worker.eos_ids == sources.eos_ids


@pytest.mark.parametrize("algorithm, draft, message", [
    ("EAGLE", "eagle3", "EAGLE needs a LlamaForCausalLMEagle head"),
    ("STANDALONE", "eagle", "STANDALONE needs a full model"),
    ("EAGLE3", "eagle", "EAGLE3 needs a LlamaForCausalLMEagle3 head"),
])
def test_a_draft_that_cannot_run_is_refused_before_any_weight_is_read(tiny_dirs, draft_dirs, monkeypatch,
                                                                      algorithm, draft, message):
    from fastspec.models import assemble

    monkeypatch.setattr(assemble, "load_target", lambda *a, **k: pytest.fail("weights read before the check"))
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm=algorithm,
                     draft_model=str(draft_dirs["llama"][draft]), max_total_tokens=1024)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_every_drafter_implements_the_drafter_front(tiny_dirs, draft_dirs, algorithm):
    draft = str(draft_dirs["llama"]["eagle3"]) if algorithm == "EAGLE3" else None
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm=algorithm, draft_model=draft,
                       max_total_tokens=1024)
    drafters = llm.engine.worker.drafters
    assert drafters and all(isinstance(d, Drafter) for d in drafters.values())
    plain = fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=1024)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(PROMPTS)
    with torch.inference_mode():
        assert [o.output_ids for o in llm.generate(PROMPTS, params)] == \
            [o.output_ids for o in plain.generate(PROMPTS, params)]


def test_a_draft_head_given_as_the_target_is_one_line(draft_dirs):
    with pytest.raises(FastspecError, match="is a draft head, not a target model"):
        fastspec.LLM(str(draft_dirs["llama"]["eagle3"]), max_total_tokens=1024)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_a_model_whose_tokenizer_cannot_be_read_still_runs_token_ids(tiny_dirs, tmp_path, broken):
    """The model's own tokenizer's eos is a stop id when it can be read; one that cannot (a tokenizer.json this
    tokenizers version refuses, a malformed tokenizer_config.json) adds none: the model loads and its engine runs
    token ids (it was a traceback at load), and the tokenizer's first use is its one-line refusal."""
    import shutil

    from tiny_models import write_word_tokenizer

    model_dir = shutil.copytree(tiny_dirs["llama"][0], tmp_path / "model")
    write_word_tokenizer(model_dir)
    (model_dir / broken).write_text('{"version": "9.9", "model": {"type": "Nope"}' + ("}" if "config" not in broken
                                                                                     else ","))
    llm = fastspec.LLM(str(model_dir), max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    plain = fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=1024)
    assert llm.engine.worker.eos_ids == plain.engine.worker.eos_ids
    assert [o.output_ids for o in llm.engine.generate(PROMPTS, [params] * 2)] == \
        [o.output_ids for o in plain.generate(PROMPTS, params)]
    with pytest.raises(FastspecError, match=f"{broken}: (cannot load the tokenizer|malformed JSON)"):
        llm.generate("w3 w4", params)


def test_a_directory_named_like_a_gguf_file_is_a_directory(tmp_path):
    """A directory named `x.gguf` was taken for a missing GGUF file: as a tokenizer or a model, one lacking its files
    was refused as 'file x.gguf does not exist' (it exists), and a model directory so named was sent to the GGUF
    converter. It is a directory like any other: read where it holds tokenizer.json / config.json, else refused for
    the file it lacks."""
    from tiny_models import make_hf_model, write_word_tokenizer

    from fastspec.models.sources import resolve_model_dir, resolve_tokenizer_dir

    empty = tmp_path / "empty.gguf"
    empty.mkdir()
    with pytest.raises(FastspecError, match=f"^tokenizer {empty} has no tokenizer.json$"):
        resolve_tokenizer_dir(str(empty), 97)
    with pytest.raises(FastspecError, match=f"^model directory {empty} has no config.json$"):
        resolve_model_dir(str(empty))
    model = tmp_path / "model.gguf"
    make_hf_model("llama").save_pretrained(model)
    words = write_word_tokenizer(tmp_path / "words.gguf")
    assert resolve_model_dir(str(model)) == model and resolve_tokenizer_dir(str(words), 97) == words
    llm = fastspec.LLM(str(model), tokenizer=str(words), speculative_algorithm="NGRAM", max_total_tokens=256)
    assert llm.tokenizer.decode(llm.tokenizer.encode("w3 w4")) == "w3 w4"


def test_a_draft_that_cannot_run_is_named_as_given_not_by_its_conversion(tiny_dirs, tmp_path):
    """A STANDALONE draft given as a .gguf file with another vocabulary was refused naming its conversion in the cache
    ('.../gguf/tiny-<key>: draft vocabulary ...'), a path the user never gave: the message names the file given."""
    from gguf_writers import tiny_llama, write_gguf

    draft = write_gguf(tmp_path / "tiny.gguf", tiny_llama(True))
    with pytest.raises(FastspecError, match=f"^{draft}: draft vocabulary 265 != target vocabulary 97$"):
        fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="STANDALONE", draft_model=str(draft),
                     num_steps=2, topk=1, max_total_tokens=256)


def test_a_gguf_file_named_in_capitals_is_a_gguf_file(tmp_path):
    """llama.cpp reads `Model.Q4_0.GGUF` as any GGUF; fastspec refused it as 'a file, not a model directory (a .gguf
    file, or ...)'. The suffix is matched whatever its case, as a model and as a tokenizer."""
    from gguf_writers import tiny_llama, write_gguf

    from fastspec.models.sources import resolve_model_dir, resolve_tokenizer_dir

    path = write_gguf(tmp_path / "Tiny.GGUF", tiny_llama(True))
    assert (resolve_model_dir(str(path)) / "config.json").is_file()
    assert (resolve_tokenizer_dir(str(path), 265) / "tokenizer.json").is_file()
    with pytest.raises(FastspecError, match="^model file .*Gone.GGUF does not exist$"):
        resolve_model_dir(str(tmp_path / "Gone.GGUF"))
