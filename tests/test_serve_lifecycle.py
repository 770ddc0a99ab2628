"""`fastspec serve` around its requests: the open-request bound a client at the limit meets, what /metrics counts
when the server makes a request of its own (n choices' shared prompt), a long prompt tokenized while other
clients stream, and a shutdown with requests in flight. A tiny Llama with a character tokenizer, decoding plainly,
served on 127.0.0.1 at a free port by a uvicorn thread."""

import logging
import shutil
import threading
import time
import urllib.request

import openai
import pytest
from serve_helpers import engine_settled, scrape, start_server
from tiny_models import write_char_tokenizer

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams
from fastspec.serve.api_error import APIError

MODEL = "tiny-lifecycle"


@pytest.fixture(scope="module")
def tiny_llm(tiny_dirs, tmp_path_factory):
    """The LLM the module's server (`served`) serves."""
    return _tiny_llm(tiny_dirs, tmp_path_factory)


@pytest.fixture
def own_llm(tiny_dirs, tmp_path_factory):
    """An LLM of the test's own, for a server it starts and stops (a served LLM runs nothing else)."""
    return _tiny_llm(tiny_dirs, tmp_path_factory)


def _tiny_llm(tiny_dirs, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lifecycle") / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    return fastspec.LLM(str(model_dir), max_total_tokens=4096, max_running_requests=16, overlap_schedule="off")


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


def test_a_prompt_being_tokenized_does_not_stop_the_server(served, monkeypatch):
    """Tokenizing runs off the event loop: while one request's prompt is being tokenized (held here until
    released), the server answers others."""
    client, url, llm, service = served
    entered, release = threading.Event(), threading.Event()
    encode = llm.encode

    def slow_encode(prompt, chat=False):
        if prompt == "slow":
            entered.set()
            release.wait(30)
        return encode(prompt, chat)
    monkeypatch.setattr(llm, "encode", slow_encode)
    slow = threading.Thread(target=client.completions.create, kwargs=dict(model=MODEL, prompt="slow", max_tokens=2))
    slow.start()
    try:
        assert entered.wait(30)
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert response.status == 200
        got = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, timeout=10)  # (sampled: T = 1)
        assert got.choices[0].finish_reason in ("length", "stop")  # answered (its text may be empty: an EOS)
    finally:
        release.set()
        slow.join(30)
    assert engine_settled(service)


def _first_build(monkeypatch, service, fails: bool):
    """As if no request had needed llguidance's tokenizer yet: a fresh compiler whose build (llguidance's
    LLTokenizer; raising ValueError where it `fails`, as on a tokenizer it cannot read) waits for `release` and
    counts itself in `builds`. (builds, entered, release)."""
    import llguidance

    from fastspec.sampling.grammar import GrammarCompiler

    old, real = service.engine.grammars, llguidance.LLTokenizer
    builds, entered, release = [], threading.Event(), threading.Event()

    def held(*args, **kwargs):
        builds.append(1)
        entered.set()
        release.wait(30)
        if fails:
            raise ValueError("no such tokenizer")
        return real(*args, **kwargs)
    monkeypatch.setattr(llguidance, "LLTokenizer", held)
    monkeypatch.setattr(service.engine.intake, "grammars", GrammarCompiler(old.tokenizer_dir, old.vocab_size,
                                                                          old.eos_ids))
    return builds, entered, release


def _together(served, monkeypatch, entered, release, first: dict, second: dict) -> list:
    """Two first requests together: the first enters the build, the server answers others meanwhile, the second
    arrives while it is held; each one's answer or APIStatusError, in order."""
    from fastspec.serve import app

    client, url, _, _ = served
    got, arrived, parse = [None, None], threading.Event(), app.api.parse_request
    monkeypatch.setattr(app.api, "parse_request", lambda *a: (arrived.set(), parse(*a))[1])

    def ask(i, kwargs):
        try:
            got[i] = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, temperature=0, **kwargs)
        except openai.APIStatusError as e:
            got[i] = e
    threads = [threading.Thread(target=ask, args=(i, kw)) for i, kw in enumerate((first, second))]
    threads[0].start()
    try:
        assert entered.wait(30)
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert response.status == 200
        arrived.clear()
        threads[1].start()
        assert arrived.wait(30)
    finally:
        release.set()
        for t in threads:
            t.join(30)
    return got


LOGPROBS, REGEX = dict(logprobs=1), dict(extra_body={"regex": "[a-z]{2}"})  # (each needs llguidance's tokenizer)


def test_the_grammar_tokenizer_is_built_once_off_the_event_loop(served, monkeypatch):
    """llguidance's reading of the tokenizer (logprobs' token bytes, grammars) is built by the first request that
    needs it, off the event loop (while it is built the server answers others), and once: a second request arriving
    meanwhile waits for that build and is served with it (each could build it)."""
    service = served[3]
    builds, entered, release = _first_build(monkeypatch, service, fails=False)
    got = _together(served, monkeypatch, entered, release, LOGPROBS, REGEX)
    assert len(got[0].choices[0].logprobs.tokens) == got[0].usage.completion_tokens  # (answered, with logprobs)
    assert len(got[1].choices[0].text) == 2 and got[1].choices[0].text.isalpha()  # (held to its regex)
    assert len(builds) == 1
    assert engine_settled(service)


def test_a_grammar_tokenizer_that_cannot_be_built_is_said_to_each_request_and_not_built_again(served, monkeypatch):
    """A tokenizer llguidance cannot read: every grammar is the same one-line 400 and logprobs fall back to the
    tokens' text, for the two first requests together and every later one, from one attempt (each request tried
    again, and a logprobs answer on the event loop once per event)."""
    client, _, _, service = served
    builds, entered, release = _first_build(monkeypatch, service, fails=True)
    got = _together(served, monkeypatch, entered, release, REGEX, LOGPROBS)
    assert got[0].status_code == 400 and "structured output cannot use this tokenizer" in got[0].message
    assert len(got[1].choices[0].logprobs.tokens) == got[1].usage.completion_tokens
    streamed = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=2, stream=True, logprobs=1,
                                              extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices and c.choices[0].logprobs) == 2
    with pytest.raises(openai.BadRequestError, match="structured output cannot use this tokenizer"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=2, **REGEX)
    assert len(builds) == 1
    assert engine_settled(service)


HELD = {"type": "object", "title": "held", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_a_grammar_compiles_off_the_event_loop_and_a_bad_one_is_still_a_400(served, monkeypatch, where):
    """A request's grammar (a response_format's JSON schema compiled with the request; a tool's parameters checked
    first) compiles off the event loop: while one compiles (held here until released) the server answers others.
    A schema that does not compile is still a 400 before anything streams."""
    client, url, llm, service = served
    entered, release = threading.Event(), threading.Event()
    compile_ = service.engine.grammars.compile

    def held(params):
        if '"held"' in (params.json_schema or ""):
            entered.set()
            release.wait(30)
        return compile_(params)
    monkeypatch.setattr(service.engine.grammars, "compile", held)
    messages = [{"role": "user", "content": "abc"}]
    if where == "tools":
        ask = dict(tools=[{"type": "function", "function": {"name": "f", "parameters": HELD}}])
    else:
        ask = dict(response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": HELD}})
    got = []
    slow = threading.Thread(target=lambda: got.append(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, **ask)))
    slow.start()
    try:
        assert entered.wait(30)
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert response.status == 200
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2, timeout=10).choices
    finally:
        release.set()
        slow.join(30)
    assert got and got[0].choices[0].finish_reason in ("length", "stop", "tool_calls")
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    bad_ask = dict(tools=[{"type": "function", "function": {"name": "f", "parameters": bad}}]) if where == "tools" \
        else dict(response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    with pytest.raises(openai.BadRequestError, match="invalid json schema"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True, **bad_ask)
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
    stream.close()
    assert own_llm.generate(["abc"], params)[0].text == served
