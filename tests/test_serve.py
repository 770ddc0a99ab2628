"""`fastspec serve` through the official `openai` client (the server: tests/serve_helpers.py). Greedy answers over
HTTP equal `LLM.generate` for the same prompts; streams, stop strings, max tokens, logprobs and grammars ride
through; 32 concurrent streams finish right and hand every KV slot back; a client that disconnects mid-stream frees
its request. All with overlap off and on."""

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_helpers import MODEL, PROMPTS, engine_settled, greedy, served, twin  # noqa: F401  (the fixtures)

from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_chat_and_completion_equal_generate_streamed_or_not(served, twin):
    client, _, llm, service = served
    for prompt in PROMPTS[:4]:
        want = greedy(twin, prompt, 12, chat=True)
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=12, temperature=0)
        assert got.choices[0].message.content == want.text
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert got.usage.completion_tokens == len(want.output_ids)
        assert got.usage.prompt_tokens == len(llm.encode(prompt, chat=True))
        assert got.model_extra["meta_info"]["spec_verify_ct"] >= 1  # the speculative figures ride along
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=12, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == len(want.output_ids)
        plain = greedy(twin, prompt, 9, chat=False)
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
        assert done.choices[0].text == plain.text and done.choices[0].finish_reason == "length"
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == plain.text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0)
    assert ids.choices[0].text == twin.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5))[0].text
    assert engine_settled(service)


def test_stop_strings_and_max_tokens_end_where_generate_ends(served, twin):
    client, _, llm, service = served
    full = greedy(twin, "abc", 20, chat=False)
    stop = full.text[4:6]  # a string the greedy answer contains
    want = greedy(twin, "abc", 20, chat=False, stop=(stop,))
    assert want.finish_reason == "stop" and stop not in want.text
    got = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == generated_through(llm, full.output_ids, stop)
    chunks = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    others = [s for s in (f"<{i}>" for i in range(20)) if s not in full.text][:7]  # (more than OpenAI's 4: as vLLM
    many = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=[*others, stop])
    assert many.choices[0].text == want.text  # and SGLang take them, and lm-eval's tasks send them; it was a 400)
    one = client.completions.create(model=MODEL, prompt="abc", max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    assert engine_settled(service)


def generated_through(llm, output_ids: list[int], stop: str) -> int:
    """The output tokens plain decoding generates until `stop` appears: through the one that completes it."""
    return next(n for n in range(1, len(output_ids) + 1) if stop in llm.decode(output_ids[:n]))


@pytest.mark.parametrize("mid", [False, True], ids=["first-token", "mid-answer"])
def test_usage_counts_a_stop_strings_tokens_and_logprobs_cover_the_text_shown(served, twin, mid):
    """The tokens of a stop string were generated (the client's max_tokens paid for them): usage counts them, as
    OpenAI and vLLM do, though their text is trimmed; logprobs come with text, so they cover the tokens shown
    (LLM.generate's Completion.output_ids). A stop on the first token: no text, one token counted, no logprobs."""
    client, _, llm, service = served
    no_special = {0: -100.0, 1: -100.0, 2: -100.0}  # (every token a character: a stop string of `size` tokens)
    for chat in (False, True):
        full = greedy(twin, "abc", 12, chat=chat, ignore_eos=True, logit_bias=no_special)
        ids = full.output_ids  # mid-answer: the first token unlike the first, and the next, end it
        at, size = (next(i for i, t in enumerate(ids) if t != ids[0]), 2) if mid else (0, 1)
        stop = llm.decode(ids[at:at + size])
        want = greedy(twin, "abc", 12, chat=chat, ignore_eos=True, logit_bias=no_special, stop=(stop,), logprobs=1)
        generated = generated_through(llm, ids, stop)
        assert (len(want.output_ids), generated, want.finish_reason) == (at, at + size, "stop")
        asked = dict(messages=[{"role": "user", "content": "abc"}], logprobs=True) if chat else dict(prompt="abc",
                                                                                                   logprobs=1)
        ask = asked | dict(model=MODEL, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True},
                           logit_bias={"0": -100, "1": -100, "2": -100})
        create = client.chat.completions.create if chat else client.completions.create
        got = create(**ask)
        text = got.choices[0].message.content if chat else got.choices[0].text
        assert (text, got.usage.completion_tokens) == (want.text, generated)
        entries = got.choices[0].logprobs.content or [] if chat else got.choices[0].logprobs.token_logprobs
        logprobs = [e.logprob for e in entries] if chat else entries
        assert logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
        text, shown, usage = "", 0, None
        for c in create(**ask, stream=True, stream_options={"include_usage": True}):
            usage = c.usage.completion_tokens if c.usage else usage
            for choice in c.choices:
                lp = choice.logprobs
                text += (choice.delta.content or "") if chat else choice.text
                shown += len((lp.content or []) if chat else lp.tokens) if lp else 0
        assert (text, shown, usage) == (want.text, len(want.output_ids), generated)
    assert engine_settled(service)


def test_a_stop_string_in_the_last_token_allowed_finishes_with_stop(served):
    """A stop string the max_tokens-th token completes: the text cut at it and finish_reason stop, as vLLM says."""
    client = served[0]
    ask = dict(model=MODEL, prompt="abc", max_tokens=8, temperature=0,
               logit_bias={"0": -100, "1": -100, "2": -100}, extra_body={"ignore_eos": True})
    text = client.completions.create(**ask).choices[0].text
    stop = next(text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k)
    got = client.completions.create(**ask, stop=[stop]).choices[0]
    assert (got.text, got.finish_reason) == (text[: -len(stop)], "stop")
    chunks = list(client.completions.create(**ask, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[: -len(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_logprobs_and_grammar_through_the_api(served, twin):
    client, _, _, _ = served
    want = greedy(twin, "What?", 6, chat=True, logprobs=2)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What?"}], max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    entries = got.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx([t.logprob for t in want.logprobs])
    assert all(len(e.top_logprobs) == 2 for e in entries)
    regex = client.completions.create(model=MODEL, prompt="Q", max_tokens=8, temperature=0,
                                      extra_body={"regex": "[a-d]{3}"})
    assert regex.choices[0].text == greedy(twin, "Q", 8, chat=False, regex="[a-d]{3}").text
    assert len(regex.choices[0].text) == 3 and set(regex.choices[0].text) <= set("abcd")


def test_32_concurrent_streams_complete_and_free_every_slot(served, twin):
    client, _, _, service = served
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    want = [greedy(twin, p, n, chat=True).text for p, n in zip(prompts, lengths)]

    def one(i):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=lengths[i], temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == want
    assert engine_settled(service)


def test_other_threads_calls_run_with_no_round_in_flight_and_change_no_token(served, twin):
    """While requests run, another thread's prefix-cache flushes and calls (Engine.call, EngineService.call) are run
    by the engine thread at a safe point: every step handed out and no round in flight (under overlap they ran
    during the poll, a round launched ahead still pending); the greedy answers are those of a run without them, and
    nothing raises."""
    client, _, llm, service = served
    engine = llm.engine
    assert engine_settled(service)
    lengths = [16 + 3 * i for i in range(6)]
    want = [greedy(twin, p, n, chat=False, ignore_eos=True).text for p, n in zip(PROMPTS, lengths)]
    probes, done = [], threading.Event()

    def probe() -> tuple[bool, bool]:  # on the engine thread: (no round in flight, requests running)
        return engine.worker.overlap.pending is None, engine.load.running > 0

    def flush_and_probe() -> None:
        while not done.is_set():
            engine.flush_cache()
            probes.append(service.call(probe))

    def one(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(7) as pool:
        flusher = pool.submit(flush_and_probe)
        got = list(pool.map(one, range(6)))
        done.set()
        flusher.result()
    assert got == want
    assert probes and all(idle for idle, _ in probes), probes
    assert any(running for _, running in probes)
    assert engine_settled(service)


def test_a_client_that_disconnects_mid_stream_frees_its_request(served):
    _, url, _, service = served
    aborted = service.aborted
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")  # it is running
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert engine_settled(service) and service.aborted == aborted + 1  # aborted, not run to its 240 tokens


def test_a_plain_request_asks_after_its_client_while_tokens_keep_coming():
    """A non-streamed request's wait checks the connection every DISCONNECT_POLL_S even when an event is always
    ready (an engine step hands one out every few milliseconds): a client gone is noticed and its request aborted,
    not run to max_tokens for nobody."""
    import asyncio

    from fastspec.serve import reply as reply_module
    from fastspec.serve import protocol
    from fastspec.serve.service import Event
    from fastspec.utils.metrics import SpecMetrics

    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    async def wait() -> object:
        events = asyncio.Queue()
        for _ in range(100):
            events.put_nowait((0, Event("x", None, None, 1, SpecMetrics())))
        parsed = protocol.parse_request({"model": MODEL, "prompt": "abc"}, False, MODEL)
        reply = reply_module.Reply(None, parsed, MODEL, "cmpl-1", 3, [0], events)
        got = [await reply._next_or_disconnect(Gone())]  # asked a moment ago: the ready event
        reply.checked -= 2 * reply_module.DISCONNECT_POLL_S  # a poll interval later
        return got + [await reply._next_or_disconnect(Gone())]
    first, second = asyncio.run(wait())
    assert first[1].text == "x" and second is None
