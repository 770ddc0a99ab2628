"""GGUF files of a mixture of experts: qwen3moe and Mixtral (llama.cpp's `llama` with an expert_count), their experts
stacked [E, ...] in one tensor per projection (ffn_gate_exps / ffn_up_exps / ffn_down_exps) beside the router
(ffn_gate_inp).

Oracles: the tiny random transformers model each file was written from (its logits and greedy tokens), the converted
model in float32 for a quantised file's packed run; llama.cpp's own answers on such files are in test_gguf_llamacpp."""

import json
import re

import gguf
import pytest
import torch
from gguf_writers import tiny_model, write_gguf
from safetensors import safe_open
from test_gguf_archs import PROMPTS, hf_greedy, logits
from test_gguf_kquants import assert_close_to_reference, assert_speculation_is_lossless, packed_and_reference

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.models.gguf import convert_gguf
from fastspec.models.gguf_blocks import BLOCKS_FILE
from fastspec.models.reference import transformers_model
from fastspec.sampling import SamplingParams

MOE = ["qwen3_moe", "mixtral"]
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("tied", [True, False])
def test_moe_files_convert_to_the_model_they_were_written_from(tmp_path, arch, tied):
    model = tiny_model(arch, tied=tied)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", model), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["num_experts_per_tok"] == 2
    assert config.get("num_experts", config.get("num_local_experts")) == 4
    if arch == "qwen3_moe":  # llama.cpp renormalises the chosen experts' weights (test_gguf_llamacpp: its logits)
        assert config["moe_intermediate_size"] == 64 and config["norm_topk_prob"] is True
    converted = transformers_model(out)
    for prompt in PROMPTS:
        torch.testing.assert_close(logits(converted, prompt), logits(model, prompt), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_mixtral_file_of_one_tensor_per_expert_converts_as_a_stacked_one(tmp_path, qtype):
    """llama.cpp's early Mixtral files (blk.N.ffn_gate.E.weight, ... one tensor per expert; llama.cpp itself no longer
    loads them): the same weights as the stacked file's."""
    from fastspec.models.loader import read_state_dict

    model = tiny_model("mixtral")
    one, stacked = (convert_gguf(write_gguf(tmp_path / f"{name}.gguf", model, qtype=qtype, one_per_expert=split),
                                 tmp_path / name) for name, split in (("one", True), ("stacked", False)))
    ones, stacks = read_state_dict(one), read_state_dict(stacked)
    assert ones.keys() == stacks.keys() and all(torch.equal(ones[k], stacks[k]) for k in ones)
    if qtype == Q.F32:
        torch.testing.assert_close(logits(transformers_model(one), PROMPTS[0]), logits(model, PROMPTS[0]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", MOE)
def test_fastspec_runs_a_moe_file_as_transformers_runs_its_model(tmp_path, arch):
    """Float32 weights, exact activations: fastspec's greedy tokens on the .gguf path are the source model's."""
    model = tiny_model(arch, tied=False)
    path = write_gguf(tmp_path / "m.gguf", model)
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none", max_total_tokens=512)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, 8) for p in PROMPTS]


def test_quantised_experts_are_stored_as_blocks_only(tmp_path):
    """Each expert of a Q4_0 stack is its own weight's blocks, as any other block matrix (no float copy); the router
    stays F32 (llama-quantize leaves it so) and is converted as floats."""
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_model("mixtral"), qtype=Q.Q4_0), tmp_path / "hf")
    with safe_open(str(out / BLOCKS_FILE), "pt") as blocks, safe_open(str(out / "model.safetensors"), "pt") as floats:
        names = set(blocks.keys())
        expert = "model.layers.1.block_sparse_moe.experts.{}.w{}.weight.q"
        assert {expert.format(e, w) for e in range(4) for w in (1, 2, 3)} <= names
        assert "model.layers.1.block_sparse_moe.gate.weight" in floats.keys()
        assert not any(".experts." in name for name in floats.keys())
        assert blocks.get_tensor("model.layers.0.block_sparse_moe.experts.3.w2.weight.q").shape == (64, 96 // 2)


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("activation", [torch.float32, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_a_quantised_moe_file_runs_on_its_blocks(tmp_path, arch, activation):
    """--quantization gguf on Q8_0 experts: each expert's gate_up and down a projection of its own (packed with
    fastspec's 8-bit kernel under int16 activations), run as LinearExperts, the router float32; float32 activations
    give the converted model's logits to float32 rounding, int16 ones its greedy tokens, teacher-forced, nearly
    always."""
    from fastspec.models.moe import LinearExperts
    from fastspec.models.packed_layers import BlockLinear, CastLinear

    out = convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_model(arch), qtype=Q.Q8_0), tmp_path / "hf")
    model, reference = packed_and_reference(out, activation)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, LinearExperts) and len(experts.down) == 4
        kind = BlockLinear if activation == torch.int16 else CastLinear
        assert all(isinstance(m, kind) for m in (*experts.gate_up, *experts.down))
        assert layer.mlp.gate.weight.dtype == torch.float32
    assert_close_to_reference(model, reference, activation)


@pytest.mark.skipif(not cpu_library.available(), reason="no C compiler")
def test_speculation_on_a_packed_moe_file_is_lossless(tmp_path):
    assert_speculation_is_lossless(write_gguf(tmp_path / "m.gguf", tiny_model("qwen3_moe"), qtype=Q.Q8_0), "NGRAM",
                                   64, tmp_path / "head")


@pytest.mark.parametrize("key, value", [("expert_shared_count", 1), ("expert_gating_func", 2)])
def test_other_expert_layouts_are_refused_in_one_line(tmp_path, key, value):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("qwen3_moe"), extra_meta={f"qwen3moe.{key}": value})
    line = (f"{path}: GGUF experts with shared experts ({value if 'shared' in key else 0}), gating function "
            f"{value if 'gating' in key else 1} or a weights scale are not supported")
    with pytest.raises(FastspecError, match=f"^{re.escape(line)}$"):
        convert_gguf(path, tmp_path / "hf")
