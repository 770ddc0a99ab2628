"""GGUF files beyond a llama with a GPT-2 vocabulary: qwen2, qwen3 and phi3 models, Llama 3's rope factors, YaRN, and
the tokenizers llama.cpp names (Qwen2's and Llama 3's pre-tokenizers, SentencePiece vocabularies).

Oracles: the tiny random model each file was written from (its logits and greedy tokens), transformers' own GGUF
loader (that the files are laid out as llama.cpp lays them out, and the tokenizer it rebuilds from the same metadata),
transformers' Llama 3 rope frequencies (the divisors a rope_freqs tensor holds)."""

import json

import gguf
import pytest
import torch
from gguf_writers import SPM_TOKENS, TOKENS, bpe_vocab, spm_vocab, tiny_model, write_gguf
from test_gguf_kquants import assert_close_to_reference, assert_speculation_is_lossless, packed_and_reference
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.models.gguf import convert_gguf
from fastspec.models.gguf_rope import llama3_scaling
from fastspec.models.rope import rope_inv_freq
from fastspec.sampling import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "phi3"]
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41, 42]]


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


# ---- the files are llama.cpp's layout ----

@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_written_files_as_the_same_weights(tmp_path, arch):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = tiny_model(arch, tied=False)
    read = load_gguf_checkpoint(str(write_gguf(tmp_path / "m.gguf", model)), return_tensors=True,
                                model_to_load=model)["tensors"]
    assert set(read) == set(model.state_dict())
    for name, weight in model.state_dict().items():
        assert torch.equal(torch.as_tensor(read[name]).float(), weight), name


# ---- conversion ----

@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_qwen_files_convert_to_the_model_they_were_written_from(tmp_path, arch, tied):
    model = tiny_model(arch, tied=tied)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", model), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    assert config["head_dim"] == (32 if arch == "qwen3" else 16)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for prompt in PROMPTS:
        torch.testing.assert_close(logits(loaded, prompt), logits(model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fastspec_runs_a_qwen_file_as_transformers_runs_its_model(tmp_path, arch):
    """Float32 weights, exact activations: fastspec's greedy tokens on the .gguf path are the source model's."""
    model = tiny_model(arch)
    path = write_gguf(tmp_path / "m.gguf", model)
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none", max_total_tokens=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("activation", [torch.float32, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_a_quantised_file_runs_on_its_blocks(tmp_path, arch, activation):
    """Q8_0 matrices under --quantization gguf: every projection packed, with its biases (qwen2), beside the q / k
    norms (qwen3) or split from phi3's fused QKV / gate_up blocks and stacked again; float32 activations give the
    converted model's logits to float32 rounding, int16 ones (fastspec's 8-bit kernel) its greedy tokens,
    teacher-forced, nearly always."""
    from fastspec.models.packed_layers import BlockLinear, CastLinear

    model = tiny_model(arch, hidden_size=128, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", model, qtype=gguf.GGMLQuantizationType.Q8_0)
    packed, reference = packed_and_reference(convert_gguf(path, tmp_path / "hf"), activation)
    attn = packed.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, BlockLinear if activation == torch.int16 else CastLinear)
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2") and (attn.q_norm is not None) == (arch == "qwen3")
    assert_close_to_reference(packed, reference, activation)


@pytest.mark.skipif(not cpu_library.available(), reason="no C compiler")
@pytest.mark.parametrize("arch, algorithm", [("qwen2", "EAGLE3"), ("qwen3", "NGRAM"), ("phi3", "EAGLE3")])
def test_speculation_on_a_quantised_qwen_file_is_lossless(tmp_path, arch, algorithm):
    """Every round speculating, on a Q8_0 file run packed: plain greedy's tokens."""
    path = write_gguf(tmp_path / "m.gguf", tiny_model(arch, hidden_size=128, intermediate_size=256),
                      qtype=gguf.GGMLQuantizationType.Q8_0)
    assert_speculation_is_lossless(path, algorithm, 128, tmp_path / "head", new=12)


def test_weight_names_list_the_block_matrices_a_load_reads(tmp_path):
    """A converted file keeps its block-typed matrices as blocks only: weight_names (read from headers) still lists
    every tensor read_state_dict gives."""
    from fastspec.models.loader import read_state_dict, weight_names

    out = convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_model("qwen2", hidden_size=128, intermediate_size=256),
                                  qtype=gguf.GGMLQuantizationType.Q8_0), tmp_path / "hf")
    names = weight_names(out)
    assert sorted(names) == sorted(read_state_dict(out)) and "model.layers.0.mlp.down_proj.weight" in names


# ---- phi3 ----

def test_a_phi3_file_converts_to_a_llama_with_its_logits_and_window(tmp_path):
    """Phi-3's fused QKV and gate_up rows (gate first) split into a Llama's projections: transformers' Llama on the
    converted directory gives the Phi-3 model's logits and fastspec its greedy tokens; the file's sliding window is
    the config's and caps the context (ModelConfig.context_limit)."""
    model = tiny_model("phi3", tied=False, sliding_window=64)
    path = write_gguf(tmp_path / "m.gguf", model)
    out = convert_gguf(path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["sliding_window"] == 64
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    for prompt in PROMPTS:
        torch.testing.assert_close(logits(loaded, prompt), logits(model, prompt), atol=1e-5, rtol=1e-5)
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none")
    assert llm.engine.worker.max_context_len == 64
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, 8) for p in PROMPTS]


def test_phi3_longrope_is_refused_in_one_line(tmp_path):
    model = tiny_model("phi3", tied=False)
    factors = {name: [1.0] * 8 for name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    with pytest.raises(FastspecError, match="LongRoPE .*is not supported"):
        convert_gguf(write_gguf(tmp_path / "m.gguf", model, extra_tensors=factors), tmp_path / "hf")


# ---- rope scaling ----

LLAMA3 = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 2048}  # two of the tiny model's 8 frequencies blended


def test_llama3_rope_factors_convert_to_the_models_rope(tmp_path):
    """A rope_freqs tensor becomes rope_scaling llama3 (the blend's edges as fractions of 8192, where only their
    ratios matter): transformers on the converted directory and fastspec on the file give the source's logits /
    greedy tokens."""
    model = tiny_model("llama", rope_scaling=LLAMA3, max_position_embeddings=4096)
    divisors = tiny_model("llama").model.rotary_emb.inv_freq / model.model.rotary_emb.inv_freq  # transformers' own
    assert int(((divisors > 1) & (divisors < 16)).sum()) == 2
    path = write_gguf(tmp_path / "m.gguf", model, rope_factors=divisors)
    out = convert_gguf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 4.0, "high_freq_factor": 32.0,
        "original_max_position_embeddings": 8192}
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(loaded, PROMPTS[0]), logits(model, PROMPTS[0]), atol=1e-4, rtol=1e-4)
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none", max_total_tokens=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("head_dim, theta, factor", [(64, 500000.0, 32.0), (128, 500000.0, 8.0)])
def test_llama3_scaling_reads_llama_3_1_and_3_2_factors_as_their_configs(head_dim, theta, factor):
    """Llama 3.2's and 3.1's rope_freqs (written from their published rope_scaling) give back those exact numbers."""
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    from fastspec.models.model_config import RopeScaling

    divisors = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, RopeScaling(
        "llama3", factor, 1.0, 4.0, 8192))
    assert llama3_scaling(divisors, head_dim, theta) == scaling
    assert llama3_scaling(torch.ones(head_dim // 2), head_dim, theta) is None


def test_rope_factors_that_are_not_llama3s_are_refused(tmp_path):
    divisors = torch.tensor([1.0, 3.0, 1.5, 2.0, 7.0, 16.0, 2.0, 16.0])
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), rope_factors=divisors)
    with pytest.raises(FastspecError, match="rope_freqs.weight is not Llama 3's rope scaling"):
        convert_gguf(path, tmp_path / "hf")


def test_yarn_keys_convert_to_the_models_rope(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    model = tiny_model("qwen2", rope_scaling=dict(yarn))  # (transformers adds its rope_theta to the dict)
    path = write_gguf(tmp_path / "m.gguf", model, yarn=(4.0, 32))
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none", max_total_tokens=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, 8) for p in PROMPTS]
    assert json.loads((convert_gguf(path, tmp_path / "hf") / "config.json").read_text())["rope_scaling"] == yarn


# ---- tokenizers, against transformers' rebuild from the same metadata ----

TEXTS = ["hello world", " hello", "hello  world!", "Hello World", "hello\n\nworld", "über é", "I'm 12345 ll!",
         "  ", "", "<s>hello</s>", "hello<tool>world", "a b ab"]


def assert_same_tokenizer(path, texts=TEXTS) -> None:
    ours = AutoTokenizer.from_pretrained(convert_gguf(path, path.parent / "hf"))
    oracle = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == oracle.encode(text, add_special_tokens=special), (text, special)
        assert ours.decode(ids) == oracle.decode(ids), text


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "tekken", "gpt2"])  # (transformers has no smollm split)
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    assert_same_tokenizer(write_gguf(tmp_path / "m.gguf", tiny_model("llama"), vocab=bpe_vocab(pre)))


@pytest.mark.parametrize("add_space_prefix, add_bos", [(None, None), (True, False)])  # (False: transformers ignores it)
def test_sentencepiece_vocabulary_matches_transformers(tmp_path, add_space_prefix, add_bos):
    """Where transformers' rebuild agrees with llama.cpp: not before a leading space or after a special token, where
    llama.cpp prefixes a space and transformers does not (test_gguf_llamacpp holds llama.cpp's own answers)."""
    model = tiny_model("llama", vocab_size=len(SPM_TOKENS))
    texts = [t for t in TEXTS if not t.startswith(" ") and "<" not in t]
    assert_same_tokenizer(write_gguf(tmp_path / "m.gguf", model, vocab=spm_vocab(add_space_prefix, add_bos)), texts)


def test_sentencepiece_merges_best_piece_first_with_byte_fallback(tmp_path):
    model = tiny_model("llama", vocab_size=len(SPM_TOKENS))
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", model, vocab=spm_vocab()), tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    pieces = tok.convert_ids_to_tokens(tok.encode("hello world ü", add_special_tokens=False))
    assert pieces == ["▁hello", "▁world", "▁", "<0xC3>", "<0xBC>"]  # ü is no piece: its two UTF-8 bytes
    assert tok.encode("hello")[0] == 1  # llama.cpp adds bos to a SentencePiece vocabulary unless told otherwise
    assert tok.decode(tok.encode("hello world ü"), skip_special_tokens=True) == "hello world ü"
    out = convert_gguf(write_gguf(tmp_path / "n.gguf", model, vocab=spm_vocab(add_space_prefix=False)), tmp_path / "n")
    tok = AutoTokenizer.from_pretrained(out)  # no space before the text, as llama.cpp reads add_space_prefix false
    assert tok.convert_ids_to_tokens(tok.encode("hello world", add_special_tokens=False)) == ["he", "llo", "▁world"]
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=True) == "hello world"


def test_unsupported_tokenizers_are_refused(tmp_path):
    with pytest.raises(FastspecError, match="pre-tokenizer 'falcon' is not supported .supported: default, gpt-2, gpt2"):
        convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_model("llama"), vocab=bpe_vocab("falcon")), tmp_path / "a")

    def t5(w):
        w.add_tokenizer_model("t5")
        w.add_token_list(TOKENS)
    with pytest.raises(FastspecError, match="tokenizer model 't5' is not supported"):
        convert_gguf(write_gguf(tmp_path / "t.gguf", tiny_model("llama"), vocab=t5), tmp_path / "b")
