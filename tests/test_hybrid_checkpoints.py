"""A hybrid target's recurrent-state checkpoints under the prefix cache when more states are worth keeping than
there are checkpoints (8 per running request): the least recently used go back to the pool, so the latest prompts
and each turn of a long chat resume from their own saved states; outputs equal the outputs without the cache, and
no checkpoint or KV slot leaks. (tests/test_hybrid_states.py covers saving and resuming itself.)"""

import random

import pytest
from conftest import make_hf_model

import fastspec
from fastspec.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next", "bamba"])
def target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("options", [{}, dict(speculative_algorithm="NGRAM", num_draft_tokens=6)])
def test_the_latest_prompts_keep_the_saved_states(target, options):
    """Interval 4, one running request: 8 checkpoints, all saved by the first 40-token prompt. Found by a QA pass:
    the tree let a state go only with its KV, so every later prompt saved none and its repeat reused nothing (the
    first prompt's repeat reused 32 tokens); each turn of a chat past 32 tokens recomputed all past the 32nd."""
    on = fastspec.LLM(target, max_total_tokens=4096, radix_cache=True, mamba_track_interval=4,
                      max_running_requests=1, **options)
    off = fastspec.LLM(target, max_total_tokens=4096)  # float32 on the CPU: resuming changes no token

    def run(prompt) -> tuple[list[int], int]:
        """`prompt`'s output with the cache (the same as without) and the prompt tokens it reused."""
        before = on.engine.worker.reused_tokens
        out = on.engine.generate([prompt], [PARAMS])[0].output_ids
        assert out == off.engine.generate([prompt], [PARAMS])[0].output_ids
        return out, on.engine.worker.reused_tokens - before

    g = random.Random(1)
    prompts = [[g.randrange(3, 97) for _ in range(40)] for _ in range(5)]
    for prompt in prompts:
        assert run(prompt)[1] == 0
    assert run(prompts[-1] + [5, 6])[1] == 32  # the last prompt's state after 32 tokens (8 x 4)

    history = [g.randrange(3, 97) for _ in range(10)]
    answer = run(history)[0]
    for turn in range(6):  # 52 tokens by the end: the turns need more states than there are checkpoints
        done = history + answer  # its KV cached up to its last token, a state saved at each multiple of 4
        history = done + [7, 8, 9]
        answer, reused = run(history)
        assert reused >= len(done) - 4
    on.engine.check_kv()  # the tree's checkpoints + the free ones are every checkpoint, each once
    on.engine.flush_cache()
    states = on.engine.worker.states
    assert sorted(states.free_checkpoints) == list(range(states.ckpt_ssm.shape[1])) == list(range(8))
    assert on.engine.allocator.num_free() == on.engine.pool.capacity
