"""Hybrid targets (Qwen3-Next: gated delta nets beside gated attention; Bamba: Mamba2 mixers beside attention)
and speculative decoding over them.

transformers is the oracle for the math (logit parity in prefill and paged decode: test_models.py, which runs
every family; the delta-rule and SSD kernels and per-node tree states: test_hybrid_kernels.py); here: greedy output
against transformers' argmax, and the lossless invariant through the engine. Random drafts are rarely accepted, so an oracle drafter (NGRAM's slot, proposing
the known greedy continuation plus wrong branches) drives multi-token commits and rejected branches, while a
check after every step compares each request's recurrent state with a fresh prefill of its committed tokens.
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


@pytest.fixture(scope="module")
def qwen3_next_with_mtp(tmp_path_factory):
    from tiny_models import write_qwen3_next_mtp

    root = tmp_path_factory.mktemp("qwen3-next-mtp")
    write_qwen3_next_mtp(root)
    return root


@pytest.mark.parametrize("steps, topk, n, page_size, bs", [(None, None, None, 1, 8), (3, 2, 6, 16, 5), (2, 4, 8, 1, 3)])
def test_nextn_drafts_with_the_checkpoints_mtp_layer(qwen3_next_with_mtp, steps, topk, n, page_size, bs):
    """Qwen3-Next's own MTP layer (an attention layer: no recurrent state) drafts; output equals target-only."""
    root = str(qwen3_next_with_mtp)
    plain = fastspec.LLM(root, max_total_tokens=4096).engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    llm = fastspec.LLM(root, speculative_algorithm="NEXTN", num_steps=steps, topk=topk, num_draft_tokens=n,
                       page_size=page_size, max_total_tokens=4096)
    assert type(llm.engine.drafter.model).__name__ == "Qwen3NextMTP"
    outputs = llm.engine.generate(PROMPTS[:bs], [GREEDY] * bs)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    llm.engine.check_kv()


def test_nextn_on_a_checkpoint_without_mtp_is_a_one_line_error(hybrid):
    root, hf = hybrid
    with pytest.raises(FastspecError, match=f"NEXTN drafts with the checkpoint's MTP layer, and this "
                                            f"{type(hf).__name__} checkpoint has none"):
        fastspec.LLM(str(root / "target"), speculative_algorithm="NEXTN", max_total_tokens=512)


def test_tune_replay_and_train_draft_on_a_hybrid_target(hybrid, tmp_path, monkeypatch):
    """tune's replay (one target forward per recorded sequence, fresh recurrent states) predicts the engine's
    rounds exactly; train-draft extracts features from the hybrid target and its head decodes losslessly."""
    from test_train import tiny_config
    from tiny_models import write_chat_target, write_prompt_file

    from fastspec.train.trainer import train_draft
    from fastspec.tune.replay import candidate_params, record, replay_tau

    root, hf = hybrid
    target = str(root / "target")
    plain = fastspec.LLM(target).engine.generate(PROMPTS[:3], [GREEDY] * 3)
    probe = fastspec.LLM(target, speculative_algorithm="EAGLE", draft_model=str(root / "eagle"), num_steps=3, topk=2,
                         num_draft_tokens=5)
    e = probe.engine
    recorded = [record(e.model, e.drafter.model, e.drafter.hot_token_id, e.feature, o.prompt_ids, o.output_ids,
                       candidate_params(3, (1, 2), 5)) for o in plain]
    outs = e.generate(PROMPTS[:3], [GREEDY] * 3)
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]
    rounds, emitted = (sum(getattr(o.metrics, f) for o in outs) for f in ("verify_rounds", "emitted_tokens"))
    assert replay_tau(recorded, e.spec.params) == (rounds, emitted)

    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    chat = write_chat_target(tmp_path / "chat", family=hf.config.model_type)  # the same model, with a tokenizer
    report = train_draft(tiny_config(tmp_path / "head", chat, write_prompt_file(tmp_path / "p.jsonl"), epochs=3))
    assert report["steps"] > 0
    spec = fastspec.LLM(str(chat), speculative_algorithm="EAGLE3", draft_model=str(tmp_path / "head"), num_steps=2,
                        topk=2, num_draft_tokens=4).engine.generate(PROMPTS[:2], [GREEDY] * 2)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain[:2]]



@pytest.mark.parametrize("algorithm, page_size, interval", [("NONE", 1, 8), ("NGRAM", 4, 8), ("EAGLE", 2, 6)])
def test_prefix_cache_resumes_from_saved_states(hybrid, algorithm, page_size, interval):
    """Chat turns with the prefix cache: each turn resumes from the recurrent state saved on its cached prefix
    (every `interval` tokens: in prefill chunks, plain rounds and inside accepted speculative runs) and produces
    exactly what recomputing from scratch produces; no KV slot or state checkpoint leaks."""
    root, hf = hybrid
    turns = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38], [32, 79, 50, 8]]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)

    def chat(llm):
        history, outputs = [], []
        for turn in turns:
            history = history + turn
            out = llm.engine.generate([history], [params])[0].output_ids
            outputs.append(out)
            history = history + out
        return outputs

    expected = chat(fastspec.LLM(str(root / "target"), page_size=page_size, max_total_tokens=2048))
    options = dict(speculative_algorithm=algorithm, num_draft_tokens=8) if algorithm == "NGRAM" else \
        dict(speculative_algorithm=algorithm, draft_model=str(root / "eagle"), num_steps=3, topk=2,
             num_draft_tokens=5) if algorithm == "EAGLE" else {}
    llm = fastspec.LLM(str(root / "target"), page_size=page_size, max_total_tokens=2048, radix_cache=True,
                       mamba_track_interval=interval, **options)
    if algorithm == "NGRAM":  # multi-token runs that cross interval boundaries
        full, seqs = [], []
        for turn, out in zip(turns, expected):
            full = full + turn + out
            seqs.append(full)
        oracle_drafter(llm.engine, [s[:1] for s in seqs], [s[1:] for s in seqs], hf.config.vocab_size)
    assert chat(llm) == expected
    worker = llm.engine.worker
    assert worker.reused_tokens >= len(turns[0]) + len(expected[0]) - interval  # resumed close to each turn's end
    llm.engine.check_kv()
    worker.flush_cache()
    assert sorted(worker.states.free_checkpoints) == list(range(worker.states.ckpt_ssm.shape[1]))


def test_prompt_logprobs_start_on_no_cached_prefix(hybrid):
    """A request asking for prompt logprobs starts on no cached prefix (no saved state resumed): its prompt's
    logprobs are transformers', the second time (the prompt cached) as the first."""
    root, hf = hybrid
    llm = fastspec.LLM(str(root / "target"), max_total_tokens=2048, radix_cache=True, mamba_track_interval=4)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].double(), -1)
    for _ in range(2):
        got = llm.engine.generate([prompt], [SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=0)])[0]
        assert [e.token for e in got.prompt_logprobs] == prompt[1:]
        assert [e.logprob for e in got.prompt_logprobs] == pytest.approx(
            want[range(len(prompt) - 1), prompt[1:]].tolist(), abs=2e-4)


def test_a_kv_pool_sized_from_free_memory_leaves_room_for_the_states(hybrid, monkeypatch):
    """With --kv-mem-fraction the KV pool takes its share of the memory the recurrent states (rows, verify
    tracks, prefix-cache checkpoints) have left: they are built before free memory is read."""
    import fastspec.memory.kv_pool as kv_pool
    from fastspec.memory.state_pool import StatePool

    root, _ = hybrid
    events, real_init = [], StatePool.__init__
    monkeypatch.setattr(StatePool, "__init__", lambda self, *a, **k: events.append("states") or real_init(self, *a, **k))
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device="cpu": events.append("free") or 2**27)
    llm = fastspec.LLM(str(root / "target"), kv_mem_fraction=0.5)
    assert events == ["free", "states", "free"] and llm.engine.pool.capacity > 0  # (first: the weights' check)
