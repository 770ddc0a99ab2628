"""`fastspec serve`'s /metrics: Prometheus' text format, through prometheus_client (its registry, metric types and
exposition), one registry per server.

Names are SGLang's (docs: "Production Metrics") under a `fastspec:` prefix, with the served model name as the
`model_name` label: counters of prompt and generated tokens, finished requests (by finish reason) and speculative
verify rounds / accepted draft tokens; histograms of time to first token, time per output token and end-to-end
latency; gauges read at each scrape: running and waiting requests, KV pool usage, the prefix cache's hit rate and
the speculative accept length. The engine thread reports requests (`submitted`, `first_token`, `finished`);
nothing here touches the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                   20.0, 25.0, 30.0, 40.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str, engine):
        """`engine`: the served fastspec Engine, read at each scrape (its `load`, pool and prefix cache)."""
        self.registry, self.engine, self.model_name = CollectorRegistry(), engine, model_name
        self._totals = {"prompt": 0, "rounds": 0, "accepted": 0}  # what the gauges divide
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def counter(name, doc):
            return Counter(f"fastspec:{name}", doc, **labels).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"fastspec:{name}", doc, buckets=LATENCY_BUCKETS, **labels).labels(model_name)

        def gauge(name, doc, read):
            Gauge(f"fastspec:{name}", doc, **labels).labels(model_name).set_function(read)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests received.")
        self.generation_tokens = counter("generation_tokens", "Output tokens handed out.")
        self.requests = Counter("fastspec:num_requests", "Requests finished, by finish reason (stop, length, "
                                "abort).", labelnames=["model_name", "finish_reason"], registry=self.registry)
        self.verify_rounds = counter("spec_verify_rounds", "Speculative verify rounds of the finished requests.")
        self.accepted_tokens = counter("spec_accepted_tokens", "Accepted draft tokens of the finished requests.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.")
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first, in seconds.")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.")
        pool = engine.worker.memory.ceiling  # a growing pool's usage is of what it may grow to
        # A scrape runs on the HTTP side while the engine thread steps: it reads `engine.load`, a frozen EngineLoad
        # the engine thread replaces whole after each step (never the allocator or the pools, which a step mutates),
        # and single ints (reused_tokens, the totals: a scrape between two of one request's updates is off by that
        # request until the next scrape).
        gauge("num_running_reqs", "Requests in the running batch.", lambda: engine.load.running)
        gauge("num_queue_reqs", "Requests waiting for admission.", lambda: engine.load.waiting)
        gauge("token_usage", "Fraction of the KV pool in use.", lambda: 1 - engine.load.free_kv / pool)
        gauge("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens received.",
              lambda: engine.worker.reused_tokens / max(1, self._totals["prompt"]))
        gauge("spec_accept_length", "Tokens per verify round (accepted draft tokens + the bonus token) of the "
              "finished requests.", self._accept_length)

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self._totals["prompt"] += prompt_tokens

    def first_token(self, since_submit: float) -> None:
        self.ttft.observe(since_submit)

    def finished(self, reason: str, tokens: int, since_submit: float, since_first: float | None, spec) -> None:
        """A request ended (`spec`: its SpecMetrics): `tokens` handed out (counted here: a stop string can take
        back tokens counted as they came), the seconds since it was submitted and since its first token."""
        self.generation_tokens.inc(tokens)
        self.requests.labels(self.model_name, reason).inc()
        self.e2e.observe(since_submit)
        if since_first is not None and tokens > 1:
            self.tpot.observe(since_first / (tokens - 1))
        self.verify_rounds.inc(spec.verify_rounds)
        self.accepted_tokens.inc(spec.accepted_tokens)
        self._totals["rounds"] += spec.verify_rounds
        self._totals["accepted"] += spec.accepted_tokens

    def _accept_length(self) -> float:
        rounds = self._totals["rounds"]
        return (self._totals["accepted"] + rounds) / rounds if rounds else 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
