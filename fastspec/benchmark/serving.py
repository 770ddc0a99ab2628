"""`fastspec bench --url`: a running OpenAI-compatible server measured as SGLang's bench_serving does.

Requests arrive as a Poisson process at `request_rate` per second (inf: all at once), at most `max_concurrency`
in flight; each streams a chat completion of exactly `max_tokens` tokens (ignore_eos) and is timed on the client:
time to first token (TTFT), the gaps between streamed chunks (ITL; a speculative round may bring several tokens
in one chunk), time per output token after the first (TPOT), end-to-end latency. Standard library only.
No printing here: fastspec.cli.bench renders the summary.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastspec.errors import FastspecError


@dataclass(frozen=True)
class Timing:
    ok: bool
    completion_tokens: int = 0
    ttft: float = 0.0
    gaps: tuple[float, ...] = ()  # between streamed chunks after the first
    latency: float = 0.0
    error: str | None = None


def server_model(url: str) -> str:
    """The id the server at `url` serves (GET /v1/models); FastspecError when nothing answers."""
    status, body = _get(url, "/v1/models")
    if status != 200 or not body.get("data"):
        path = _split(url)[2] + "/v1/models"
        raise FastspecError(f"{url} answered {path} with status {status}: not an OpenAI-compatible server")
    return body["data"][0]["id"]


def _split(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of a base URL, as vLLM's and SGLang's bench clients take it: the API's routes
    follow the prefix (`http://h:8080/llm` -> `/llm/v1/...`, a server behind a reverse proxy); a prefix ending in
    /v1 (an OpenAI client's base_url) is the same server."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment:
        raise FastspecError(f"--url must look like http://HOST:PORT[/PREFIX], got {url!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise FastspecError(f"--url must look like http://HOST:PORT[/PREFIX], got {url!r}") from None
    prefix = parts.path.rstrip("/")
    return parts.hostname, port, prefix.removesuffix("/v1") if prefix.endswith("/v1") else prefix


def run_serving(url: str, prompts: list[str], max_tokens: int, request_rate: float, max_concurrency: int,
                seed: int = 0) -> dict:
    model = server_model(url)
    gaps = random.Random(seed)
    slots = threading.Semaphore(max_concurrency)

    def one(prompt: str) -> Timing:
        with slots:
            return stream_chat(url, model, prompt, max_tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_concurrency) as pool:
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(one, prompt))
            if request_rate != float("inf"):
                time.sleep(gaps.expovariate(request_rate))
        timings = [f.result() for f in futures]
    return summarize(timings, time.perf_counter() - start, model, request_rate, max_concurrency)


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> Timing:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    host, port, prefix = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    try:
        conn.request("POST", prefix + "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return Timing(False, error=f"status {response.status}: {response.read()[:200]!r}")
        marks, tokens = [], None
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if isinstance(chunk, dict) and "error" in chunk:  # the server ended this stream (failed, or stopping)
                return Timing(False, error=f"error event: {_error_text(chunk['error'])}")
            if _chunk_content(chunk):
                marks.append(time.perf_counter())
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
        if not marks:
            return Timing(False, error="no content streamed")
        if not isinstance(tokens, int):  # without it output tok/s and TPOT would read 0 and nothing
            return Timing(False, error="no usage chunk with completion_tokens (stream_options.include_usage)")
        return Timing(True, tokens, marks[0] - start, tuple(b - a for a, b in zip(marks, marks[1:])),
                      time.perf_counter() - start)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Timing(False, error=f"{type(e).__name__}: {e}")
    except (KeyError, IndexError, TypeError, AttributeError):
        return Timing(False, error="a streamed chunk is not an OpenAI chat.completion.chunk")
    finally:
        conn.close()


def _chunk_content(chunk: dict) -> bool:
    """Whether a chat.completion.chunk streams text (not the role-only first chunk, nor the usage-only last)."""
    return bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))


def _error_text(error) -> str:
    """An error event's message ({"message": ...} as OpenAI, SGLang, vLLM and fastspec send it), at most 200 chars."""
    text = error.get("message") if isinstance(error, dict) else None
    return str(text if text is not None else error)[:200]


def summarize(timings: list[Timing], duration: float, model: str, request_rate: float, max_concurrency: int) -> dict:
    """The figures over the completed requests; `errors`: the distinct errors, at most 5, in the prompts' order."""
    ok = [t for t in timings if t.ok]
    tokens = sum(t.completion_tokens for t in ok)
    tpot = [(t.latency - t.ttft) / (t.completion_tokens - 1) for t in ok if t.completion_tokens > 1]
    ms = lambda xs: {"mean": _r(statistics.fmean(xs) * 1e3), "median": _r(statistics.median(xs) * 1e3),  # noqa: E731
                     "p99": _r(_percentile(xs, 99) * 1e3)} if xs else None
    rate = request_rate if math.isfinite(request_rate) else None  # (JSON has no infinity: null = all at once)
    return {"model": model, "request_rate": rate, "max_concurrency": max_concurrency,
            "completed": len(ok), "failed": len(timings) - len(ok),
            "errors": list(dict.fromkeys(t.error for t in timings if t.error))[:5], "duration_s": _r(duration),
            "request_throughput": _r(len(ok) / duration), "output_tok_s": _r(tokens / duration),
            "ttft_ms": ms([t.ttft for t in ok]), "itl_ms": ms([g for t in ok for g in t.gaps]),
            "tpot_ms": ms(tpot), "e2e_latency_ms": ms([t.latency for t in ok])}


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _r(x: float) -> float:
    return round(x, 3)


def _get(url: str, path: str) -> tuple[int, dict]:
    host, port, prefix = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", prefix + path)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise FastspecError(f"cannot reach a server at {url}: {e}") from None
    finally:
        conn.close()
