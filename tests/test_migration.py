"""Names a user brings from vLLM and SGLang (SamplingParams fields, LLM keywords, command-line flags): each one
either works as it does there or is refused in one line that names what fastspec has instead, never Python's bare
TypeError or a traceback from inside."""

import pickle
from dataclasses import replace

import pytest

from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams

# vLLM's SamplingParams fields and SGLang's sampling_params keys, each with a value a user would pass
VLLM_FIELDS = dict(n=1, best_of=1, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                   temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=1, stop=["x"], stop_token_ids=[2],
                   ignore_eos=True, max_tokens=8, min_tokens=1, logprobs=2, prompt_logprobs=1, detokenize=True,
                   skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                   truncate_prompt_tokens=5, guided_decoding=None, structured_outputs=None, logit_bias={1: 0.5},
                   bad_words=["x"], allowed_token_ids=[1], logits_processors=[])
SGLANG_FIELDS = dict(max_new_tokens=8, min_new_tokens=1, stop="x", stop_token_ids=[2], stop_regex="x+",
                     temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.5,
                     repetition_penalty=1.1, ignore_eos=True, skip_special_tokens=True, no_stop_trim=True, n=1,
                     json_schema='{"type": "object"}', regex="[0-9]+", ebnf='root ::= "a"', structural_tag="{}",
                     logit_bias={1: 0.5}, sampling_seed=1)


@pytest.mark.parametrize("key, value", [*VLLM_FIELDS.items(), *SGLANG_FIELDS.items()])
def test_every_vllm_and_sglang_sampling_field_works_or_is_one_line(key, value):
    """A field fastspec has takes the value as given; any other is a FastspecError naming it (was a TypeError)."""
    try:
        params = SamplingParams(**{key: value})
    except FastspecError as e:
        assert str(e).startswith(f"SamplingParams has no {key!r}; ") and "\n" not in str(e)
        return
    got, want = getattr(params, key), value
    assert got == (tuple(want) if isinstance(want, list) else (want,) if key == "stop" else
                   tuple(want.items()) if isinstance(want, dict) else want)


@pytest.mark.parametrize("key, hint", [
    ("max_tokens", "use max_new_tokens"), ("sampling_seed", "use seed"), ("n", "answers each prompt once"),
    ("min_tokens", "ignore_eos=True runs an answer to max_new_tokens"),
    ("include_stop_str_in_output", "always trims a stop string"), ("no_stop_trim", "always trims a stop string"),
    ("guided_decoding", "one of the fields json_schema, regex or ebnf"), ("guided_json", "use json_schema"),
    ("temprature", "did you mean temperature?"), ("colour", "its fields are temperature, top_k, top_p")])
def test_a_foreign_sampling_field_names_fastspecs_own(key, hint):
    with pytest.raises(FastspecError, match=f"^SamplingParams has no '{key}'; .*{hint}"):
        SamplingParams(**{key: 1})


def test_sampling_params_still_copy_and_pickle():
    """(The check of foreign keywords is SamplingParams.__new__: copies, replace and pickle pass through it.)"""
    params = SamplingParams(max_new_tokens=5, stop="x", logit_bias={3: 1.0}, json_schema={"type": "object"})
    assert pickle.loads(pickle.dumps(params)) == params
    assert replace(params, seed=3) == SamplingParams(max_new_tokens=5, stop="x", logit_bias={3: 1.0},
                                                     json_schema={"type": "object"}, seed=3)
    assert SamplingParams(0.5, 10) == SamplingParams(temperature=0.5, top_k=10)


@pytest.mark.parametrize("key, value, hint", [
    ("tensor_parallel_size", 2, "runs on one device"), ("tp_size", 2, "runs on one device"),
    ("gpu_memory_utilization", 0.9, "max_total_tokens"), ("mem_fraction_static", 0.8, "max_total_tokens"),
    ("max_model_len", 4096, "use max_context_len"), ("context_length", 4096, "use max_context_len"),
    ("max_num_seqs", 8, "use max_running_requests"), ("trust_remote_code", True, "not needed"),
    ("seed", 0, r"SamplingParams\(seed=...\)"), ("model_path", "x", "use model"),
    ("speculative_num_steps", 3, "use num_steps"), ("speculative_draft_model_path", "x", "use draft_model"),
    ("speculative_eagle_topk", 2, "use topk"), ("speculative_ngram_max_bfs_breadth", 2, "use ngram=.'max_bfs_breadth'"),
    ("enforce_eager", True, "graphs='eager'"), ("max_running_request", 4, "did you mean max_running_requests?")])
def test_a_foreign_llm_option_names_fastspecs_own(key, value, hint):
    """(Was a TypeError naming EngineConfig.__init__, an internal class.) Refused before anything is read."""
    import fastspec

    with pytest.raises(FastspecError, match=f"^LLM has no option '{key}'; .*{hint}"):
        fastspec.LLM(**{key: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_algorithm="NGRAM", num_steps="3"), "num_steps must be an integer, got '3'"),
    (dict(speculative_algorithm="EAGLE3", topk=2.0), "topk must be an integer, got 2.0"),
    (dict(speculative_algorithm="NGRAM", accept_threshold_acc="0.5"), "accept_threshold_acc must be a number"),
    (dict(speculative_algorithm="NGRAM", accept_threshold_single=None), "accept_threshold_single must be a number, "
                                                                         "got None"),
    (dict(speculative_algorithm=5), "speculative_algorithm must be a name such as 'EAGLE3', got 5"),
    (dict(speculative_algorithm="EAGLE3", draft_model=5), "draft_model must be a directory or a hub id, got int"),
    (dict(speculative_algorithm="EAGLE", token_map=5), "token_map must be a file, got int"),
    (dict(revision=5), "revision must be a branch, tag or commit, got 5"),
    (dict(max_context_len=0), r"^max_context_len must be >= 1, got 0"),
    (dict(max_context_len=-5), r"^max_context_len must be >= 1, got -5"),
    (dict(chunked_prefill_size=-1), r"must be >= 1, got -1 \(SGLang's -1, no chunking: pass a size at least"),
    (dict(speculative_algorithm="NGRAM", schedule=5), r"schedule must be \(largest batch size, SpecParams or None\)")])
def test_llm_options_of_the_wrong_type_are_one_line(tiny_dirs, kwargs, message):
    """(Were TypeErrors from a comparison, a regex match or iteration inside, and for a negative max_context_len a
    ValueError from the request table.)"""
    import fastspec

    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=512, **kwargs)


def test_a_foreign_keyword_of_generate_chat_or_stream_is_one_line(tiny_dirs):
    """vLLM's `llm.generate(prompts, sampling_params, use_tqdm=False)` (and SGLang's Engine.generate keywords) were
    TypeErrors naming LLM.generate (found calling the three methods with vLLM's and SGLang's keywords): each is one
    line naming fastspec's own, a misspelling the keyword it is closest to."""
    import fastspec

    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="NONE", max_total_tokens=512)
    one = [{"role": "user", "content": "hi"}]
    for method, prompts, key, hint in [
            ("generate", [[1, 5]], "use_tqdm", "shows no progress bar"),
            ("generate", [[1, 5]], "prompt", "use prompts"),
            ("generate", [[1, 5]], "input_ids", "pass token-id lists as the prompts"),
            ("generate", [[1, 5]], "lora_request", "no LoRA"), ("generate", [[1, 5]], "stream", "use LLM.stream"),
            ("generate", [[1, 5]], "sampling_param", "did you mean sampling_params?"),
            ("chat", one, "use_tqdm", "shows no progress bar"), ("chat", one, "chat_template", "own chat template"),
            ("stream", [[1, 5]], "use_tqdm", "shows no progress bar")]:
        with pytest.raises(FastspecError, match=f"^LLM.{method} has no keyword '{key}'; .*{hint}"):
            list(getattr(llm, method)(prompts, SamplingParams(max_new_tokens=2), **{key: False}))


def test_llm_chat_takes_a_conversation_or_a_list_of_them(tiny_dirs, tmp_path):
    """vLLM's LLM.chat: each conversation through the chat template, answered as generate answers its ids."""
    import json
    import shutil

    import fastspec
    from tiny_models import write_char_tokenizer

    model_dir = tmp_path / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<{{m.role}}>{{m.content}}{% endfor %}<assistant>"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    one = [{"role": "user", "content": "hi"}]
    two = [{"role": "system", "content": "be-brief"}, {"role": "user", "content": "why?"}]
    expected = llm.generate([llm.encode_chat(one), llm.encode_chat(two)], params)
    assert llm.encode_chat(one) == llm.encode("<user>hi<assistant>")
    got = llm.chat([one, two], params)
    assert [(o.prompt_ids, o.output_ids, o.text) for o in got] == [(o.prompt_ids, o.output_ids, o.text)
                                                                     for o in expected]
    assert llm.chat(one, params)[0].output_ids == expected[0].output_ids == llm.generate("hi", params, chat=True)[
        0].output_ids
    assert llm.chat(one, sampling_params=params)[0].output_ids == expected[0].output_ids  # vLLM's keyword
    assert llm.generate("hi", sampling_params=params, chat=True)[0].output_ids == expected[0].output_ids
    assert llm.generate("hi")[0].output_ids == llm.generate("hi", SamplingParams())[0].output_ids  # None: defaults
    assert llm.chat([], params) == []  # (as generate([]))
    for bad in ("hi", [[]], [one, "hi"], [["hi"]], [one, []]):
        with pytest.raises(FastspecError, match="messages must be a list of"):
            llm.chat(bad, params)


@pytest.mark.parametrize("args, hint", [
    (["--tp-size", "2"], "fastspec runs on one GPU (--device cuda:N picks it)"),
    (["--tensor-parallel-size=2"], "fastspec runs on one GPU"), (["--dp-size", "2"], "fastspec runs on one GPU"),
    (["--mem-fraction-static", "0.8"], "the KV pool's size is --max-total-tokens"),
    (["--gpu-memory-utilization", "0.9"], "the KV pool's size is --max-total-tokens"),
    (["--trust-remote-code"], "not needed"), (["--random-seed", "1"], "seeds are per request: --seed"),
    (["--log-level", "info"], "fastspec has no log levels"), (["--max-model-len", "9"], "use --context-length"),
    (["--max-num-seqs", "4"], "use --max-running-requests"), (["--enforce-eager"], "use --disable-cuda-graph"),
    (["--speculative-config", "{}"], "use --speculative-algorithm, --speculative-draft-model-path")])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_sglang_or_vllm_flag_fastspec_lacks_is_one_line_naming_its_own(command, args, hint):
    """(--tp-size 2 was click's `No such option: --tp-size (Possible options: --page-size, --top-k, --top-p)`.)"""
    from typer.testing import CliRunner

    from fastspec.cli import app

    result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.output
    assert result.stderr.startswith(f"error: No such option: {args[0].split('=')[0]}; ") and hint in result.stderr
    assert "Possible options" not in result.stderr


def test_sglang_flags_fastspec_takes_parse_and_reach_the_engine(monkeypatch):
    """--model-path, --context-length (was no flag), --mem-fraction-static's replacement and the speculative flags
    under SGLang's names become LLM's keywords; a bad --context-length is one line before torch is imported."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    seen = {}

    class Recording:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise FastspecError("stop here")

    monkeypatch.setattr("fastspec.llm.LLM", Recording)
    args = ["generate", "--prompt", "hi", "--model-path", "smollm2-135m-instruct", "--context-length", "256",
            "--max-running-requests", "4", "--chunked-prefill-size", "64", "--disable-radix-cache",
            "--max-total-tokens", "4096", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "stop here" in result.stderr, result.output
    assert {k: seen[k] for k in ("model", "max_context_len", "max_running_requests", "chunked_prefill_size",
                                 "radix_cache", "max_total_tokens", "speculative_algorithm", "num_steps", "topk",
                                 "num_draft_tokens")} == dict(
        model="smollm2-135m-instruct", max_context_len=256, max_running_requests=1, chunked_prefill_size=64,
        radix_cache=False, max_total_tokens=4096, speculative_algorithm="EAGLE3", num_steps=3, topk=2,
        num_draft_tokens=5)  # (generate runs at most its batch: one prompt)
    bad = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--context-length", "0"])
    assert bad.exit_code == 2 and bad.stderr == "error: --context-length must be >= 1, got 0\n"


def test_dtype_auto_reads_the_cpus_bf16_instructions_and_cudas_checkpoint_dtype(tiny_dirs, tmp_path, monkeypatch):
    """SGLang's and vLLM's default --dtype auto (was refused: 'unknown dtype'). On CUDA the checkpoint's 16-bit
    dtype, bfloat16 for a float32 one. On the CPU float32, but a checkpoint stored in bfloat16 keeps its dtype where
    the CPU has bfloat16 dot products, any 16-bit one where a float32 copy would not fit in memory (the CPU's flags
    and the memory are stubbed here; the rule is what is tested). Weights that cannot fit in
    the memory free at all: one line before loading (a process killed for memory midway, before)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    import fastspec
    from fastspec.kernels import cpu_library
    import fastspec.memory.kv_pool as kv_pool
    from fastspec.cli import app
    from fastspec.config import EngineConfig, resolve_dtype
    from fastspec.models.sources import resolve_sources
    from fastspec.models.weights_fit import resolve_model_dtype

    assert EngineConfig(device="cpu").dtype == "auto"  # decided with the checkpoint
    assert [resolve_dtype("auto", device, stored) for device, stored in (
        ("cuda", "bfloat16"), ("cuda:1", "float16"), ("cuda", "float32"), ("cpu", "bfloat16"))] == [
        "bfloat16", "float16", "bfloat16", "float32"]
    assert resolve_dtype("float16", "cuda", "bfloat16") == "float16"  # as asked
    model_dir = tmp_path / "bf16"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    tensors = load_file(model_dir / "model.safetensors")  # a checkpoint stored in bfloat16, config and tensors
    save_file({k: v.bfloat16() for k, v in tensors.items()}, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    bf16_dot = {"value": True}
    monkeypatch.setattr(cpu_library, "has_bf16_dot", lambda: bf16_dot["value"])
    bf16, fp32 = resolve_sources(str(model_dir), "NONE"), resolve_sources(str(tiny_dirs["llama"][0]), "NONE")
    assert resolve_model_dtype("auto", "cpu", bf16) == "bfloat16" and resolve_model_dtype("auto", "cpu", fp32) == \
        "float32"
    assert resolve_model_dtype("float32", "cpu", bf16) == "float32"  # as asked
    llm = fastspec.LLM(str(model_dir), device="cpu", max_total_tokens=512)
    assert llm.engine.config.dtype == "bfloat16" and llm.engine.model.lm_head.weight.dtype == torch.bfloat16
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "float16", "dtype": "float16"}))
    assert resolve_model_dtype("auto", "cpu", resolve_sources(str(model_dir), "NONE")) == "float32"
    (model_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    bf16_dot["value"] = False
    assert resolve_model_dtype("auto", "cpu", bf16) == "float32"
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: 2 * sum(  # just a float32 copy: no KV room
        f.stat().st_size for f in model_dir.glob("*.safetensors")))
    assert resolve_model_dtype("auto", "cpu", bf16) == "bfloat16"
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: 3 * sum(  # room for bfloat16's, not float32's
        f.stat().st_size for f in model_dir.glob("*.safetensors")) // 2)
    hint = r"pass --dtype bfloat16 \(--quantization int8 / int4 rounds the weights after loading them in --dtype\)"
    with pytest.raises(FastspecError, match=r"the weights need 0\.0 GiB as float32 and cpu has 0\.0 GiB free; " + hint):
        fastspec.LLM(str(model_dir), device="cpu", dtype="float32", max_total_tokens=512)
    with pytest.raises(FastspecError, match="as float32 .*" + hint):  # (the hint said --quantization would do)
        fastspec.LLM(str(model_dir), device="cpu", quantization="int8", max_total_tokens=512)
    assert fastspec.LLM(str(model_dir), device="cpu", dtype="bfloat16", max_total_tokens=512).engine.config.dtype == \
        "bfloat16"
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: 1)
    with pytest.raises(FastspecError, match="as bfloat16 .*; use a quantised checkpoint"):
        fastspec.LLM(str(model_dir), device="cpu", dtype="bfloat16", max_total_tokens=512)
    monkeypatch.undo()
    result = CliRunner().invoke(app, ["generate", "--model", str(model_dir), "--input-ids", "1,5,9", "--dtype", "auto",
                                      "--max-new-tokens", "3", "--device", "cpu", "--json"])
    assert result.exit_code == 0 and len(json.loads(result.stdout)["output_ids"]) == 3, result.output
    bad = CliRunner().invoke(app, ["generate", "--prompt", "hi", "--dtype", "int8"])
    assert bad.exit_code == 2 and "unknown dtype 'int8'; choose one of auto, float32, bfloat16, float16" in bad.stderr


def test_the_weights_check_counts_a_standalone_drafts_weights(tiny_dirs, monkeypatch):
    """A STANDALONE draft is loaded beside the target: the weights' check counted the target only, so a pair that
    cannot fit together passed it and was killed loading the draft (found reading check_weights_fit against
    assemble's draft loading). An MTP draft, the target's own checkpoint, is not counted twice."""
    import fastspec.memory.kv_pool as kv_pool
    from fastspec.models.sources import resolve_sources
    from fastspec.models.weights_fit import check_weights_fit

    target, draft = tiny_dirs["llama"][0], tiny_dirs["qwen2"][0]
    sources = resolve_sources(str(target), "STANDALONE", str(draft))
    both = sum(f.stat().st_size for d in (target, draft) for f in d.glob("*.safetensors"))
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: both - 1)
    with pytest.raises(FastspecError, match=r"and its draft: the weights need"):
        check_weights_fit(sources, "float32", "cpu")
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device: both)
    check_weights_fit(sources, "float32", "cpu")
