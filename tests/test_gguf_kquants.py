"""Q4_K read as Blocks, checked against the `gguf` package's own dequantiser (the independent oracle) on random
super-blocks (the package cannot quantise to Q4_K); the packed int4 linear over them against a float32 linear over
the oracle's weight; and a tiny llama GGUF laid out like a Q4_K_M file (Q4_K projections, some Q6_K) whose
conversion gives the oracle's weights, a fixture for end-to-end tests of the packed path."""

from unittest import mock

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize
from safetensors.torch import load_file
from test_gguf import LAYER_NAMES, TOKENS, write_gguf
from transformers import LlamaConfig, LlamaForCausalLM

from fastspec.kernels import cpu_library
from fastspec.models.gguf import convert_gguf, unpermute_rope_rows
from fastspec.models.gguf_kquants import DEQUANTISED, read_q4_k, read_q6_k
from fastspec.models.packed_layers import BlockLinear, Int4Linear

HEADS, KV_HEADS = 4, 2


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:  # uint8 [n, k / 256 * 144]
    """Random Q4_K rows: random scale, min and nibble bytes; d and dmin finite positive f16 (|w| up to ~1.9)."""
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(1e-4, 2e-3, (n, k // 256, 2)).astype(np.float16).view(np.uint8)  # d, dmin
    return raw.reshape(n, -1)


def random_q6_k(n: int, k: int, rng: np.random.Generator) -> np.ndarray:  # uint8 [n, k / 256 * 210]
    """Random Q6_K rows: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, then f16 d (|w| <= 0.4)."""
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(1e-5, 1e-4, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def oracle(raw: np.ndarray, kind: str) -> torch.Tensor:  # float32 [N, K]
    return torch.from_numpy(np.array(dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32))


# ---- Q4_K as Blocks ----

@pytest.mark.parametrize("n, k", [(16, 256), (24, 512), (8, 1024)])
def test_q4_k_dequantises_as_gguf_does(n, k):
    raw = random_q4_k(n, k, np.random.default_rng(n + k))
    blocks = read_q4_k(raw)
    assert blocks.bits == 4 and blocks.q.shape == (n, k) and blocks.scale.shape == blocks.offset.shape == (n, k // 32)
    assert blocks.q.dtype == torch.uint8 and 0 <= int(blocks.q.min()) and int(blocks.q.max()) <= 15
    assert torch.equal(blocks.dequantise(), oracle(raw, "Q4_K"))  # the same float32 arithmetic: bit for bit


@pytest.mark.parametrize("n, k", [(16, 256), (8, 768)])
def test_q6_k_dequantises_as_gguf_does(n, k):
    raw = random_q6_k(n, k, np.random.default_rng(n + k))
    blocks = read_q6_k(raw)
    assert blocks.bits == 8 and blocks.group == 16 and blocks.q.dtype == torch.int8 and blocks.q.shape == (n, k)
    assert -32 <= int(blocks.q.min()) and int(blocks.q.max()) <= 31 and not blocks.offset.any()
    assert torch.equal(blocks.dequantise(), oracle(raw, "Q6_K"))  # the same float32 arithmetic: bit for bit


def test_q6_k_blocks_are_stored_and_looked_up_exactly():
    """Stored beside a conversion and read back (int8 values, a scale per 16), and as an embedding table (an untied
    Q6_K output is the head's rescoring table): the oracle's rows."""
    from fastspec.models.gguf_blocks import blocks_from_state, blocks_state
    from fastspec.models.packed_layers import BlockEmbedding

    raw = random_q6_k(40, 256, np.random.default_rng(3))
    back = blocks_from_state(blocks_state("w", read_q6_k(raw)).__getitem__, "w")
    assert back.bits == 8 and back.group == 16 and torch.equal(back.dequantise(), oracle(raw, "Q6_K"))
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(BlockEmbedding(back)(ids), F.embedding(ids, oracle(raw, "Q6_K")))


def test_int4_linear_over_q4_k_equals_a_linear_over_the_oracle():
    """float32 activations: exact to float32 rounding (the kernel's zero = offset + 8 * scale is one rounding);
    bfloat16 (the fast kernel): within bfloat16's rounding of the activations and scales (~4e-3 relative here;
    2e-2 allowed)."""
    raw = random_q4_k(48, 512, np.random.default_rng(3))  # N % 16: torch's int4 packing needs it
    weight = oracle(raw, "Q4_K")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight)
    torch.testing.assert_close(Int4Linear.from_blocks(read_q4_k(raw), torch.float32)(x), expected, atol=1e-4, rtol=1e-5)
    fast = Int4Linear.from_blocks(read_q4_k(raw), torch.bfloat16)(x)
    assert fast.dtype == torch.float32 and (fast - expected).abs().max() / expected.abs().max() < 2e-2


def test_rows_move_with_their_scales():
    """A row permutation and llama.cpp's rope row order undone on the blocks equal the same on the oracle."""
    raw = random_q4_k(32, 256, np.random.default_rng(4))
    blocks, weight = read_q4_k(raw), oracle(raw, "Q4_K")
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(5))
    assert torch.equal(blocks.map_rows(lambda t: t[perm]).dequantise(), weight[perm])
    unrope = blocks.map_rows(lambda t: unpermute_rope_rows(t, HEADS))
    assert torch.equal(unrope.dequantise(), unpermute_rope_rows(weight, HEADS))


def test_malformed_q4_k_rows_are_refused():
    with pytest.raises(ValueError, match="whole super-blocks of 144 bytes .*got 145 bytes per row"):
        read_q4_k(np.zeros((2, 145), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"uint8 \[N, bytes per row\]; got int8 \[2, 144\]"):
        read_q4_k(np.zeros((2, 144), dtype=np.int8))


def test_the_dequantised_types_are_ones_the_converter_can_dequantise():
    """The packed path keeps these types' converted weights, which the gguf package's dequantiser makes."""
    assert "Q4_K" not in DEQUANTISED
    for kind in DEQUANTISED:
        qtype = gguf.GGMLQuantizationType[kind]
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        assert oracle(np.zeros((2, 256 // values * size), dtype=np.uint8), kind).shape == (2, 256)


# ---- a tiny llama laid out like a Q4_K_M file ----

def q4_k_m_type(name: str, array: np.ndarray) -> str | None:
    """The GGML type of each tensor: norms stay F32 (None), output and layer 0's attn_v / ffn_down are Q6_K (llama.cpp's
    Q4_K_M gives some layers' attn_v / ffn_down more bits), every other matrix Q4_K."""
    if array.ndim != 2:
        return None
    return "Q6_K" if name in ("output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight") else "Q4_K"


def k_quant_llama() -> LlamaForCausalLM:
    """A tiny llama whose matrices have K (hidden 256, intermediate 512) a multiple of a K-quant super-block."""
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def write_k_quant_gguf(path, seed: int = 0):
    """test_gguf's writer with every matrix replaced by random raw K-quant rows of its shape (q4_k_m_type), the float
    model only giving names, shapes and metadata; norms stay the model's F32 weights."""
    rng = np.random.default_rng(seed)
    random_rows = {"Q4_K": random_q4_k, "Q6_K": random_q6_k}

    class KQuantWriter(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, *args, **kwargs):
            kind = q4_k_m_type(name, tensor)
            if kind is None:
                return super().add_tensor(name, tensor, *args, **kwargs)
            raw = random_rows[kind](*tensor.shape, rng)  # [N, K] -> uint8 [N, bytes per row]
            return super().add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    with mock.patch.object(gguf, "GGUFWriter", KQuantWriter):
        return write_gguf(path, k_quant_llama())


def test_a_q4_k_m_gguf_converts_to_the_oracles_weights(tmp_path):
    """Every projection of the converted model is the oracle's dequantised tensor (q / k with the rope row order
    undone), and every Q4_K one, read as Blocks, dequantises to the same; the converted model runs."""
    path = write_k_quant_gguf(tmp_path / "tiny-q4_k_m.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert {t.tensor_type.name for t in tensors.values()} == {"F32", "Q4_K", "Q6_K"}
    assert tensors["blk.0.attn_v.weight"].tensor_type.name == "Q6_K"
    assert tensors["blk.1.attn_v.weight"].tensor_type.name == "Q4_K"
    converted = load_file(convert_gguf(path, tmp_path / "hf") / "model.safetensors")
    rope_heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}
    projections = {hf: name for hf, name in LAYER_NAMES.items() if hf.endswith("_proj")}  # HF -> GGUF name
    for layer in (0, 1):
        for hf_name, gguf_name in projections.items():
            t, heads = tensors[f"blk.{layer}.{gguf_name}.weight"], rope_heads.get(hf_name)
            kind = t.tensor_type.name
            expected = oracle(t.data, kind)
            if heads is not None:
                expected = unpermute_rope_rows(expected, heads)
            assert torch.equal(converted[f"model.layers.{layer}.{hf_name}.weight"], expected), t.name
            if kind == "Q4_K":
                blocks = read_q4_k(t.data)
                if heads is not None:
                    blocks = blocks.map_rows(lambda x, h=heads: unpermute_rope_rows(x, h))
                assert torch.equal(blocks.dequantise(), expected), t.name
    assert torch.equal(converted["lm_head.weight"], oracle(tensors["output.weight"].data, "Q6_K"))
    with torch.no_grad():  # the random blocks make a model whose logits stay finite
        logits = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("activation", [torch.float32, torch.bfloat16, pytest.param(
    torch.int16, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_a_q4_k_m_model_runs_on_its_blocks(tmp_path, caplog, activation):
    """--quantization gguf on a Q4_K_M file: the Q4_K projections packed, the Q4_K embedding kept as blocks. With
    torch's int4 kernel (float32 / bfloat16 activations) a group with a Q6_K part (layer 0's QKV and down) and the
    Q6_K output run dequantised, with one note; with fastspec's (int16) they are packed too, as 8-bit blocks, and the
    head rescores from the Q6_K table's blocks. float32 activations give the converted model's logits to float32
    rounding; bfloat16 or int16 ones (the fast kernels) its greedy tokens, teacher-forced, nearly always (the
    lm_head's best tokens rescored exactly)."""
    from fastspec.models.causal_lm import CausalLM as Target
    from fastspec.models.gguf_packed import load_packed_target
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target, read_config
    from fastspec.models.packed_layers import BlockEmbedding, CastLinear, RefinedHead
    from fastspec.train.data import PackedCausalAttention

    model_dir = convert_gguf(write_k_quant_gguf(tmp_path / "tiny-q4_k_m.gguf"), tmp_path / "hf")
    reference = fuse_projections(load_target(model_dir, torch.float32))
    with torch.device("meta"):
        skeleton = Target(read_config(model_dir))
    model = load_packed_target(skeleton, model_dir, torch.float32, activation=activation)
    layers = model.model.layers
    mixed = (layers[0].self_attn.qkv_proj, layers[0].mlp.down_proj)  # a Q6_K part beside Q4_K ones, or Q6_K alone
    if activation == torch.int16:
        assert all(isinstance(m, BlockLinear) and m.packed.dtype == torch.int8 for m in mixed)
        assert model.lm_head.table.q.dtype == torch.int8 and "no packed kernel" not in caplog.text
    else:
        assert all(isinstance(m, CastLinear) for m in mixed)
        assert "Q6_K tensors have no packed kernel here" in caplog.text
    packed = (layers[1].self_attn.qkv_proj, layers[1].mlp.down_proj, layers[0].mlp.gate_up_proj,
              layers[0].self_attn.o_proj)
    assert all(isinstance(m, Int4Linear | BlockLinear) for m in packed)
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    assert isinstance(model.lm_head, CastLinear if activation == torch.float32 else RefinedHead)
    x = torch.randint(0, len(TOKENS), (40,), generator=torch.Generator().manual_seed(0))
    logits = []
    for m in (model, reference):
        with torch.inference_mode():
            hidden = m(x, torch.arange(len(x)), PackedCausalAttention(torch.zeros(len(x), dtype=torch.long))).final
            logits.append(m.compute_logits(hidden))
    if activation == torch.float32:
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    else:
        assert (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean() >= 0.9
