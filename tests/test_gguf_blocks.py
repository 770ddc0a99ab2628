"""GGUF block formats read without dequantising, checked against the `gguf` package's own dequantiser (the
independent oracle) on the embedded model's real tensors and on freshly quantised ones; the packed int4 linear
against a float32 linear over the same dequantised weight."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from fastspec.kernels import cpu_library
from fastspec.models.gguf_read import unpermute_rope_rows
from fastspec.models.gguf_blocks import Blocks, merge_rows, read_blocks
from fastspec.models.activation_choice import fast_activation
from fastspec.models.packed_layers import BlockLinear, Int4Linear


def quantised(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quantize(data, gguf.GGMLQuantizationType[kind])


def oracle(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32))


@pytest.mark.parametrize("kind, values", [("Q4_0", (0, 15)), ("Q4_1", (0, 15)), ("Q5_0", (-16, 15)), ("Q5_1", (0, 31)),
                                          ("Q8_0", (-127, 127))])
def test_blocks_dequantise_as_gguf_does(kind, values):
    raw = quantised(kind, 24, 96)
    blocks = read_blocks(raw, kind)
    assert blocks.q.shape == (24, 96) and blocks.scale.shape == (24, 3)
    assert (int(blocks.q.min()), int(blocks.q.max())) == values and blocks.bits == (4 if kind[1] == "4" else 8)
    assert torch.equal(blocks.dequantise(), oracle(raw, kind))  # the same float32 arithmetic: bit for bit


def test_the_embedded_ggufs_tensors_read_exactly():
    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf

    reader = gguf.GGUFReader(find_embedded_gguf(DEFAULT_MODEL))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        assert torch.equal(read_blocks(t.data, kind).dequantise(), oracle(t.data, kind)), t.name
    assert seen == {"Q4_1", "Q8_0"}  # the file's quantised types: every linear Q4_1, the tied embedding Q8_0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_linear_equals_a_linear_over_the_dequantised_weight(kind):
    """float32 activations: exact to float32 rounding; bfloat16 (the fast kernel): within bfloat16's rounding of
    the activations and scales (~3e-3 relative here; 2e-2 allowed)."""
    parts = [read_blocks(quantised(kind, n, 128, seed=n), kind) for n in (64, 32, 32)]  # a fused QKV's rows
    merged = merge_rows(parts)
    weight = torch.cat([p.dequantise() for p in parts])
    assert torch.equal(merged.dequantise(), weight)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight)
    exact = Int4Linear.from_blocks(merged, torch.float32)
    torch.testing.assert_close(exact(x), expected, atol=1e-4, rtol=1e-5)
    fast = Int4Linear.from_blocks(merged, torch.bfloat16)
    error = (fast(x) - expected).abs().max() / expected.abs().max()
    assert fast(x).dtype == torch.float32 and error < 2e-2


def test_rows_move_with_their_scales():
    """Undoing llama.cpp's rope row order on the blocks equals undoing it on the dequantised weight."""
    blocks = read_blocks(quantised("Q4_1", 32, 64), "Q4_1")
    moved = blocks.map_rows(lambda t: unpermute_rope_rows(t, 4))
    assert torch.equal(moved.dequantise(), unpermute_rope_rows(blocks.dequantise(), 4))


def test_a_format_or_shape_it_cannot_take_is_refused():
    with pytest.raises(ValueError, match="Q6_K is not a block format"):
        read_blocks(np.zeros((2, 210), dtype=np.uint8), "Q6_K")
    with pytest.raises(ValueError, match=r"K % 32 == 0, got \[6, 48\]"):
        Int4Linear.from_blocks(Blocks(torch.zeros(6, 48, dtype=torch.uint8), torch.ones(6, 3), torch.zeros(6, 3), 4))
    with pytest.raises(ValueError, match="4-bit"):
        Int4Linear.from_blocks(read_blocks(quantised("Q8_0", 8, 64), "Q8_0"))


# ---- the embedded model with its 4-bit projections packed (quantization="gguf") ----

QUESTIONS = ["Why is the sky blue?", "How do I sort a list in Python?"]


@pytest.fixture(scope="module")
def teacher(embedded_dir):
    """The converted (dequantised) float32 model, fused, and greedy sequences of it (prompt + 32 tokens)."""
    import fastspec
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target
    from fastspec.sampling import SamplingParams

    llm = fastspec.LLM(quantization=None, speculative_algorithm="NONE", max_total_tokens=2048)
    outs = llm.generate(QUESTIONS, SamplingParams(max_new_tokens=32), chat=True)
    return fuse_projections(load_target(embedded_dir, torch.float32)), [(o.prompt_ids, o.output_ids) for o in outs]


def teacher_forced_argmax(model, prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, argmax) after every prompt + output prefix that predicts an output token."""
    from fastspec.train.data import PackedCausalAttention

    x = torch.tensor(prompt + output)
    with torch.inference_mode():
        hidden = model(x, torch.arange(len(x)), PackedCausalAttention(torch.zeros(len(x), dtype=torch.long))).final
        logits = model.compute_logits(hidden)[len(prompt) - 1:-1]
    return logits, logits.argmax(-1)


@pytest.mark.parametrize("activation, agreement", [(torch.float32, 1.0), (torch.bfloat16, 0.96), pytest.param(
    torch.int16, 0.96, marks=pytest.mark.skipif(not cpu_library.available(), reason="no C compiler"))])
def test_packed_projections_against_the_converted_model(embedded_dir, teacher, activation, agreement):
    """Every projection of the 30 layers packed from the file's own Q4_1 blocks, the embedding on its Q8_0 blocks, no
    float linear left. float32 activations: the converted model's logits to float32 rounding (1e-3) and its every
    greedy token; bfloat16 or int16 (the fast kernels): teacher-forced top-1 agreement (64 / 64 measured here with
    bfloat16; bench/packed_agreement.py measures it on twelve held-out answers; 96 % asserted)."""
    from fastspec.models.causal_lm import CausalLM
    from fastspec.models.gguf_packed import load_packed_target
    from fastspec.models.loader import read_config

    reference, sequences = teacher
    with torch.device("meta"):
        skeleton = CausalLM(read_config(embedded_dir))
    model = load_packed_target(skeleton, embedded_dir, torch.float32, activation=activation)
    packed = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, Int4Linear | BlockLinear)]
    assert len(packed) == 4 * model.config.num_layers
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    same = total = 0
    for prompt, output in sequences:
        logits, top = teacher_forced_argmax(model, prompt, output)
        expected_logits, expected = teacher_forced_argmax(reference, prompt, output)
        if activation == torch.float32:
            torch.testing.assert_close(logits, expected_logits, atol=1e-3, rtol=1e-4)
        same, total = same + int((top == expected).sum()), total + len(output)
    assert same >= agreement * total, (same, total)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_speculation_on_the_packed_target_is_lossless(algorithm):
    import fastspec
    from fastspec.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=24)
    plain = fastspec.LLM(speculative_algorithm="NONE", quantization="gguf", max_total_tokens=2048)
    expected = [o.output_ids for o in plain.generate(QUESTIONS, params, chat=True)]
    llm = fastspec.LLM(speculative_algorithm=algorithm, quantization="gguf", max_total_tokens=2048, tuned=False)
    llm.engine.policy = None  # every round speculates
    outputs = llm.generate(QUESTIONS, params, chat=True)
    assert [o.output_ids for o in outputs] == expected and all(o.metrics.verify_rounds > 0 for o in outputs)


def test_the_packed_model_holds_its_blocks_once(embedded_dir):
    """No float copy of a packed weight: the packed model's tensors take under a quarter of the float32 model's
    538 MB (measured 0.242 with bfloat16 activations: 4-bit projections, a byte per embedding value and an int8
    copy of it for the lm_head); the embedding and the head's exact rows are one table."""
    from fastspec.models.loader import load_target

    model = load_target(embedded_dir, torch.float32, quantization="gguf")
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values()  # shared ones once
    fast = fast_activation() != torch.float32  # else the lm_head is the exact float32 linear
    assert sum(t.numel() * t.element_size() for t in tensors) < (0.25 if fast else 0.25 + 113e6 / 538e6) * 538e6
    assert not fast or model.lm_head.table is model.model.embed_tokens


def test_the_packed_layout_is_cached_per_torch_version(embedded_dir, tmp_path, monkeypatch):
    """The first packed load stores the packed layouts beside the blocks (replacing a cache of an older layout); the
    next one reads it and computes the same weights; a damaged cache is packed again and replaced; a cache it cannot
    write to is left as it is (the model still loads)."""
    import shutil

    from fastspec.models.gguf_packed import PACKED_LAYOUT
    from fastspec.models.loader import load_target

    model_dir = tmp_path / "model"
    shutil.copytree(embedded_dir, model_dir, ignore=shutil.ignore_patterns("int4-*"))
    cached = list((model_dir / "gguf_blocks").glob("int4-cpu-torch-*.safetensors"))
    assert cached == []
    older = model_dir / "gguf_blocks" / f"int4-cpu-torch-{torch.__version__}.safetensors"  # the first layout's name
    older.write_bytes(b"stale")
    x = torch.tensor([1, 2, 3, 4])
    first = load_target(model_dir, torch.float32, quantization="gguf")
    cached = [p.name for p in (model_dir / "gguf_blocks").glob("int4-*")]
    name = f"int4-cpu-torch-{torch.__version__}-layout{PACKED_LAYOUT}.safetensors"
    assert cached == [name]
    again = load_target(model_dir, torch.float32, quantization="gguf")
    with torch.inference_mode():
        assert torch.equal(first.model.embed_tokens(x), again.model.embed_tokens(x))
        qkv = first.model.layers[3].self_attn.qkv_proj
        assert torch.equal(qkv.packed, again.model.layers[3].self_attn.qkv_proj.packed)
    cache = model_dir / "gguf_blocks" / name
    damaged = tmp_path / "damaged"  # a new file moved over it: the loaded models still map the old one
    damaged.write_bytes(cache.read_bytes()[:1000])
    damaged.replace(cache)
    repacked = load_target(model_dir, torch.float32, quantization="gguf")  # packed again and replaced
    assert torch.equal(qkv.packed, repacked.model.layers[3].self_attn.qkv_proj.packed)
    assert cache.stat().st_size > 1000
    cache.unlink()

    def read_only(*args, **kwargs):  # what a read-only cache directory answers (the suite may run as root)
        raise PermissionError("read-only file system")

    monkeypatch.setattr("fastspec.utils.shared_dirs.tempfile.mkstemp", read_only)
    load_target(model_dir, torch.float32, quantization="gguf")
    assert not list((model_dir / "gguf_blocks").glob("*int4*"))


def test_an_eagle2_head_on_a_packed_target_is_a_one_line_error(embedded_dir, tmp_path):
    """An EAGLE-2 head multiplies by the target's lm_head weight, which the packed model does not keep: refused from
    the head's config alone, before any weight loads."""
    import json

    import fastspec
    from fastspec.errors import FastspecError

    config = json.loads((embedded_dir / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    head = tmp_path / "eagle2-head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(config))  # no weights: they would be read after the check
    with pytest.raises(FastspecError, match="EAGLE-2 head needs the target's float lm_head"):
        fastspec.LLM(speculative_algorithm="EAGLE", draft_model=str(head), quantization="gguf", max_total_tokens=512)


def test_a_tuned_file_is_keyed_by_the_quantization(embedded_dir, tmp_path, monkeypatch):
    """A schedule tuned on the dequantised model is not applied to the packed one (its rounds cost differently),
    nor the other way round, nor one tuned over another KV cache dtype (auto's included: a packed model's default
    cache is bfloat16); each finds its own."""
    from pathlib import Path

    import fastspec
    from fastspec.spec_config import SpecParams
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path, weights_label

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    head = Path(fastspec.__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"
    for weights, params in (("float32", [3, 2, 5]), (weights_label("float32", "gguf"), [2, 1, 3]),
                            (weights_label("float32", "gguf", "float8_e4m3fn"), [1, 1, 2]),
                            (weights_label("float32", "gguf", "bfloat16"), [2, 2, 3])):
        save_tuned(tuned_path(embedded_dir, head, weights, "cpu"), fingerprint(embedded_dir, head, weights, "cpu"),
                   [{"max_batch_size": 1, "params": params}, {"max_batch_size": 4, "params": None}])
    kwargs = dict(model=str(embedded_dir), speculative_algorithm="EAGLE3", draft_model=str(head), max_total_tokens=512)
    dequantised = fastspec.LLM(**kwargs, quantization="none")
    assert dequantised.planned_spec.schedule == ((1, SpecParams(3, 2, 5)), (4, None))
    for quantization in ("gguf", "auto"):  # auto: packed, a GGUF model on CPU (over a bfloat16 cache by default)
        packed = fastspec.LLM(**kwargs, quantization=quantization)
        assert packed.engine.config.quantization == "gguf"
        assert packed.planned_spec.schedule == ((1, SpecParams(2, 2, 3)), (4, None))
    # a KV cache in another dtype than the model's has its own file (attention costs by the cache's bytes)
    assert weights_label("float32", "gguf", "float32") == weights_label("float32", "gguf")
    for kv, params in (("float32", SpecParams(2, 1, 3)), ("fp8_e4m3", SpecParams(1, 1, 2)),
                       ("bf16", SpecParams(2, 2, 3))):
        packed = fastspec.LLM(**kwargs, quantization="gguf", kv_cache_dtype=kv)
        assert packed.planned_spec.schedule == ((1, params), (4, None))


def test_packing_a_model_that_is_not_a_gguf_is_a_one_line_error(tiny_dirs):
    import fastspec
    from fastspec.errors import FastspecError

    with pytest.raises(FastspecError, match="needs a model converted from a .gguf file"):
        fastspec.LLM(str(tiny_dirs["llama"][0]), quantization="gguf", max_total_tokens=512)
    with pytest.raises(FastspecError, match="^quantization must be one of auto, none, gguf, .*, got 'nf4'"):
        fastspec.LLM(quantization="nf4")
    with pytest.raises(FastspecError, match="^quantization='awq': .* is a float checkpoint"):
        fastspec.LLM(quantization="awq")


def test_auto_quantization_packs_a_gguf_model_on_cpu_only(embedded_dir, tiny_dirs):
    from fastspec.config import EngineConfig
    from fastspec.models.sources import resolve_quantization

    assert resolve_quantization("auto", embedded_dir, None, "cpu", "auto", "EAGLE3") == "gguf"
    assert resolve_quantization("auto", embedded_dir, None, "cuda", "auto", "NONE") is None  # the int4 kernel is CPU's
    assert resolve_quantization("auto", embedded_dir, None, "cpu", "dummy", "NONE") is None  # no weights read
    assert resolve_quantization("auto", embedded_dir, None, "cpu", "auto", "EAGLE") is None  # EAGLE-2: float lm_head
    assert resolve_quantization("auto", tiny_dirs["llama"][0], None, "cpu", "auto", "NONE") is None  # not a GGUF
    assert resolve_quantization(None, embedded_dir, None, "cpu", "auto", "NONE") is None
    assert EngineConfig(quantization="none").quantization is None
