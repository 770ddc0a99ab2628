"""A request of several choices through `fastspec serve`: a batch of prompts, `n` choices sharing the prompt's KV,
and `echo` scoring the prompt as lm-evaluation-harness asks."""

import openai
import pytest
from serve_helpers import MODEL, PROMPTS, engine_settled, greedy, served, twin  # noqa: F401  (the fixtures)

from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_a_batch_of_prompts_is_one_request_of_their_choices(served, twin):
    """prompt as a list of strings or of token-id lists (OpenAI's batch): choice p * n + i is prompt p's i-th, what a
    request of that prompt alone gets, streamed or not; usage counts every prompt."""
    client, _, llm, service = served
    texts = ["abc", PROMPTS[1]]
    got = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [greedy(twin, p, 6, chat=False).text for p in texts]
    assert got.usage.prompt_tokens == sum(len(llm.encode(p)) for p in texts)
    sampled = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=3, n=2, extra_body={"ignore_eos": True})
    ids = [[5, 6, 7], [8, 9]]
    alone = [c.text for p in ids for c in client.completions.create(prompt=p, **sampled).choices]
    assert [c.text for c in client.completions.create(prompt=ids, **sampled).choices] == alone
    deltas = {}
    for c in client.completions.create(prompt=ids, stream=True, **sampled):
        for choice in c.choices:
            deltas[choice.index] = deltas.get(choice.index, "") + choice.text
    assert [deltas[i] for i in range(4)] == alone
    for bad, message in (((["abc", ""]), "prompt must be"), ([[5, 6], [7, "x"]], "prompt must be"),
                         ([[5, 6]] * 129, "129 prompts x n 2 = 258 choices: at most 256")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt=bad, max_tokens=3, n=2)
    assert engine_settled(service)


def test_echo_scores_the_prompt_as_lm_eval_asks(served, twin):
    """echo with logprobs (lm-evaluation-harness's loglikelihood requests: token-id prompts in a batch, max_tokens 0
    or 1): each choice's text and logprobs start with its prompt's, the first token's logprob null, the others the
    target's (LLM's prompt_logprobs), then the answer's; max_tokens 0 answers nothing; streamed alike."""
    client, _, llm, service = served
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = twin.generate(prompts, SamplingParams(max_new_tokens=2, logprobs=2, prompt_logprobs=2))
    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == 7
    for choice, ids, w in zip(scored.choices, prompts, want):
        lp = choice.logprobs
        assert choice.text == llm.decode(ids) and choice.finish_reason == "length"
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in w.prompt_logprobs], abs=1e-5)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    answered = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, echo=True, logprobs=2,
                                         temperature=0)
    for choice, ids, w in zip(answered.choices, prompts, want):
        assert choice.text == llm.decode(ids) + w.text
        assert len(choice.logprobs.tokens) == len(ids) + 2
        starts = [len("".join(choice.logprobs.tokens[:i])) for i in range(len(ids) + 2)]  # text_offset: OpenAI's
        assert choice.logprobs.text_offset == starts
        assert choice.logprobs.token_logprobs[-2:] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-5)
    offsets = [o for c in client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2, echo=True,
                                                    logprobs=2, temperature=0, stream=True)
               for o in (c.choices[0].logprobs.text_offset if c.choices[0].logprobs else [])]
    assert offsets == answered.choices[0].logprobs.text_offset  # streamed: each chunk's count on from the text before
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, temperature=0)
    assert text.choices[0].text == "abc" + greedy(twin, "abc", 3, chat=False).text
    streamed = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=0)
    assert engine_settled(service)


def test_n_choices_streamed_or_not_share_the_prompts_kv(served, twin):
    """n = 3: greedy choices all equal generate's; seeded sampled choice i equals one request seeded seed + i, and
    its streamed deltas (by choice index) join to the same text; the choices reuse the prompt's cached KV."""
    client, _, _, service = served
    messages = [{"role": "user", "content": "What is 1+1?"}]
    want = greedy(twin, messages[0]["content"], 8, chat=True)
    reused = service.call(lambda: service.engine.worker.reused_tokens)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in got.choices] == [0, 1, 2] and {c.message.content for c in got.choices} == {want.text}
    assert got.usage.completion_tokens == 3 * len(want.output_ids)
    prompt_tokens = got.usage.prompt_tokens
    assert service.call(lambda: service.engine.worker.reused_tokens) - reused >= 3 * (prompt_tokens - 1)
    sampled = dict(model=MODEL, prompt="abc", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    choices = client.completions.create(n=3, **sampled).choices
    one_by_one = [client.completions.create(**(sampled | {"seed": 11 + i})).choices[0].text for i in range(3)]
    assert [c.text for c in choices] == one_by_one and len(set(one_by_one)) > 1
    deltas = {}
    for c in client.completions.create(n=3, stream=True, **sampled):
        for choice in c.choices:
            deltas[choice.index] = deltas.get(choice.index, "") + choice.text
    assert [deltas[i] for i in range(3)] == one_by_one
    for bad, message in (({"n": 0}, "n must be in"), ({"n": 17}, "n must be in"), ({"best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt="abc", max_tokens=3, extra_body=bad)
    assert engine_settled(service)
