"""`fastspec serve` keeps answering while a request's slow part runs off the event loop: its prompt tokenized,
llguidance's reading of the tokenizer built (once, or refused once), its grammar compiled. A tiny Llama with a
character tokenizer, decoding plainly, served on 127.0.0.1 at a free port by a uvicorn thread."""

import threading
import urllib.request

import openai
import pytest
from serve_helpers import engine_settled, plain_char_llm, start_server

MODEL = "tiny-off-loop"


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    llm = plain_char_llm(tiny_dirs, tmp_path_factory)
    server, thread, service, url, client = start_server(llm, MODEL, max_queued=4)
    yield client, url, llm, service
    server.should_exit = True
    thread.join(10)
    service.stop()


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
