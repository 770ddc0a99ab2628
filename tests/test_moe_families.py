"""Qwen3-MoE and Mixtral targets: Llama-family attention beside a sparse MoE MLP (fastspec.models.moe's, as
DeepSeek's and Qwen3-Next's routed experts) with softmax top-k routing and no shared expert.

transformers is the oracle (logit parity for every family, unchunked: test_models.py); here: which layers are MoE,
Mixtral's checkpoint names, logits through chunked prefill and batched decode, greedy generation against
transformers' greedy, the lossless invariant for EAGLE-3, NGRAM and STANDALONE, a fullgraph compile, the config
fields read (and their defaults), and bad configs as one line. Quantised checkpoints of both:
test_quantised_checkpoints.py.
"""

import json

import pytest
import torch
from conftest import PoolRunner, all_slots_free, hf_greedy, make_hf_model

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.models.heads import write_random_head
from fastspec.models.layers import MLP
from fastspec.models.loader import load_target
from fastspec.models.model_config import ModelConfig
from fastspec.models.moe import MoE
from fastspec.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50], [3], [28, 84, 19, 71],
           [69, 39, 93, 75, 10, 58, 20, 96, 44, 59, 23, 7, 81, 64, 6], [28, 62], [8, 89, 9], [86, 32]]
NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
MOE_LAYERS = {"qwen3_moe": [True, False, True, True], "mixtral": [True] * 4}  # tiny_models' configs


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(family, directory, transformers model), with a random EAGLE-3 head beside the target."""
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param)
    hf.save_pretrained(root / "target")
    write_random_head(root / "eagle3", hf.config.hidden_size, hf.config.vocab_size, "eagle3")
    return request.param, root, hf


_reference = {}


def reference(root, bs):
    if (root, bs) not in _reference:
        llm = fastspec.LLM(str(root / "target"), max_total_tokens=4096)
        _reference[root, bs] = [o.output_ids for o in llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)]
    return _reference[root, bs]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_the_config_decides_which_layers_are_moe_and_the_weights_land_there(moe):
    """Qwen3-MoE's mlp_only_layers leave layer 1 dense; the routers and experts hold the checkpoint's weights
    (Mixtral's block_sparse_moe.experts.e.w1 / w3 / w2 as gate / up / down), routers in float32 whatever the dtype."""
    family, root, hf = moe
    model = load_target(root / "target", torch.bfloat16)
    assert [isinstance(layer.mlp, MoE) for layer in model.model.layers] == MOE_LAYERS[family]
    assert all(isinstance(layer.mlp, MLP) for layer, m in zip(model.model.layers, MOE_LAYERS[family]) if not m)
    ours, theirs = model.model.layers[0].mlp, hf.model.layers[0].mlp
    assert ours.shared_experts is None and ours.gate.weight.dtype == torch.float32
    assert torch.equal(ours.gate.weight, theirs.gate.weight)
    gate, up = theirs.experts.gate_up_proj.chunk(2, 1)  # transformers' stacked [E, 2I, H]: [gate | up]
    for mine, want in ((ours.experts.gate_proj, gate), (ours.experts.up_proj, up),
                       (ours.experts.down_proj, theirs.experts.down_proj)):
        assert torch.equal(mine.float(), want.to(torch.bfloat16).float())


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_batched_decode_match_transformers(moe, page_size):
    """Three requests of 13, 10 and 2 tokens prefilled together in chunks of 5 (the short ones finish first), then
    decoded together step by step: every logit row equals transformers' in float32."""
    _, root, hf = moe
    model = load_target(root / "target", torch.float32)
    runner = PoolRunner(model, page_size=page_size)
    prompts = [PROMPTS[4], PROMPTS[1], PROMPTS[3]]  # longest first: the requests still prefilling are the first rows
    heads = [p[:-2] for p in prompts]
    expected = [hf_logits(hf, p) for p in prompts]
    for start in range(0, len(heads[0]), 5):
        chunks = [h[start:start + 5] for h in heads if len(h) > start]
        logits, row = model.compute_logits(runner.extend([start] * len(chunks), chunks).final), 0
        for b, chunk in enumerate(chunks):
            torch.testing.assert_close(logits[row:row + len(chunk)], expected[b][start:start + len(chunk)],
                                       atol=2e-5, rtol=1e-4)
            row += len(chunk)
    for step in range(2):
        lens = [len(h) + step for h in heads]
        logits = model.compute_logits(runner.extend(lens, [[p[n]] for p, n in zip(prompts, lens)]).final)
        for b, n in enumerate(lens):
            torch.testing.assert_close(logits[b], expected[b][n], atol=2e-5, rtol=1e-4)


def test_greedy_generation_is_transformers_greedy(moe):
    """Batched, chunked (5 tokens), paged: each request's tokens are transformers' own greedy decoding of it."""
    _, root, hf = moe
    llm = fastspec.LLM(str(root / "target"), max_total_tokens=4096, page_size=16, chunked_prefill_size=5)
    outputs = llm.engine.generate(PROMPTS[:6], [GREEDY] * 6)
    assert [o.output_ids for o in outputs] == [hf_greedy(hf, p, NEW) for p in PROMPTS[:6]]
    assert [o.output_ids for o in outputs] == reference(root, 6)


# (algorithm, draft, num_steps, topk, num_draft_tokens, page_size, batch size, chunked prefill size)
CASES = [
    ("EAGLE3", "eagle3", 3, 2, 6, 16, 6, 2048),
    ("EAGLE3", "eagle3", 3, 1, 4, 1, 3, 5),
    ("NGRAM", None, None, None, 8, 1, 8, 2048),
    ("STANDALONE", "self", 4, 1, 5, 16, 4, 7),  # the target drafting for itself: multi-token runs
    ("STANDALONE", "self", 3, 3, 8, 1, 5, 2048),
]


@pytest.mark.parametrize("algorithm, draft, steps, topk, n, page_size, bs, chunk", CASES)
def test_greedy_speculative_equals_target_only(moe, algorithm, draft, steps, topk, n, page_size, bs, chunk):
    _, root, _ = moe
    draft_path = {None: None, "self": str(root / "target")}.get(draft, str(root / str(draft)))
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                       topk=topk, num_draft_tokens=n, page_size=page_size, max_total_tokens=4096,
                       chunked_prefill_size=chunk)
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == reference(root, bs)
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    if draft == "self":
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)
    assert all_slots_free(llm.engine)
    llm.engine.check_kv()


def test_compiled_rounds_equal_eager(moe):
    """The target drafting for itself with graphs compiled fullgraph (a compile failure fails the test: conftest):
    the draft loop, the draft extend and the verify, each with its MoE layers' experts run densely."""
    _, root, _ = moe
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="STANDALONE", draft_model=str(root / "target"),
                       num_steps=2, topk=2, num_draft_tokens=4, max_total_tokens=2048, graphs="compile",
                       cuda_graph_bs=(4,))
    outputs = llm.engine.generate(PROMPTS[:4], [GREEDY] * 4)
    assert [o.output_ids for o in outputs] == reference(root, 4)
    assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)


@pytest.mark.skipif(not cpu_library.available(), reason="without the C kernels the products are the CPU BLAS's")
def test_bfloat16_speculative_logprobs_are_plain_decodings_bit_for_bit(moe):
    """A verify row computes its token's decode step bit for bit in bfloat16 too (router and experts on the
    row-invariant GEMM, a token's experts summed in expert order), batched or alone."""
    _, root, _ = moe
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    plain = fastspec.LLM(str(root / "target"), dtype="bfloat16", max_total_tokens=4096).engine
    spec = fastspec.LLM(str(root / "target"), speculative_algorithm="STANDALONE", draft_model=str(root / "target"),
                        num_steps=3, topk=2, num_draft_tokens=6, dtype="bfloat16", max_total_tokens=4096).engine
    alone = [plain.generate([p], [params])[0] for p in PROMPTS[:5]]
    for one, batched in zip(alone, spec.generate(PROMPTS[:5], [params] * 5)):
        assert batched.output_ids == one.output_ids
        assert [(lp.logprob, lp.top) for lp in batched.logprobs] == [(lp.logprob, lp.top) for lp in one.logprobs]


def test_experts_rounded_online_to_int4_speculate_losslessly(moe):
    """--quantization int4 on the float checkpoint: every MoE layer's experts become per-expert 4-bit linears
    (LinearExperts), and drafting with the same rounded model changes no token."""
    _, root, _ = moe
    target = str(root / "target")
    plain = fastspec.LLM(target, quantization="int4", max_total_tokens=2048)
    layers = plain.engine.worker.model.model.layers
    assert all(type(layer.mlp.experts).__name__ == "LinearExperts" for layer in layers if isinstance(layer.mlp, MoE))
    expected = [o.output_ids for o in plain.engine.generate(PROMPTS[:4], [GREEDY] * 4)]
    spec = fastspec.LLM(target, quantization="int4", speculative_algorithm="STANDALONE", draft_model=target,
                        num_steps=3, topk=2, num_draft_tokens=5, max_total_tokens=2048, tuned=False)
    spec.engine.policy = None  # every round speculates
    assert [o.output_ids for o in spec.engine.generate(PROMPTS[:4], [GREEDY] * 4)] == expected


def test_warm_starting_a_head_from_a_moe_layer_is_one_line_before_generating(tmp_path, monkeypatch):
    """train-draft --init target copies the last capture layer's dense MLP: on Mixtral (every layer MoE) that was
    an AttributeError after the corpus was generated; now one line before any answer is."""
    from test_train import tiny_config
    from tiny_models import write_chat_target, write_prompt_file

    from fastspec.train.trainer import train_draft

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    target = write_chat_target(tmp_path / "target", family="mixtral")
    with pytest.raises(FastspecError, match="--init target copies target layer 1 .*MixtralForCausalLM's is not"):
        train_draft(tiny_config(tmp_path / "head", target, write_prompt_file(tmp_path / "p.jsonl"), init="target"))
    assert not (tmp_path / "head").exists()  # refused before the run's directory (and its answers) was made


def test_stacking_a_checkpoints_experts_lets_go_of_each_experts_tensor():
    """stack_experts consumes the state: each projection's per-expert tensors leave it (and are freed) as their stack
    is made, so the experts are not held twice at once; a projection missing an expert is left unstacked."""
    import weakref

    from fastspec.models.moe import stack_experts

    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.0.mlp.experts.{e}.{p}.weight": torch.randn(4, 8, generator=gen)
             for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    want = {k: t.clone() for k, t in state.items()}
    freed = [weakref.ref(t) for t in state.values()]
    state |= {"model.norm.weight": torch.ones(8), "model.layers.1.mlp.experts.0.up_proj.weight": torch.ones(2),
              "model.layers.1.mlp.experts.2.up_proj.weight": torch.ones(2)}
    out = stack_experts(state)
    assert out is state and all(r() is None for r in freed)
    for p in ("gate_proj", "up_proj", "down_proj"):
        expected = torch.stack([want[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for e in range(3)])
        assert torch.equal(out[f"model.layers.0.mlp.experts.{p}"], expected)
    assert sorted(k for k in out if "layers.1" in k) == ["model.layers.1.mlp.experts.0.up_proj.weight",
                                                         "model.layers.1.mlp.experts.2.up_proj.weight"]


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None,
                 "use_sliding_window": False, "max_position_embeddings": 40960, "rope_theta": 1e6}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
                "max_position_embeddings": 32768, "rope_theta": 1e6}


def test_published_configs_are_read_as_transformers_reads_them():
    q = ModelConfig.from_hf(QWEN3_30B_A3B)
    assert q.qk_norm and q.head_dim == 128 and q.sliding_window is None
    m = q.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.norm_topk_prob, m.num_shared_experts) == \
        (128, 8, 768, True, 0)
    assert all(m.is_moe_layer(i) for i in range(48))
    sparse = ModelConfig.from_hf(QWEN3_30B_A3B | {"decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert [i for i in range(8) if sparse.is_moe_layer(i)] == [1, 5, 7]
    no_experts = ModelConfig.from_hf(QWEN3_30B_A3B | {"num_experts": 0})
    assert no_experts.moe is None  # every layer dense, as transformers builds it
    defaults = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "norm_topk_prob")}
    assert ModelConfig.from_hf(defaults).moe.num_experts == 128 and not ModelConfig.from_hf(defaults).moe.norm_topk_prob
    x = ModelConfig.from_hf(MIXTRAL_8X7B)
    assert not x.qk_norm and x.head_dim == 128 and x.context_limit == 32768 and x.rope_theta == 1e6
    assert (x.moe.num_experts, x.moe.top_k, x.moe.intermediate_size, x.moe.norm_topk_prob) == (8, 2, 14336, True)
    assert ModelConfig.from_hf(MIXTRAL_8X7B | {"sliding_window": 4096}).context_limit == 4096  # Mistral's rule
    by_type = {k: v for k, v in MIXTRAL_8X7B.items() if k != "architectures"} | {"model_type": "mixtral"}
    assert ModelConfig.from_hf(by_type) == x
    with pytest.raises(FastspecError, match="supported: .*Qwen3MoeForCausalLM, MixtralForCausalLM"):
        ModelConfig.from_hf(MIXTRAL_8X7B | {"architectures": ["GPT2LMHeadModel"]})


@pytest.mark.commands
@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and the 4 routed experts"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be between 1 and the 4 routed experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step 0 must be positive"),
    ({"moe_intermediate_size": 0, "intermediate_size": 0}, "the experts' intermediate size 0 must be positive"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"num_local_experts": "many"}, "missing or malformed field"),
])
def test_bad_moe_configs_are_one_line_errors(moe, tmp_path, change, message):
    family, root, _ = moe
    if "decoder_sparse_step" in change and family == "mixtral":
        pytest.skip("Mixtral has no decoder_sparse_step")
    config = json.loads((root / "target" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(tmp_path), max_total_tokens=512)
    from typer.testing import CliRunner

    from fastspec.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--input-ids", "1,2"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
