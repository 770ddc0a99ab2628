"""`fastspec serve` around its requests: the open-request bound a client at the limit meets, what /metrics counts
when the server makes a request of its own (n choices' shared prompt), a shutdown with requests in flight, and a
served LLM refusing direct calls. A tiny Llama with a character tokenizer, decoding plainly, served on 127.0.0.1 at
a free port by a uvicorn thread."""

import logging
import threading
import time

import openai
import pytest
from serve_helpers import engine_settled, plain_char_llm, scrape, start_server

from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams
from fastspec.serve.api_error import APIError

MODEL = "tiny-lifecycle"


@pytest.fixture(scope="module")
def tiny_llm(tiny_dirs, tmp_path_factory):
    """The LLM the module's server (`served`) serves."""
    return plain_char_llm(tiny_dirs, tmp_path_factory)


@pytest.fixture
def own_llm(tiny_dirs, tmp_path_factory):
    """An LLM of the test's own, for a server it starts and stops (a served LLM runs nothing else)."""
    return plain_char_llm(tiny_dirs, tmp_path_factory)


def start(llm, max_queued: int):
    return start_server(llm, MODEL, max_queued)


@pytest.fixture(scope="module")
def served(tiny_llm):
    server, thread, service, url, client = start(tiny_llm, max_queued=4)
    yield client, url, tiny_llm, service
    server.should_exit = True
    thread.join(10)
    service.stop()


def test_a_finished_request_gives_its_place_back_before_its_client_hears(served):
    """A client at --max-queued-requests that sends its next request as soon as the last one ends is not told the
    server is overloaded: the finished request's place is free when its final event is delivered."""
    _, _, llm, service = served
    assert engine_settled(service)
    finals, done = [], threading.Event()

    def deliver(event) -> None:
        if event.finish_reason is not None:
            finals.append(service.open_requests)
            done.set()
    service.submit(llm.encode("abc"), SamplingParams(max_new_tokens=3), deliver)
    assert done.wait(30) and finals == [0]


def test_n_choices_past_the_bound_are_a_400_and_metrics_count_only_the_clients_choices(served):
    """n choices over one prompt run after a one-token request of the server's own that caches the prompt: /metrics
    counts the n choices a client asked for, not that one. More choices than --max-queued-requests can ever hold
    are a 400 (not a 503 telling the client to retry what can never run)."""
    client, url, _, service = served
    assert engine_settled(service)
    label = (("model_name", MODEL),)
    before = scrape(url)
    got = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert engine_settled(service)
    after = scrape(url)

    def moved(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert len(got.choices) == 4 and got.usage.completion_tokens == 20
    assert moved("fastspec:num_requests_total", (("finish_reason", "length"), *label)) == 4
    assert moved("fastspec:generation_tokens_total") == got.usage.completion_tokens
    assert moved("fastspec:prompt_tokens_total") == 4 * got.usage.prompt_tokens
    assert moved("fastspec:time_to_first_token_seconds_count") == 4
    with pytest.raises(openai.BadRequestError, match="max-queued-requests 4"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=5)
    with pytest.raises(openai.BadRequestError, match="max-queued-requests 4"):
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=5, n=2)
    assert engine_settled(service)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def test_shutdown_ends_requests_in_flight_with_503s_and_no_cancelled_tasks(own_llm):
    """Stopping the server (Ctrl-C, SIGTERM) with a stream and a plain request running: both end at once with
    OpenAI's error object, a 503 saying the server is shutting down (the stream: an error event, then [DONE]);
    uvicorn's graceful wait has no task left to cancel, so it logs no error and no traceback. The engine is held
    between two steps while the stop is asked for, so both are surely in flight."""
    server, thread, service, url, client = start(own_llm, max_queued=8)
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    long = dict(model=MODEL, prompt="abc", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    plain = {}

    def ask() -> None:
        try:
            client.completions.create(**long)
        except openai.APIStatusError as e:
            plain["error"] = e
    asker = threading.Thread(target=ask)
    gate, held = threading.Event(), threading.Event()
    try:
        stream = client.completions.create(stream=True, **long).response.iter_lines()
        assert next(line for line in stream if line).startswith("data: {")
        asker.start()
        while service.open_requests < 2:
            time.sleep(0.01)
        threading.Thread(target=service.call, args=(lambda: held.set() or gate.wait(30),)).start()
        assert held.wait(30)  # the engine waits between two steps, both requests open
        server.should_exit = True
        deadline = time.monotonic() + 10
        while service._inbox.qsize() == 0 and time.monotonic() < deadline:  # the shutdown asked the engine to stop
            time.sleep(0.01)
        gate.set()
        events = [line for line in stream if line]
        asker.join(30)
        thread.join(30)
    finally:
        gate.set()
        logging.getLogger("uvicorn.error").removeHandler(records)
        server.should_exit = True
        service.stop()
    assert events[-1] == "data: [DONE]" and "the server is shutting down" in events[-2]
    assert plain["error"].status_code == 503 and "the server is shutting down" in plain["error"].message
    assert not thread.is_alive() and records.messages == []
    with pytest.raises(APIError, match="shutting down"):
        service.submit([5, 6], SamplingParams(max_new_tokens=2), lambda event: None)


def test_a_body_nested_past_what_json_reads_is_a_400_and_the_server_keeps_serving(served):
    """JSON nested deeper than Python's json reads (it raises RecursionError, no JSONDecodeError) is the client's
    bad body: OpenAI's 400, not a 500 "internal error"."""
    from serve_helpers import raw

    client, url, _, service = served
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, body = raw(url, "POST", path, b'{"model": "%s", "prompt": %s}' % (MODEL.encode(), deep))
            assert status == 400 and body["error"]["type"] == "invalid_request_error", body
            assert "nested too deeply" in body["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2).choices[0].text is not None
    assert engine_settled(service)


def test_a_served_llm_refuses_direct_calls_until_its_server_stops(own_llm):
    """While a server drives an LLM, a direct generate, stream or chat would step its engine from a second loop: each
    is a one-line FastspecError telling the caller to send requests to the server, and the server keeps serving.
    Once the server stops the LLM runs directly again, with the answer it served; a server cannot start on an LLM
    whose stream is open (it would share the engine with that stream)."""
    params = SamplingParams(max_new_tokens=4)
    server, thread, service, url, client = start(own_llm, max_queued=4)
    try:
        served = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0).choices[0].text
        for call in (lambda: own_llm.generate(["abc"], params), lambda: next(own_llm.stream(["abc"], params)),
                     lambda: own_llm.chat([{"role": "user", "content": "abc"}], params),
                     lambda: own_llm.engine.generate([[5, 6]], [params])):
            with pytest.raises(FastspecError, match="^this LLM is being served: send requests to the server") as e:
                call()
            assert "\n" not in str(e.value)
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0).choices[0].text \
            == served
        assert engine_settled(service)
    finally:
        server.should_exit = True
        thread.join(10)
        service.stop()
    assert own_llm.generate(["abc"], params)[0].text == served
    stream = own_llm.stream(["abc"], params)
    next(stream)
    with pytest.raises(FastspecError, match="already running a generate or stream"):
        start(own_llm, max_queued=4)
    with pytest.raises(FastspecError, match="^this LLM is running a generate or stream: its speculation policy may "
                                            "change only between runs"):
        own_llm.engine.policy = None
    stream.close()
    own_llm.engine.policy = None  # (between runs: taken)
    assert own_llm.generate(["abc"], params)[0].text == served


def test_a_served_engines_other_calls_run_on_its_thread_or_are_refused(served, monkeypatch):
    """While a server drives an LLM, its engine's other calls never touch it from a second thread: a prefix-cache
    flush or a leak check (check_kv: it read the allocator from the caller's thread) from another thread is run by
    the server's engine thread between two steps (the flush empties the cache); a
    change of speculation policy or tree shapes (a run plans its KV with those it started with) and an abort (the
    server's requests are its own) are one-line FastspecErrors; the server keeps serving."""
    client, _, llm, service = served
    engine = llm.engine
    assert engine_settled(service)
    client.completions.create(model=MODEL, prompt="abcdef", max_tokens=4, temperature=0)
    while service.open_requests:
        time.sleep(0.01)
    assert service.call(engine.allocator.num_free) < engine.pool.capacity  # the prompt's KV is in the prefix cache
    threads, flush = [], engine.worker.flush_cache
    monkeypatch.setattr(engine.worker, "flush_cache", lambda: (threads.append(threading.current_thread().name),
                                                               flush()))
    check_kv = engine.worker.check_kv
    monkeypatch.setattr(engine.worker, "check_kv", lambda running: (threads.append(threading.current_thread().name),
                                                                    check_kv(running)))
    engine.flush_cache()
    engine.check_kv()
    assert threads == ["fastspec-engine", "fastspec-engine"]
    assert service.call(engine.allocator.num_free) == engine.pool.capacity
    between = "may change only between runs"
    for call, what in ((lambda: setattr(engine, "policy", None), f"its speculation policy {between}"),
                       (lambda: engine.use_schedule(((1 << 30, None),)), f"its tree shapes {between}"),
                       (lambda: llm.abort(0), "its requests end when their clients go away"),
                       (lambda: engine.abort(0), "its requests end when their clients go away")):
        with pytest.raises(FastspecError, match=f"^this LLM is being served: {what}") as e:
            call()
        assert "\n" not in str(e.value)
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2).choices
    assert engine_settled(service)
