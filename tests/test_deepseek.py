"""DeepSeek-V2 / V3 targets (MLA over a latent KV pool, MoE) and NEXTN drafting with their MTP layer.

transformers is the oracle for the math (logit parity in prefill and paged decode lives in test_models.py, which
runs every family); here: greedy output against transformers' own argmax, the latent pool's size, the twins
(absorbed vs naive MLA, sparse vs dense experts), the lossless invariant for every drafting algorithm over an
MLA target, the sampled distribution under NEXTN, a fullgraph compile, and the one-line errors. The commands
(bench, tune, train-draft) on a DeepSeek target: test_deepseek_commands.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import all_slots_free
from tiny_models import write_deepseek

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.memory import KVPool
from fastspec.models.heads import write_random_head
from fastspec.models.loader import load_target
from fastspec.models.model_config import MoEConfig
from fastspec.models.moe import Experts, Router
from fastspec.sampling import SamplingParams
from fastspec.train.data import PackedCausalAttention

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50], [3], [28, 84, 19, 71],
           [69, 39, 93, 75, 10, 58, 20, 96, 44, 59, 23, 7, 81, 64, 6], [28, 62], [8, 89, 9], [86, 32]]
NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """family -> (directory, transformers model); V3 with an MTP layer, V2 without; random EAGLE heads for V3."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {f: (root / f, write_deepseek(root / f, f, mtp=int(f == "deepseek_v3"))) for f in ("deepseek_v3", "deepseek_v2")}
    c = out["deepseek_v3"][1].config
    for kind in ("eagle", "eagle3"):
        write_random_head(root / kind, c.hidden_size, c.vocab_size, kind)
    return out | {"root": root}


_reference = {}


def reference(ds, family, page_size, bs):
    key = (family, page_size, bs)
    if key not in _reference:
        llm = fastspec.LLM(str(ds[family][0]), max_total_tokens=4096, page_size=page_size)
        _reference[key] = [o.output_ids for o in llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)]
    return _reference[key]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_greedy_output_is_transformers_argmax(ds, family):
    """Every generated token is transformers' argmax over the same prefix (teacher-forced, near-ties skipped)."""
    directory, hf = ds[family]
    outputs = reference(ds, family, 1, 4)
    checked = 0
    for prompt, output in zip(PROMPTS[:4], outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
        top2 = logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert logits.argmax(-1)[clear].tolist() == torch.tensor(output)[clear].tolist()
        checked += int(clear.sum())
    assert checked >= 0.9 * 4 * NEW


def test_latent_pool_stores_kv_lora_plus_rope_per_token_and_layer(ds):
    llm = fastspec.LLM(str(ds["deepseek_v3"][0]), speculative_algorithm="NEXTN", max_total_tokens=512)
    c = llm.engine.model.config
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    for pool, layers in ((llm.engine.pool, c.num_layers), (llm.engine.worker.draft_pool, 1)):
        assert pool.v is None and pool.k.shape == (layers, pool.num_slots, 1, latent)
        per_token = pool.k[:, 0].numel() * pool.k.element_size()
        assert per_token == latent * layers * 4  # float32: no expanded K or V anywhere
    assert KVPool.bytes_per_token(*c.kv_layout[:3], torch.bfloat16, c.kv_layout[3]) == latent * 4 * 2


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_absorbed_mla_equals_naive(ds, family):
    """Attention over the latent (q_nope absorbed into W_UK, output through W_UV) == expanded per-head K/V."""
    model = load_target(ds[family][0], torch.float32)
    attn_module = model.model.layers[1].self_attn
    T = 11
    x, positions = torch.randn(T, model.config.hidden_size), torch.arange(T) + 5
    with torch.no_grad():
        q, latent = attn_module.project(positions, x, model.rope)
        absorbed = attn_module.output(PackedCausalAttention(torch.zeros(T)).attend_latent(
            0, q, latent, attn_module.kv_rank, attn_module.scale))
        q, k, v = attn_module.expand_kv(positions, x, model.rope)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                           scale=attn_module.scale).transpose(0, 1)
        naive = attn_module.o_proj(o.reshape(T, -1))
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scoring, method", [("sigmoid", "noaux_tc"), ("softmax", "group_limited_greedy"),
                                             ("softmax", "greedy")])
def test_sparse_and_dense_experts_agree(scoring, method):
    m = MoEConfig(num_experts=8, num_shared_experts=1, intermediate_size=12, top_k=3, n_group=4, topk_group=2,
                  scoring=scoring, topk_method=method, norm_topk_prob=scoring == "sigmoid",
                  routed_scaling_factor=2.0, first_k_dense_replace=0)
    torch.manual_seed(0)
    router, experts = Router(16, m), Experts(8, 16, 12)
    for p in (*router.parameters(), *experts.parameters()):
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(23, 16)
    weights, index = router(x)
    assert index.shape == (23, 3) and bool((weights > 0).all())
    if method != "greedy":  # the chosen experts (2 per group) lie in at most topk_group groups
        assert all(len(set((row // 2).tolist())) <= 2 for row in index)
    dense, sparse = experts.forward_dense(x, weights, index), experts.forward_sparse(x, weights, index)
    if not cpu_library.available():  # the BLAS's products: to rounding
        torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-4)
        return
    assert torch.equal(dense, sparse)  # one expert's product per token, summed in expert order, in both
    for t in (0, 11, 22):  # a token computes alone what it computes among the others
        w, i = router(x[t:t + 1])
        assert torch.equal(w, weights[t:t + 1]) and torch.equal(i, index[t:t + 1])
        assert torch.equal(experts.forward_sparse(x[t:t + 1], w, i), sparse[t:t + 1])


@pytest.mark.skipif(not cpu_library.available(), reason="without the C kernels the products are the CPU BLAS's")
@pytest.mark.parametrize("family, dtype", [("deepseek_v3", "float32"), ("deepseek_v3", "bfloat16"),
                                           ("deepseek_v2", "bfloat16")])
def test_speculative_logprobs_are_plain_decodings_bit_for_bit(ds, family, dtype):
    """A verify row computes its token's decode step bit for bit on an MLA + MoE target too: the latent pool's
    attention in the C kernel, the absorbed MLA products, router and experts on the row-invariant GEMM, the
    router's sigmoid padded out of torch's scalar tail. (Before: logprobs ~1e-6 apart in float32, ~2e-2 in
    bfloat16, where a prefix-cache hit alone moved them.)"""
    directory = str(ds[family][0])
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    plain = fastspec.LLM(directory, speculative_algorithm="NONE", dtype=dtype, max_total_tokens=4096).engine
    spec = fastspec.LLM(directory, speculative_algorithm="STANDALONE", draft_model=directory, num_steps=3, topk=2,
                        num_draft_tokens=6, dtype=dtype, max_total_tokens=4096).engine
    alone = [plain.generate([p], [params])[0] for p in PROMPTS]
    for runs in (spec.generate(PROMPTS, [params] * len(PROMPTS)), plain.generate(PROMPTS, [params] * len(PROMPTS))):
        for one, batched in zip(alone, runs):
            assert batched.output_ids == one.output_ids
            assert [(lp.logprob, lp.top) for lp in batched.logprobs] == [(lp.logprob, lp.top) for lp in one.logprobs]


# (family, algorithm, draft, num_steps, topk, num_draft_tokens, page_size, batch size, chunked prefill size)
CASES = [
    ("deepseek_v3", "NEXTN", None, None, None, None, 1, 8, 2048),  # SGLang's default chain (3, 1, 4)
    ("deepseek_v3", "NEXTN", None, 4, 4, 8, 16, 5, 2048),
    ("deepseek_v3", "EAGLE", None, 2, 2, 4, 1, 3, 7),  # EAGLE on a target with an MTP layer = NEXTN
    ("deepseek_v3", "STANDALONE", "self", 4, 1, 5, 16, 8, 2048),
    ("deepseek_v3", "STANDALONE", "self", 3, 3, 10, 1, 4, 5),
    ("deepseek_v3", "EAGLE", "eagle", 3, 2, 6, 16, 6, 2048),
    ("deepseek_v3", "EAGLE3", "eagle3", 3, 1, 4, 1, 4, 2048),
    ("deepseek_v3", "NGRAM", None, None, None, 8, 16, 7, 2048),
    ("deepseek_v2", "STANDALONE", "self", 5, 2, 8, 16, 6, 9),
    ("deepseek_v2", "NGRAM", None, None, None, 6, 1, 8, 2048),
]


@pytest.mark.parametrize("family, algorithm, draft, steps, topk, n, page_size, bs, chunk", CASES)
def test_greedy_speculative_equals_target_only(ds, family, algorithm, draft, steps, topk, n, page_size, bs, chunk):
    directory = ds[family][0]
    draft_path = {None: None, "self": str(directory)}.get(draft, str(ds["root"] / str(draft)))
    llm = fastspec.LLM(str(directory), speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                       topk=topk, num_draft_tokens=n, page_size=page_size, max_total_tokens=4096,
                       chunked_prefill_size=chunk)
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == reference(ds, family, page_size, bs)
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    if draft == "self":  # the target drafting for itself: multi-token runs through the latent pool's commit
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)
    assert all_slots_free(llm.engine)
    llm.engine.check_kv()


@pytest.mark.parametrize("kv, stored", [("bfloat16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_a_smaller_latent_pool_is_lossless(ds, kv, stored):
    """--kv-cache-dtype on an MLA target: the latent pool (and the MTP draft's) stored in 16 or 8 bits; NEXTN's
    output equals plain decoding's over the same pool dtype."""
    directory = str(ds["deepseek_v3"][0])
    plain = fastspec.LLM(directory, max_total_tokens=2048, kv_cache_dtype=kv)
    expected = [o.output_ids for o in plain.engine.generate(PROMPTS[:4], [GREEDY] * 4)]
    llm = fastspec.LLM(directory, speculative_algorithm="NEXTN", num_steps=3, topk=2, num_draft_tokens=5,
                       max_total_tokens=2048, kv_cache_dtype=kv)
    outputs = llm.engine.generate(PROMPTS[:4], [GREEDY] * 4)
    assert [o.output_ids for o in outputs] == expected
    assert llm.engine.worker.memory.pools[0].k.dtype == stored
    assert all_slots_free(llm.engine)


def test_compiled_rounds_equal_eager(ds):
    """The draft loop, draft extend and verify of an MLA target with its MTP draft compile with fullgraph."""
    directory = str(ds["deepseek_v3"][0])
    llm = fastspec.LLM(directory, speculative_algorithm="NEXTN", num_steps=2, topk=2, num_draft_tokens=4,
                       max_total_tokens=2048, graphs="compile", cuda_graph_bs=(4,))
    outputs = llm.engine.generate(PROMPTS[:4], [GREEDY] * 4)
    assert [o.output_ids for o in outputs] == reference(ds, "deepseek_v3", 1, 4)


def test_nextn_sampling_follows_the_target(tmp_path):
    """Sampled NEXTN: (first, second) token pairs chi-square tested against transformers' probabilities."""
    vocab, prompt, samples = 8, [1, 5, 3], 2000
    hf = write_deepseek(tmp_path, "deepseek_v3", seed=3, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        second = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double(), -1)
    expected = (first[:, None] * second).flatten() * samples
    llm = fastspec.LLM(str(tmp_path), speculative_algorithm="NEXTN", num_steps=2, topk=2, num_draft_tokens=4,
                       max_total_tokens=20000, max_running_requests=256)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=2, ignore_eos=True) for s in range(samples)]
    outputs = llm.engine.generate([prompt] * samples, params)
    pairs = torch.tensor([o.output_ids[0] * vocab + o.output_ids[1] for o in outputs])
    observed = torch.bincount(pairs, minlength=vocab * vocab).double()
    cells = expected > 5
    chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((int(cells.sum()) - 1) / 2.0), chi2 / 2))
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    assert p_value > 1e-3, f"chi2={float(chi2):.1f}"


def test_nextn_without_an_mtp_layer_is_a_one_line_error(ds):
    with pytest.raises(FastspecError, match="NEXTN drafts with the checkpoint's MTP layer.*has none"):
        fastspec.LLM(str(ds["deepseek_v2"][0]), speculative_algorithm="NEXTN", max_total_tokens=512)


@pytest.mark.commands
@pytest.mark.parametrize("change, message", [
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     r"quantisation method 'bitsandbytes' \(bitsandbytes' NF4 / int8 layouts\) is not supported; supported: fp8"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported rope scaling type 'longrope'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"n_group": 3}, "inconsistent MoE routing"),
])
def test_unsupported_checkpoints_are_refused_before_loading(ds, tmp_path, change, message):
    config = json.loads((ds["deepseek_v3"][0] / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in change else None
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(tmp_path), max_total_tokens=512)
    from typer.testing import CliRunner

    from fastspec.cli import app

    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--input-ids", "1,2"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output


def test_an_mtp_draft_of_another_width_is_refused(ds, tmp_path):
    write_deepseek(tmp_path, "deepseek_v3", hidden_size=32)
    with pytest.raises(FastspecError, match="the MTP draft's hidden_size 32 != the target's 64"):
        fastspec.LLM(str(ds["deepseek_v3"][0]), speculative_algorithm="NEXTN", draft_model=str(tmp_path),
                     max_total_tokens=512)


def test_several_mtp_layers_draft_one_step_each(ds, tmp_path):
    """A checkpoint with 2 MTP layers: step s drafts with layer s mod 2 (each with its own draft KV layer), the
    extend runs both; output equals target-only for chains and trees, and tune's replay of that draft predicts
    the engine's rounds exactly (the same layered extend and steps offline)."""
    from safetensors.torch import load_file

    from fastspec.models.deepseek import MTPStack
    from fastspec.tune.replay import candidate_params, record, replay_tau

    write_deepseek(tmp_path, "deepseek_v3", mtp=2)
    state = load_file(tmp_path / "model.safetensors")
    plain = fastspec.LLM(str(tmp_path), max_total_tokens=2048).engine.generate(PROMPTS[:4], [GREEDY] * 4)
    for steps, topk, n, page_size in ((3, 1, 4, 1), (3, 2, 6, 16)):
        llm = fastspec.LLM(str(tmp_path), speculative_algorithm="NEXTN", num_steps=steps, topk=topk,
                           num_draft_tokens=n, page_size=page_size, max_total_tokens=2048, chunked_prefill_size=5)
        e = llm.engine
        mtp = e.drafter.model
        assert isinstance(mtp, MTPStack) and mtp.per_step_layers == 2 and e.worker.draft_pool.k.shape[0] == 2
        assert torch.equal(mtp.layers[1].eh_proj.weight, state["model.layers.5.eh_proj.weight"])
        outputs = e.generate(PROMPTS[:4], [GREEDY] * 4)
        assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
        e.check_kv()
    recorded = [record(e.model, mtp, None, e.feature, o.prompt_ids, o.output_ids, candidate_params(3, (1, 2), 6))
                for o in plain]
    rounds, emitted = (sum(getattr(o.metrics, f) for o in outputs) for f in ("verify_rounds", "emitted_tokens"))
    assert replay_tau(recorded, e.spec.params) == (rounds, emitted)


def test_nextn_reads_the_target_checkpoint_once(ds, monkeypatch):
    """The MTP layer's tensors are read alone: the target's weights are not loaded a second time for the draft."""
    import safetensors.torch

    full_reads, real = [], safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda path, *a, **k: full_reads.append(path) or
                        real(path, *a, **k))
    directory = ds["deepseek_v3"][0]
    llm = fastspec.LLM(str(directory), speculative_algorithm="NEXTN", max_total_tokens=512)
    assert len(full_reads) == len(list(Path(directory).glob("*.safetensors")))
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert llm.engine.generate(PROMPTS[:2], [params] * 2)[0].output_ids == \
        fastspec.LLM(str(directory), max_total_tokens=512).engine.generate(PROMPTS[:2], [params] * 2)[0].output_ids
