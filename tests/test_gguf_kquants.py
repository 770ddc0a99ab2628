"""Random rows of the K-quants and the other packed GGML types, the `gguf` package's own dequantiser as their oracle
(the package cannot quantise to them), and tiny llama GGUFs laid out like a Q4_K_M file (Q4_K projections, some Q6_K)
and holding every other packed type, whose conversion gives the oracle's weights, fixtures for end-to-end tests of
the packed path. (test_gguf_kquant_blocks.py: each type read as Blocks against the oracle.)"""

import json
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_writers import LAYER_NAMES, TOKENS, write_gguf
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from fastspec.kernels import cpu_library, cpu_q4
from fastspec.models.gguf import convert_gguf
from fastspec.models.gguf_read import unpermute_rope_rows
from fastspec.models.gguf_kquants import READERS, read
from fastspec.models.loader import read_state_dict
from fastspec.models.packed_layers import BlockLinear, Int4Linear
from fastspec.models.reference import transformers_model

HEADS, KV_HEADS = 4, 2
SCALES = {  # GGML type -> (first byte, count) of a block's f16 scales, the range drawn for them (|w| stays ~2 or less)
    "Q2_K": ((80, 2), (1e-3, 2e-2)), "Q3_K": ((108, 1), (1e-3, 1e-2)), "Q4_K": ((0, 2), (1e-4, 2e-3)),
    "Q5_K": ((0, 2), (1e-4, 1e-3)), "Q6_K": ((208, 1), (1e-5, 1e-4)), "IQ4_XS": ((0, 1), (1e-5, 3e-4)),
    "IQ4_NL": ((0, 1), (1e-3, 1e-2)), "Q5_0": ((0, 1), (1e-3, 2e-2)), "Q5_1": ((0, 2), (1e-3, 1e-2)),
    "Q8_0": ((0, 1), (1e-4, 1e-3)),
}


def random_rows(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:  # uint8 [n, bytes per row]
    """Random rows of GGML type `kind`: random bytes, with finite positive f16 scales (SCALES)."""
    per_block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    (first, count), (low, high) = SCALES[kind]
    raw = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
    raw[..., first:first + 2 * count] = rng.uniform(low, high, (n, k // per_block, count)).astype(np.float16).view(
        np.uint8)
    return raw.reshape(n, -1)


def oracle(raw: np.ndarray, kind: str) -> torch.Tensor:  # float32 [N, K]
    return torch.from_numpy(np.array(dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32))


# ---- tiny llamas laid out like a Q4_K_M file, and with every other packed type ----

def q4_k_m_type(name: str, array: np.ndarray) -> str | None:
    """The GGML type of each tensor: norms stay F32 (None), output and layer 0's attn_v / ffn_down are Q6_K (llama.cpp's
    Q4_K_M gives some layers' attn_v / ffn_down more bits), every other matrix Q4_K."""
    if array.ndim != 2:
        return None
    return "Q6_K" if name in ("output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight") else "Q4_K"


EVERY_TYPE = {  # layer 0 holds a type per projection; layer 1 is laid out as a Q5_K_M file (Q6_K for attn_v / down)
    "token_embd": "Q3_K", "output": "Q5_1", "blk.0.attn_q": "Q2_K", "blk.0.attn_k": "Q3_K", "blk.0.attn_v": "Q5_K",
    "blk.0.attn_output": "IQ4_XS", "blk.0.ffn_gate": "Q5_0", "blk.0.ffn_up": "Q5_1", "blk.0.ffn_down": "IQ4_NL",
    "blk.1.attn_v": "Q6_K", "blk.1.ffn_down": "Q6_K"}


def every_type(name: str, array: np.ndarray) -> str | None:
    """The GGML type of each tensor in the EVERY_TYPE layout: norms stay F32 (None), any other matrix is Q5_K."""
    return None if array.ndim != 2 else EVERY_TYPE.get(name.removesuffix(".weight"), "Q5_K")


def k_quant_llama() -> LlamaForCausalLM:
    """A tiny llama whose matrices have K (hidden 256, intermediate 512) a multiple of a K-quant super-block."""
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write_k_quant_gguf(path, seed: int = 0, types=q4_k_m_type):
    """test_gguf's writer with every matrix replaced by random raw rows of its shape and of the type `types` names
    (q4_k_m_type, every_type), the float model only giving names, shapes and metadata; norms stay its F32 weights."""
    rng = np.random.default_rng(seed)

    class KQuantWriter(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, *args, **kwargs):
            kind = types(name, tensor)
            if kind is None:
                return super().add_tensor(name, tensor, *args, **kwargs)
            raw = random_rows(kind, *tensor.shape, rng)  # [N, K] -> uint8 [N, bytes per row]
            return super().add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    with mock.patch.object(gguf, "GGUFWriter", KQuantWriter):
        return write_gguf(path, k_quant_llama())


@pytest.mark.parametrize("types, kinds", [(q4_k_m_type, {"Q4_K", "Q6_K"}), (every_type, {*READERS, "Q5_0", "Q5_1",
                                                                                 "IQ4_NL"} - {"Q4_K"})])
def test_a_k_quant_gguf_converts_to_the_oracles_weights(tmp_path, types, kinds):
    """Every matrix of the converted model is the oracle's dequantised tensor (q / k with the rope row order undone),
    and its stored blocks, as read, dequantise to the same (the conversion writes floats for the norms only); the
    converted model runs."""
    path = write_k_quant_gguf(tmp_path / "tiny.gguf", types=types)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert {t.tensor_type.name for t in tensors.values()} == {"F32", *kinds}
    hf_dir = convert_gguf(path, tmp_path / "hf")
    converted = read_state_dict(hf_dir)  # the block matrices dequantised by the loader: no float copy is written
    assert set(load_file(hf_dir / "model.safetensors")) == {n for n in converted if "norm" in n}
    stored = load_file(hf_dir / "gguf_blocks" / "blocks.safetensors")
    rope_heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}
    names = {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{name}.weight"  # HF -> GGUF name
             for i in (0, 1) for hf, name in LAYER_NAMES.items() if hf.endswith("_proj")}
    names |= {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    for hf_name, gguf_name in names.items():
        t, heads = tensors[gguf_name], rope_heads.get(hf_name.split(".", 3)[-1].removesuffix(".weight"))
        kind = t.tensor_type.name
        expected = oracle(t.data, kind) if heads is None else unpermute_rope_rows(oracle(t.data, kind), heads)
        assert torch.equal(converted[hf_name], expected), t.name
        blocks = read(t.data, kind)
        if heads is not None:
            blocks = blocks.map_rows(lambda x, h=heads: unpermute_rope_rows(x, h))
        assert torch.equal(blocks.dequantise(), expected), t.name
        assert torch.equal(stored[f"{hf_name}.scale"], blocks.scale), t.name  # what --quantization gguf reads
    with torch.no_grad():  # the random blocks make a model whose logits stay finite
        logits = transformers_model(tmp_path / "hf")(torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all()


def packed_and_reference(model_dir, activation: torch.dtype):
    """(the converted GGUF at `model_dir` packed with `activation`, the converted model in float32, fused)."""
    from fastspec.models.causal_lm import CausalLM as Target
    from fastspec.models.gguf_packed import load_packed_target
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target, read_config

    reference = fuse_projections(load_target(model_dir, torch.float32))
    with torch.device("meta"):
        skeleton = Target(read_config(model_dir))
    return load_packed_target(skeleton, model_dir, torch.float32, activation=activation), reference


def assert_close_to_reference(model, reference, activation: torch.dtype):
    """float32 activations: the reference's logits to float32 rounding over 40 random tokens; the fast kernels: its
    greedy tokens, teacher-forced, at 90 % of positions or more."""
    from fastspec.train.data import PackedCausalAttention

    x = torch.randint(0, len(TOKENS), (40,), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, reference):
        with torch.inference_mode():
            hidden = m(x, torch.arange(len(x)), PackedCausalAttention(torch.zeros(len(x), dtype=torch.long))).final
            logits.append(m.compute_logits(hidden))
    if activation == torch.float32:
        # two summation orders (the reference's BLAS, fastspec's row-invariant GEMM where weights stay float) through
        # two layers of large random weights: 1e-4 of the logits' scale (a mix-up moves them by whole units)
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4 * float(logits[1].abs().max()), rtol=1e-4)
    else:
        assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("activation", [torch.float32, torch.bfloat16, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_a_q4_k_m_model_runs_on_its_blocks(tmp_path, caplog, activation):
    """--quantization gguf on a Q4_K_M file: the Q4_K projections packed, the Q4_K embedding kept as blocks. With
    torch's int4 kernel (float32 / bfloat16 activations) a group with a Q6_K part (layer 0's QKV and down) and the
    Q6_K output run dequantised, with one note; with fastspec's (int16) they are packed too, as 8-bit blocks, and the
    head rescores from the Q6_K table's blocks. float32 activations give the converted model's logits to float32
    rounding; bfloat16 or int16 ones (the fast kernels) its greedy tokens, teacher-forced, nearly always (the
    lm_head's best tokens rescored exactly)."""
    from fastspec.models.packed_layers import BlockEmbedding, CastLinear, RefinedHead

    model_dir = convert_gguf(write_k_quant_gguf(tmp_path / "tiny-q4_k_m.gguf"), tmp_path / "hf")
    model, reference = packed_and_reference(model_dir, activation)
    layers = model.model.layers
    mixed = (layers[0].self_attn.qkv_proj, layers[0].mlp.down_proj)  # a Q6_K part beside Q4_K ones, or Q6_K alone
    if activation == torch.int16:
        assert all(isinstance(m, BlockLinear) and cpu_q4.bits(m.packed) == 6 for m in mixed)  # Q6_K's -32..31 lifted
        assert model.lm_head.table.q.dtype == torch.int8 and "no packed kernel" not in caplog.text
    else:
        assert all(isinstance(m, CastLinear) for m in mixed)
        assert "Q6_K tensors have no packed kernel here" in caplog.text
    packed = (layers[1].self_attn.qkv_proj, layers[1].mlp.down_proj, layers[0].mlp.gate_up_proj,
              layers[0].self_attn.o_proj)
    assert all(isinstance(m, Int4Linear | BlockLinear) for m in packed)
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert isinstance(model.lm_head, CastLinear if activation == torch.float32 else RefinedHead)
    assert_close_to_reference(model, reference, activation)


@pytest.mark.parametrize("activation", [torch.float32, torch.bfloat16, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_every_other_type_runs_on_its_blocks(tmp_path, caplog, activation):
    """--quantization gguf on a file of Q2_K, Q3_K, Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices: with
    fastspec's kernels (int16) every projection runs packed in 4 (IQ4's levels indexed), 5 or 6 bits (exact), the
    embedding and the head's rescoring table stay blocks, and nothing is dequantised; torch's int4 kernel takes none of
    them (one note naming the types). float32 activations give the converted model's logits to float32 rounding;
    int16 / bfloat16 ones its greedy tokens, teacher-forced, nearly always."""
    from fastspec.models.packed_layers import BlockEmbedding, CastLinear

    model_dir = convert_gguf(write_k_quant_gguf(tmp_path / "tiny.gguf", types=every_type), tmp_path / "hf")
    model, reference = packed_and_reference(model_dir, activation)
    projections = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    if activation == torch.int16:  # each in the fewest bits its values take (IQ4: 4-bit indices into 16 levels)
        widths = [cpu_q4.bits(m.packed) if isinstance(m, BlockLinear) else None for m in projections]
        assert widths == [5, 4, 5, 4,   # layer 0: Q2_K / Q3_K / Q5_K, IQ4_XS, Q5_0 / Q5_1, IQ4_NL
                          6, 5, 5, 6]   # layer 1: Q5_K / Q6_K, Q5_K, Q5_K, Q6_K
        assert [m.levels is not None for m in projections] == [False, True, False, True] + [False] * 4
        again = packed_and_reference(model_dir, activation)[0].model.layers[0]  # its packed form read from the cache
        assert torch.equal(again.mlp.down_proj.levels, projections[3].levels)
        assert torch.equal(again.mlp.down_proj.packed, projections[3].packed)
        assert model.lm_head.table.q.dtype == torch.int8 and "no packed kernel" not in caplog.text
    else:
        assert all(isinstance(m, CastLinear) for m in projections)
        assert "IQ4_NL / IQ4_XS / Q2_K / Q3_K / Q5_0 / Q5_1 / Q5_K / Q6_K tensors have no packed kernel" in caplog.text
    assert_close_to_reference(model, reference, activation)


@pytest.mark.skipif(not cpu_library.available(), reason="no C compiler")
@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_speculation_on_every_other_type_is_lossless(tmp_path, algorithm):
    """A verify runs the 8-bit kernel over several rows, a plain step over one: each output row depends on its own
    activations only, so speculation on the EVERY_TYPE file, every round speculating, gives plain greedy's tokens.
    EAGLE3 drafts with a random head of the target's shape (acceptance does not matter here)."""
    path = write_k_quant_gguf(tmp_path / "tiny.gguf", types=every_type)
    assert_speculation_is_lossless(path, algorithm, 256, tmp_path / "head")


def assert_speculation_is_lossless(path, algorithm: str, hidden: int, head_dir, new: int = 16) -> None:
    """On the 2-layer GGUF at `path` run packed, `algorithm` with every round speculating (EAGLE3: a random head of
    width `hidden`) gives plain greedy's tokens, over prompts that repeat (NGRAM has drafts)."""
    import fastspec
    from fastspec.models.heads import write_random_head
    from fastspec.sampling import SamplingParams

    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41]]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    plain = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="gguf", max_total_tokens=512)
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    draft = {}
    if algorithm == "EAGLE3":
        head = write_random_head(head_dir, hidden, len(TOKENS), "eagle3")
        config = json.loads((head / "config.json").read_text())
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 0, 1]  # the target has 2 layers
        (head / "config.json").write_text(json.dumps(config))
        draft["draft_model"] = str(head)
    llm = fastspec.LLM(str(path), speculative_algorithm=algorithm, quantization="gguf", max_total_tokens=512,
                       tuned=False, **draft)
    llm.engine.policy = None  # every round speculates
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)
