"""Hybrid targets (Qwen3-Next: gated delta nets beside gated attention; Bamba: Mamba2 mixers beside attention)
and speculative decoding over them.

transformers is the oracle for the math (logit parity in prefill and paged decode: test_models.py, which runs
every family; the delta-rule and SSD kernels and per-node tree states: test_hybrid_kernels.py); here: greedy output
against transformers' argmax, and the lossless invariant through the engine. Random drafts are rarely accepted, so
an oracle drafter (NGRAM's slot, proposing the known greedy continuation plus wrong branches) drives multi-token
commits and rejected branches, while a check after every step compares each request's recurrent state with a fresh
prefill of its committed tokens. The prefix cache's saved states: test_hybrid_states.py; NEXTN, tune and
train-draft on a hybrid target: test_hybrid_drafters.py (both use the fixtures here).
"""

import pytest
import torch
from conftest import PoolRunner, all_slots_free, make_hf_model

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.models.heads import write_random_head
from fastspec.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50], [3], [28, 84, 19, 71],
           [69, 39, 93, 75, 10, 58, 20, 96, 44, 59, 23, 7, 81, 64, 6], [28, 62], [8, 89, 9], [86, 32]]
NEW = 20
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next", "bamba"])
def hybrid(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param)
    hf.save_pretrained(root / "target")
    write_random_head(root / "eagle", hf.config.hidden_size, hf.config.vocab_size, "eagle")
    write_random_head(root / "eagle3", hf.config.hidden_size, hf.config.vocab_size, "eagle3")
    make_hf_model("llama", seed=5, num_hidden_layers=1).save_pretrained(root / "llama-draft")
    return root, hf


_reference = {}


def reference(root, bs):
    if (root, bs) not in _reference:
        llm = fastspec.LLM(str(root / "target"), max_total_tokens=4096)
        _reference[root, bs] = [o.output_ids for o in llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)]
    return _reference[root, bs]


def test_greedy_output_is_transformers_argmax(hybrid):
    root, hf = hybrid
    for prompt, output in zip(PROMPTS[:4], reference(root, 4)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
        top2 = logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert logits.argmax(-1)[clear].tolist() == torch.tensor(output)[clear].tolist()
        assert int(clear.sum()) >= NEW - 2


def oracle_drafter(engine, prompts, outputs, vocab):
    """Make the NGRAM drafter propose, per request, the next 4 tokens of the known greedy output as a chain, plus
    3 wrong nodes (a wrong sibling of the first, a wrong child of the second, a wrong child of that sibling)."""
    full = [p + o for p, o in zip(prompts, outputs)]

    def propose(rids, contexts):
        tokens, parents = [], []
        for context in contexts:
            seq = next(f for f in full if f[:len(context)] == context)
            nxt = (seq[len(context):] + [0] * 4)[:4]
            tokens.append([nxt[0], (nxt[0] + 1) % vocab, nxt[1], (nxt[2] + 1) % vocab, nxt[2], nxt[3], 5])
            parents.append([0, 0, 1, 3, 3, 5, 2])
        return torch.tensor(tokens), torch.tensor(parents)

    engine.drafter.ngram.propose = propose


def check_states_after_every_step(llm, model):
    """Wrap the worker's step: afterwards every running request's recurrent state equals a fresh prefill of its
    committed tokens (nothing a rejected branch computed survives; the accepted path's state is kept)."""
    worker = llm.engine.worker
    step = worker.step
    checked = []

    def checked_step(reqs, prefill):
        result = step(reqs, prefill)
        for r in reqs:
            if r.row < 0 or r.seq_len == 0 or r.done:
                continue
            fresh = PoolRunner(model, max_requests=1)
            fresh.extend([0], [r.history[:r.seq_len]])
            row = worker.states.state_rows(torch.tensor([r.row]))
            torch.testing.assert_close(worker.states.ssm[:, row], fresh.states.ssm[:, 1:2], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(worker.states.conv[:, row], fresh.states.conv[:, 1:2], atol=1e-5, rtol=1e-4)
            checked.append(r.seq_len)
        return result

    worker.step = checked_step
    return checked


@pytest.mark.parametrize("page_size, bs, overlap", [(1, 8, "off"), (16, 5, "on")])
def test_oracle_drafts_commit_multi_token_runs_and_drop_wrong_branches(hybrid, page_size, bs, overlap):
    root, hf = hybrid
    expected = reference(root, bs)
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="NGRAM", num_draft_tokens=8, page_size=page_size,
                       max_total_tokens=4096, overlap_schedule=overlap)
    oracle_drafter(llm.engine, PROMPTS[:bs], expected, hf.config.vocab_size)
    checked = check_states_after_every_step(llm, llm.engine.model)
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == expected
    assert all(o.metrics.depth_counts and len(o.metrics.depth_counts) >= 4 for o in outputs)  # 4-token runs
    assert len(checked) > bs
    assert all_slots_free(llm.engine)
    llm.engine.check_kv()


def test_a_bfloat16_target_speculates_losslessly(hybrid):
    """In bfloat16 too a verify node computes its decode step's logits bit for bit (the convolution of each node is
    the decode step's own), so oracle drafts commit exactly the target-only tokens, greedy and seeded."""
    root, hf = hybrid
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_new_tokens=NEW, ignore_eos=True)] * 3
    plain = fastspec.LLM(str(root / "target"), max_total_tokens=4096, dtype="bfloat16")
    expected = [plain.engine.generate([p], [sp])[0].output_ids for p, sp in zip(PROMPTS, params)]
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="NGRAM", num_draft_tokens=8, max_total_tokens=4096,
                       dtype="bfloat16")
    oracle_drafter(llm.engine, PROMPTS[:6], expected, hf.config.vocab_size)
    outputs = llm.engine.generate(PROMPTS[:6], params)
    assert [o.output_ids for o in outputs] == expected
    assert all(len(o.metrics.depth_counts) >= 4 for o in outputs)


@pytest.mark.skipif(not cpu_library.available(), reason="without the C kernels the products are the CPU BLAS's")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_logprobs_are_plain_decodings_bit_for_bit(hybrid, dtype):
    """A verify node computes its token's decode step bit for bit on a hybrid target: the scan runs node by node as
    decode steps do, and the elementwise sigmoid / softplus / SiLU of the gates, the convolution and the gated norms
    are taken over rows padded out of torch's scalar tail (before: logprobs ~5e-7 apart in float32). Oracle drafts,
    so most tokens come from multi-token verifies; plain decoding batched equals it alone too."""
    root, hf = hybrid
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)
    plain = fastspec.LLM(str(root / "target"), dtype=dtype, max_total_tokens=4096).engine
    alone = [plain.generate([p], [params])[0] for p in PROMPTS]
    spec = fastspec.LLM(str(root / "target"), speculative_algorithm="NGRAM", num_draft_tokens=8, dtype=dtype,
                        max_total_tokens=4096).engine
    oracle_drafter(spec, PROMPTS, [o.output_ids for o in alone], hf.config.vocab_size)
    for runs in (spec.generate(PROMPTS, [params] * len(PROMPTS)), plain.generate(PROMPTS, [params] * len(PROMPTS))):
        for one, batched in zip(alone, runs):
            assert batched.output_ids == one.output_ids
            assert [(lp.logprob, lp.top) for lp in batched.logprobs] == [(lp.logprob, lp.top) for lp in one.logprobs]


# (algorithm, draft, num_steps, topk, num_draft_tokens, page_size, batch size, chunked prefill size)
CASES = [
    ("NGRAM", None, None, None, 8, 1, 8, 2048),
    ("EAGLE", "eagle", 3, 2, 6, 16, 6, 2048),
    ("EAGLE", "eagle", 4, 1, 5, 1, 3, 5),
    ("EAGLE3", "eagle3", 3, 4, 8, 1, 8, 2048),
    ("STANDALONE", "llama-draft", 2, 2, 4, 16, 4, 7),
]


@pytest.mark.parametrize("algorithm, draft, steps, topk, n, page_size, bs, chunk", CASES)
def test_greedy_speculative_equals_target_only(hybrid, algorithm, draft, steps, topk, n, page_size, bs, chunk):
    root, _ = hybrid
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm=algorithm,
                       draft_model=str(root / draft) if draft else None, num_steps=steps, topk=topk,
                       num_draft_tokens=n, page_size=page_size, max_total_tokens=4096, chunked_prefill_size=chunk)
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == reference(root, bs)
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    llm.engine.check_kv()


def test_preemption_and_chunked_prefill_recompute_states(hybrid):
    """A pool too small for every request: preempted requests prefill again (in chunks) from zero states."""
    root, hf = hybrid
    expected = reference(root, 8)
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="NGRAM", num_draft_tokens=8, max_total_tokens=96,
                       chunked_prefill_size=6)
    oracle_drafter(llm.engine, PROMPTS, expected, hf.config.vocab_size)
    outputs = llm.engine.generate(PROMPTS, [GREEDY] * 8)
    assert [o.output_ids for o in outputs] == expected
    assert all_slots_free(llm.engine)


def test_compiled_verify_equals_eager(hybrid):
    """Verify with per-node state tracking compiles with fullgraph (padded rows use the dummy state row)."""
    root, hf = hybrid
    expected = reference(root, 3)
    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="NGRAM", num_draft_tokens=8,
                       max_total_tokens=2048, graphs="compile", cuda_graph_bs=(4,))
    oracle_drafter(llm.engine, PROMPTS[:3], expected, hf.config.vocab_size)
    outputs = llm.engine.generate(PROMPTS[:3], [GREEDY] * 3)
    assert [o.output_ids for o in outputs] == expected
    assert all(len(o.metrics.depth_counts) >= 4 for o in outputs)


@pytest.mark.parametrize("options, message", [
    (dict(radix_cache=True, page_size=4, mamba_track_interval=6),
     "^mamba_track_interval=6 is not a multiple of page_size=4$"),
    (dict(speculative_algorithm="STANDALONE", draft_model="SELF", num_steps=2, topk=1, num_draft_tokens=3),
     "STANDALONE with a .*ForCausalLM draft"),
])
def test_unsupported_options_are_one_line_errors(hybrid, options, message):
    root, _ = hybrid
    options = {k: str(root / "target") if v == "SELF" else v for k, v in options.items()}
    with pytest.raises(FastspecError, match=message):
        fastspec.LLM(str(root / "target"), max_total_tokens=512, **options)
