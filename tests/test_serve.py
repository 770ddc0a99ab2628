"""`fastspec serve` through the official `openai` client: a tiny Llama with a character tokenizer and a random
EAGLE-3 head, served on 127.0.0.1 at a free port by a uvicorn thread. Greedy answers over HTTP equal
`LLM.generate` for the same prompts; streams, stop strings, max tokens, logprobs and grammars ride through;
32 concurrent streams finish right and hand every KV slot back; a client that disconnects mid-stream frees its
request; bad requests get OpenAI's error object and the server keeps serving. All with overlap off and on."""

import http.client
import json
import shutil
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from conftest import all_slots_free
from tiny_models import write_char_tokenizer
from typer.testing import CliRunner

import fastspec
from fastspec.cli import app
from fastspec.sampling import SamplingParams
from fastspec.serve import bind, make_server

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

MODEL = "tiny-served"
PROMPTS = ["Hello!", "abc", "[x]{y}", "What?", "1+1=2", "zz", "~!~", "Q"]


def start_server(llm, model_name: str, max_queued: int):
    """(uvicorn server, its thread, EngineService, base URL, openai client) serving `llm` on a free local port."""
    sock = bind("127.0.0.1", 0)
    server, service = make_server(llm, model_name, max_queued=max_queued)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    return server, thread, service, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                        timeout=60)


@pytest.fixture(scope="module", params=["off", "on"], ids=["serial", "overlap"])
def served(tiny_dirs, draft_dirs, tmp_path_factory, request):
    model_dir = tmp_path_factory.mktemp("served") / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    llm = fastspec.LLM(str(model_dir), speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"]),
                       num_steps=3, topk=2, num_draft_tokens=4, max_total_tokens=4096, max_running_requests=16,
                       overlap_schedule=request.param)
    server, thread, service, url, client = start_server(llm, MODEL, max_queued=64)
    yield client, url, llm, service
    server.should_exit = True
    thread.join(10)
    service.stop()


def raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """A plain HTTP request (what a non-OpenAI client may send): (status, JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body, {"content-type": "application/json"} if body is not None else {})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read() or b"null")
    conn.close()
    return status, data


def engine_settled(service, timeout: float = 10.0) -> bool:
    """No open request, then every slot free after a cache flush (checked by the engine thread itself)."""
    deadline = time.monotonic() + timeout
    while service.open_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    service.call(lambda: None)  # one more step boundary: aborts seen after the last hand-out are applied
    return service.open_requests == 0 and service.call(lambda: all_slots_free(service.engine))


def greedy(llm, prompt: str, n: int, chat: bool, **extra):
    return llm.generate([prompt], SamplingParams(max_new_tokens=n, **extra), chat=chat)[0]


def test_chat_and_completion_equal_generate_streamed_or_not(served):
    client, _, llm, service = served
    for prompt in PROMPTS[:4]:
        want = greedy(llm, prompt, 12, chat=True)
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
        plain = greedy(llm, prompt, 9, chat=False)
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
        assert done.choices[0].text == plain.text and done.choices[0].finish_reason == "length"
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == plain.text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0)
    assert ids.choices[0].text == llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5))[0].text
    assert engine_settled(service)


def test_stop_strings_and_max_tokens_end_where_generate_ends(served):
    client, _, llm, service = served
    full = greedy(llm, "abc", 20, chat=False)
    stop = full.text[4:6]  # a string the greedy answer contains
    want = greedy(llm, "abc", 20, chat=False, stop=(stop,))
    assert want.finish_reason == "stop" and stop not in want.text
    got = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == len(want.output_ids)
    chunks = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    one = client.completions.create(model=MODEL, prompt="abc", max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
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


def test_logprobs_and_grammar_through_the_api(served):
    client, _, llm, _ = served
    want = greedy(llm, "What?", 6, chat=True, logprobs=2)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What?"}], max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    entries = got.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx([t.logprob for t in want.logprobs])
    assert all(len(e.top_logprobs) == 2 for e in entries)
    regex = client.completions.create(model=MODEL, prompt="Q", max_tokens=8, temperature=0,
                                      extra_body={"regex": "[a-d]{3}"})
    assert regex.choices[0].text == greedy(llm, "Q", 8, chat=False, regex="[a-d]{3}").text
    assert len(regex.choices[0].text) == 3 and set(regex.choices[0].text) <= set("abcd")


def test_32_concurrent_streams_complete_and_free_every_slot(served):
    client, _, llm, service = served
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    want = [greedy(llm, p, n, chat=True).text for p, n in zip(prompts, lengths)]

    def one(i):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=lengths[i], temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == want
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


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    client, url, _, service = served
    message = [{"role": "user", "content": "abc"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=message)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=message, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.chat.completions.create(model=MODEL, messages=message, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="abc", temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=2, logit_bias={"5": 101})
    with pytest.raises(openai.BadRequestError, match="one grammar per request: response_format and regex"):
        client.chat.completions.create(model=MODEL, messages=message, response_format={"type": "json_object"},
                                       extra_body={"regex": "a+"})
    for past_int64 in ({"seed": 2**64}, {"seed": -2**63 - 1}, {"top_k": 2**63}):  # (each once a 500 whose slot
        with pytest.raises(openai.BadRequestError, match="seed|top-k"):  # leaked, or an engine stopped for all)
            client.completions.create(model=MODEL, prompt="abc", max_tokens=2, extra_body=past_int64)
    status, body = raw(url, "POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 2}')  # no model: the
    assert status == 200 and body["model"] == MODEL  # served one, as SGLang and vLLM take it
    status, bad = raw(url, "POST", "/v1/completions", b"{not json")
    assert status == 400 and bad["error"]["type"] == "invalid_request_error"
    assert raw(url, "GET", "/v1/nowhere")[0] == 404
    assert raw(url, "GET", "/health")[1]["status"] == "ok"
    assert raw(url, "GET", "/v1/models")[1]["data"][0]["id"] == MODEL
    assert client.models.list().data[0].id == MODEL
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0).choices[0].text
    assert engine_settled(service)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(chat):
    """OpenAI answers a field of the wrong type with a 400 whose param names it: a model that is no string is not an
    unknown model (404), and fields fastspec does not use (user, stream_options' keys) are checked all the same;
    stream_options without stream true is a 400, as OpenAI's. What the openai client sends for these fields is
    taken."""
    from fastspec.serve import protocol
    from fastspec.serve.api_error import APIError

    base = {"model": MODEL} | ({"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"})
    bad = [("model", None), ("model", 5), ("model", ["x"]), ("user", 5), ("user", {}), ("top_p", 5), ("temperature",
           "1"), ("stream_options", {"include_usage": "x"}), ("stream_options", {"include_usage": 1}),
           ("stream_options", {"include_obfuscation": "no"}), ("stream_options", {"usage": True}),
           ("logit_bias", {"5": "1"}), ("logit_bias", {"5": True}), ("max_tokens", "8")]
    bad += [("max_completion_tokens", 2.5), ("parallel_tool_calls", "yes")] if chat else [("echo", "yes")]
    for field, value in bad:
        with pytest.raises(APIError) as e:
            protocol.parse_request(base | {"stream": field == "stream_options", field: value}, chat, MODEL)
        assert (e.value.status, e.value.param) == (400, field), (field, value, str(e.value))
    for stream in (False, None):  # (OpenAI's rule: stream_options only with stream true; null is no options)
        with pytest.raises(APIError, match="stream_options is only allowed when stream is true") as e:
            protocol.parse_request(base | {"stream": stream, "stream_options": {"include_usage": True}}, chat, MODEL)
        assert (e.value.status, e.value.param) == (400, "stream_options")
    assert not protocol.parse_request(base | {"stream_options": None}, chat, MODEL).include_usage
    with pytest.raises(APIError) as e:
        protocol.parse_request(base | {"model": "gpt-9"}, chat, MODEL)
    assert e.value.status == 404
    good = {"user": "u-1", "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
            "logit_bias": {"5": -100, "6": 2.5}, "max_tokens": 8, "seed": None, "top_p": None}
    parsed = protocol.parse_request(base | good | ({"parallel_tool_calls": False} if chat else {}), chat, MODEL)
    assert parsed.include_usage and parsed.params.max_new_tokens == 8
    assert dict(parsed.params.logit_bias) == {5: -100, 6: 2.5}


def test_overload_is_a_503_not_a_crash(served):
    client, _, _, service = served
    service.max_queued = 1
    try:
        long = client.completions.create(model=MODEL, prompt="abc", max_tokens=240, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))
        with pytest.raises(openai.InternalServerError, match="overloaded"):
            client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
        long.close()
    finally:
        service.max_queued = 64
    assert engine_settled(service)
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3).choices[0].text is not None


def test_cli_port_in_use_and_model_errors_are_one_line_before_listening(tiny_dirs, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["llama"][0]), "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    taken.close()
    missing = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "missing"), "--port", "0"])
    assert missing.exit_code == 2 and missing.stderr.startswith("error:")
    assert len(missing.stderr.strip().splitlines()) == 1
    parser = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["llama"][0]), "--tool-call-parser", "xml"])
    assert parser.exit_code == 2 and len(parser.stderr.strip().splitlines()) == 1
    assert "--tool-call-parser must be one of hermes, llama3, mistral, pythonic, deepseek_v3, got 'xml'" in parser.stderr


def test_bench_url_measures_a_running_server(served):
    from fastspec.benchmark.serving import run_serving

    _, url, _, service = served
    summary = run_serving(url, PROMPTS, max_tokens=6, request_rate=50.0, max_concurrency=4)
    assert summary["model"] == MODEL and summary["completed"] == len(PROMPTS) and summary["failed"] == 0
    assert summary["output_tok_s"] > 0 and 0 < summary["ttft_ms"]["median"] <= summary["e2e_latency_ms"]["p99"]
    assert summary["itl_ms"]["p99"] >= summary["itl_ms"]["median"] > 0
    out = CliRunner().invoke(app, ["bench", "--url", url, "--num-prompts", "5", "--max-new-tokens", "4", "--json"])
    assert out.exit_code == 0, out.stderr
    cli = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))  # (JSON.parse's rule)
    assert cli["completed"] == 5 and cli["request_rate"] is None and cli["max_concurrency"] == 16  # all at once
    down = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert down.exit_code == 2 and "cannot reach a server" in down.stderr
    assert engine_settled(service)


def test_bench_url_keeps_a_path_prefix_as_vllms_bench_does():
    """A server behind a reverse proxy at a path prefix: `--url http://h:p/llm` sends /llm/v1/..., as vLLM's and
    SGLang's bench clients do with a base URL (an OpenAI client's base_url, ending in /v1, is the same server);
    a URL that is no base URL is one line. A stand-in server that answers only under the prefix."""
    import http.server

    from fastspec.benchmark.serving import run_serving

    class Prefixed(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/llm/v1/models"
            self._send(200 if found else 404, b'{"data": [{"id": "proxied"}]}' if found else b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            if self.path != "/llm/v1/chat/completions":
                return self._send(404, b"{}")
            chunks = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                      {"choices": [], "usage": {"completion_tokens": 2}}]
            events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
            self._send(200, b"".join(events))

        def _send(self, status, body):
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Prefixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = "http://127.0.0.1:%d" % server.server_address[1]
    try:
        for url in (base + "/llm", base + "/llm/", base + "/llm/v1"):
            summary = run_serving(url, ["x", "y"], max_tokens=2, request_rate=float("inf"), max_concurrency=2)
            assert summary["model"] == "proxied" and summary["completed"] == 2 and summary["failed"] == 0, url
        for bad in (base + "/llm?x=1", "http://127.0.0.1:port/llm", "https:/llm"):
            out = CliRunner().invoke(app, ["bench", "--url", bad, "--num-prompts", "1"])
            assert out.exit_code == 2 and "--url must look like http://HOST:PORT[/PREFIX]" in out.stderr, bad
        wrong = CliRunner().invoke(app, ["bench", "--url", base + "/other", "--num-prompts", "1"])
        assert wrong.exit_code == 2 and "answered /other/v1/models with status 404" in wrong.stderr
    finally:
        server.shutdown()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed by prometheus_client's own text parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move_by_what_a_request_did(served):
    client, url, _, service = served
    assert engine_settled(service)
    label = (("model_name", MODEL),)
    before = scrape(url)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                         max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert engine_settled(service)
    after = scrape(url)

    def moved(name, labels=label):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    meta = got.model_extra["meta_info"]
    assert moved("fastspec:prompt_tokens_total") == got.usage.prompt_tokens
    assert moved("fastspec:generation_tokens_total") == got.usage.completion_tokens == 6
    assert moved("fastspec:num_requests_total", (("finish_reason", "length"), *label)) == 1
    assert moved("fastspec:spec_verify_rounds_total") == meta["spec_verify_ct"] >= 1
    assert moved("fastspec:spec_accepted_tokens_total") == meta["spec_accepted_tokens"]
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"fastspec:{histogram}_count") == 1 and moved(f"fastspec:{histogram}_sum") > 0
    assert after[("fastspec:num_running_reqs", label)] == after[("fastspec:num_queue_reqs", label)] == 0
    assert 0 <= after[("fastspec:token_usage", label)] < 1 and 0 <= after[("fastspec:cache_hit_rate", label)] <= 1
    rounds, accepted = after[("fastspec:spec_verify_rounds_total", label)], after[
        ("fastspec:spec_accepted_tokens_total", label)]
    assert after[("fastspec:spec_accept_length", label)] == pytest.approx((accepted + rounds) / rounds)


def test_a_batch_of_prompts_is_one_request_of_their_choices(served):
    """prompt as a list of strings or of token-id lists (OpenAI's batch): choice p * n + i is prompt p's i-th, what a
    request of that prompt alone gets, streamed or not; usage counts every prompt."""
    client, _, llm, service = served
    texts = ["abc", PROMPTS[1]]
    got = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [greedy(llm, p, 6, chat=False).text for p in texts]
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


def test_echo_scores_the_prompt_as_lm_eval_asks(served):
    """echo with logprobs (lm-evaluation-harness's loglikelihood requests: token-id prompts in a batch, max_tokens 0
    or 1): each choice's text and logprobs start with its prompt's, the first token's logprob null, the others the
    target's (LLM's prompt_logprobs), then the answer's; max_tokens 0 answers nothing; streamed alike."""
    client, _, llm, service = served
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = llm.generate(prompts, SamplingParams(max_new_tokens=2, logprobs=2, prompt_logprobs=2))
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
    assert text.choices[0].text == "abc" + greedy(llm, "abc", 3, chat=False).text
    streamed = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=0)
    assert engine_settled(service)


def test_n_choices_streamed_or_not_share_the_prompts_kv(served):
    """n = 3: greedy choices all equal generate's; seeded sampled choice i equals one request seeded seed + i, and
    its streamed deltas (by choice index) join to the same text; the choices reuse the prompt's cached KV."""
    client, _, llm, service = served
    messages = [{"role": "user", "content": "What is 1+1?"}]
    want = greedy(llm, messages[0]["content"], 8, chat=True)
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
