"""A hybrid target's recurrent states beside the KV cache: the prefix cache resumes a turn from the state saved on
its cached prefix (every mamba_track_interval tokens), a request asking for prompt logprobs starts on none, and a
KV pool sized from free memory leaves the states their room. (test_hybrid_checkpoints.py: more states worth keeping
than checkpoints; test_hybrid.py: speculative decoding over hybrid targets, whose fixtures these tests share.)"""

import pytest
import torch
from test_hybrid import hybrid, oracle_drafter  # noqa: F401  (hybrid: a fixture)

import fastspec
from fastspec.sampling import SamplingParams


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
    monkeypatch.setattr(StatePool, "__init__",
                        lambda self, *a, **k: events.append("states") or real_init(self, *a, **k))
    monkeypatch.setattr(kv_pool, "available_bytes", lambda device="cpu": events.append("free") or 2**27)
    llm = fastspec.LLM(str(root / "target"), kv_mem_fraction=0.5)
    assert events == ["free", "states", "free"] and llm.engine.pool.capacity > 0  # (first: the weights' check)
