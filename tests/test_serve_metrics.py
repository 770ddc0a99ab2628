"""What measures a server: `/metrics` (parsed by prometheus_client) moves by what a request did, and
`fastspec bench --url` measures a running server, also one behind a path prefix."""

import contextlib
import http.server
import json
import threading

import pytest
from serve_helpers import MODEL, PROMPTS, engine_settled, scrape, served  # noqa: F401  (the fixture)
from typer.testing import CliRunner

from fastspec.cli import app

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


class StandIn(http.server.BaseHTTPRequestHandler):
    """A stand-in OpenAI server's handler: the tests' subclasses answer GET /v1/models and POST chat completions."""

    def prompt(self) -> str:
        """The posted chat request's first message (its body read)."""
        return json.loads(self.rfile.read(int(self.headers["content-length"])))["messages"][0]["content"]

    def send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


def events(chunks: list) -> bytes:
    """Server-sent events of these chunks (JSON each), without the closing [DONE]."""
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)


@contextlib.contextmanager
def stand_in(handler: type[StandIn]):
    """A server of `handler` on a free local port while the block runs; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield "http://127.0.0.1:%d" % server.server_address[1]
    finally:
        server.shutdown()


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
    from fastspec.benchmark.serving import run_serving

    class Prefixed(StandIn):
        def do_GET(self):
            found = self.path == "/llm/v1/models"
            self.send(200 if found else 404, b'{"data": [{"id": "proxied"}]}' if found else b"{}")

        def do_POST(self):
            self.prompt()
            if self.path != "/llm/v1/chat/completions":
                return self.send(404, b"{}")
            chunks = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
                      {"choices": [], "usage": {"completion_tokens": 2}}]
            self.send(200, events(chunks) + b"data: [DONE]\n\n")

    with stand_in(Prefixed) as base:
        for url in (base + "/llm", base + "/llm/", base + "/llm/v1"):
            summary = run_serving(url, ["x", "y"], max_tokens=2, request_rate=float("inf"), max_concurrency=2)
            assert summary["model"] == "proxied" and summary["completed"] == 2 and summary["failed"] == 0, url
        for bad in (base + "/llm?x=1", "http://127.0.0.1:port/llm", "https:/llm"):
            out = CliRunner().invoke(app, ["bench", "--url", bad, "--num-prompts", "1"])
            assert out.exit_code == 2 and "--url must look like http://HOST:PORT[/PREFIX]" in out.stderr, bad
        wrong = CliRunner().invoke(app, ["bench", "--url", base + "/other", "--num-prompts", "1"])
        assert wrong.exit_code == 2 and "answered /other/v1/models with status 404" in wrong.stderr


def test_bench_url_counts_a_stream_the_server_ended_as_failed():
    """A stream that carries an error event (what fastspec's server, SGLang and vLLM send when the engine fails or
    the server stops mid-answer), a malformed chunk, or no usage is a failed request naming why, not a traceback
    nor a 0-token success. A stand-in server that answers by the prompt."""
    from fastspec.benchmark.serving import run_serving

    text = {"choices": [{"delta": {"content": "a"}}]}
    endings = {"error": [{"error": {"message": "the server is stopping", "code": 503}}],
               "malformed": [[1, 2]], "no-usage": [], "ok": [{"choices": [], "usage": {"completion_tokens": 1}}]}

    class Ending(StandIn):
        def do_GET(self):
            self.send(200, b'{"data": [{"id": "stand-in"}]}')

        def do_POST(self):
            self.send(200, events([text] + endings[self.prompt()]) + b"data: [DONE]\n\n")

    with stand_in(Ending) as url:
        summary = run_serving(url, list(endings), max_tokens=1, request_rate=float("inf"), max_concurrency=4)
    assert summary["completed"] == 1 and summary["failed"] == 3 and summary["output_tok_s"] > 0
    assert summary["errors"] == ["error event: the server is stopping",  # (the prompts' order)
                                 "a streamed chunk is not an OpenAI chat.completion.chunk",
                                 "no usage chunk with completion_tokens (stream_options.include_usage)"]


def test_bench_url_with_every_request_failed_is_one_line_not_a_table_of_nan():
    """A server that refuses every request (or one that refuses some): all failed is one line naming how many and
    the first error, exit 2, in table and JSON mode alike; some failed keeps the figures and says how many failed.
    A stand-in server that refuses the prompts starting with "bad"."""
    class Refusing(StandIn):
        def do_GET(self):
            self.send(200, b'{"data": [{"id": "stand-in"}]}')

        def do_POST(self):
            if self.prompt().startswith("bad"):
                return self.send(500, b'{"error": "overloaded"}')
            self.send(200, events([{"choices": [{"delta": {"content": "a"}}]},
                                   {"choices": [], "usage": {"completion_tokens": 1}}]))

    with stand_in(Refusing) as url:
        runs = {name: [CliRunner().invoke(app, ["bench", "--url", url, "--num-prompts", "3", "--prompts", str(path),
                                                *json_flag]) for json_flag in ([], ["--json"])]
                for name, path in _prompt_files(("bad 1", "bad 2", "bad 3"), ("good", "bad", "good too")).items()}
    for out in runs["all bad"]:
        assert out.exit_code == 2 and out.stdout == "" and "nan" not in out.stderr
        assert out.stderr.strip() == (f"error: all 3 requests to {url} failed; the first error: "
                                      "status 500: b'{\"error\": \"overloaded\"}'")
    table, as_json = runs["some bad"]
    for out in (table, as_json):
        assert out.exit_code == 0 and "1 of 3 requests failed; the figures are over the 2 that completed" in out.stderr
    assert "E2E_LATENCY" in table.stdout and "nan" not in table.stdout  # (one chunk each: no ITL, shown as -)
    assert json.loads(as_json.stdout)["completed"] == 2


def _prompt_files(*prompt_lists):
    """{"all bad": path, "some bad": path}: JSONL prompt files in a fresh temporary folder."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    paths = {}
    for name, prompts in zip(("all bad", "some bad"), prompt_lists):
        paths[name] = folder / f"{name.replace(' ', '-')}.jsonl"
        paths[name].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return paths


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
