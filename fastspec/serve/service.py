"""The engine on a thread of its own, fed by a queue: requests arrive from the HTTP side at any time, join the
running batch at the next step (`Engine.run` with a poll), and come back as text deltas through a callback.

Owns: the engine while it serves (a direct LLM.generate / stream / chat meanwhile is refused), request ids, the
bound on open requests (overload = a 503, never an unbounded queue), detokenizing with stop strings (a stop string
aborts the request in the engine, as LLM.stream does), aborts from clients that went away, and the engine's
health. Only the engine thread touches the engine after start; the HTTP side only makes checked requests
(Engine.request reads the config and compiles the grammar: `check`, off the event loop), puts them in the
inbox (`enqueue`, in the order the HTTP side hands them) and hands the engine thread calls (`call`: Engine.call runs
them at its next safe point).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field

from fastspec.errors import BadField, FastspecError, RunEnded
from fastspec.sampling.params import SamplingParams
from fastspec.serve.api_error import APIError
from fastspec.serve.prometheus import ServerMetrics
from fastspec.text.detokenizer import IncrementalDetokenizer
from fastspec.utils.metrics import SpecMetrics


# How long a call from another thread (POST /flush_cache) waits for the engine's next pause between steps; a call
# that started at its end is waited for as long again. A step is one prefill chunk or decode round: a minute without a
# pause means a stalled engine, and the caller is told so (a 503 to retry) rather than kept waiting (each waiting
# caller holds one of the event loop's worker threads, which also encode and check every request).
CALL_TIMEOUT_S = 60.0

# The engine's field of a request it refused (BadField.field) -> the OpenAI request's field that carries it (param).
# A chat's prompt is its `messages` (`param`). A tool call's json schemas compile before, by tool name
# (app._check_schemas); a request's lark grammar is the tools' own (`auto`). stop_token_ids: no request sets them (a
# refusal of one names no field).
PARAMS = {"prompt": "prompt", "logit_bias": "logit_bias", "regex": "regex", "ebnf": "ebnf",
          "json_schema": "response_format", "lark": "tools", "temperature": "temperature", "top_k": "top_k"}


def param(field: str, chat: bool) -> str | None:
    """OpenAI's param for the engine's refused `field` in a chat (`chat`) or completions request."""
    return "messages" if chat and field == "prompt" else PARAMS.get(field)


@dataclass(frozen=True)
class Event:
    """What one engine step produced for one request."""

    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: tuple | None  # TokenLogprob per token whose text is handed out now (a stop string's get none)
    completion_tokens: int  # output tokens generated so far (a stop string's too, though its text is trimmed)
    metrics: SpecMetrics
    error: APIError | None = None  # the engine failed (a 500) or the server is shutting down (a 503): it ends so
    prompt_logprobs: tuple | None = None  # TokenLogprob per prompt token after the first (asked for): with the first


@dataclass(frozen=True)
class Checked:
    """A request `EngineService.check` accepted, not queued yet: the engine's (its grammar compiled) and its
    detokenizer."""

    request: object  # Engine.request's (serve is on the engine's floor: it holds the engine, imports none of it)
    detok: IncrementalDetokenizer
    ending: frozenset  # tokens that end it and are no text (special tokens kept: EOS, stop ids)


@dataclass
class _Live:
    detok: IncrementalDetokenizer
    deliver: Callable[[Event], None]
    tokens: int = 0  # output tokens generated (usage's completion_tokens)
    ending: frozenset = frozenset()  # tokens that end it and are no text (special tokens kept: EOS, stop ids)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_at: float | None = None  # when its first token was handed out
    counted: bool = True  # a client's request (/metrics); False: the server's own (n choices' shared prompt)
    held: tuple = ()  # TokenLogprob of the tokens past those handed out: their text is held back (or never shown)
    logprobs_sent: int = 0  # TokenLogprob handed out


class EngineService:
    def __init__(self, llm, max_queued: int, metrics: ServerMetrics | None = None):
        """`metrics`: told of every request by the engine thread (/metrics)."""
        self.llm, self.engine, self.max_queued, self.metrics = llm, llm.engine, max_queued, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # the engine thread's own
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open = 0  # submitted and not finished (waiting + running)
        self.error: str | None = None
        self.aborted = 0  # requests ended because their client went away
        self._thread = threading.Thread(target=self._run, name="fastspec-engine", daemon=True)
        self._holding = threading.Event()  # the engine thread holds the engine (or could not take it: `error`)

    def start(self) -> EngineService:
        """Start the engine thread; returned once it holds the engine, so that a direct LLM.generate / stream / chat
        is refused from now until `stop` (FastspecError: the LLM is running a stream already)."""
        self._thread.start()
        self._holding.wait()
        if self.error is not None:
            raise FastspecError(self.error)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread at its next step boundary; every open request ends with a 503."""
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def open_requests(self) -> int:
        return self._open

    def check(self, prompt_ids: list[int], params: SamplingParams, keep_special: bool = False,
              chat: bool = False) -> Checked:
        """The request checked and its grammar compiled (APIError 400: it can never run, naming the field of a
        completions or `chat` request that carries the cause), not queued yet: a large JSON schema takes long to
        compile, so the HTTP side calls this off the event loop. `keep_special`: the text keeps special tokens (a
        tool-call format's markers), all but the EOS that ends it."""
        try:
            request = self.engine.request(next(self._ids), prompt_ids, params)
            detok = IncrementalDetokenizer(self.llm.tokenizer, prompt_ids, params.stop, not keep_special)
        except FastspecError as e:
            raise APIError(str(e), param=param(e.field, chat) if isinstance(e, BadField) else None) from None
        ending = frozenset(self.engine.worker.eos_ids) | set(params.stop_token_ids) if keep_special else frozenset()
        return Checked(request, detok, ending)

    def enqueue(self, checked: Checked, deliver: Callable[[Event], None], counted: bool = True) -> int:
        """Queue a checked request (APIError 503: too many open requests, or stopped); returns its id.
        `deliver(Event)` is called from the engine thread after every step that made progress. `counted`:
        /metrics counts it (False: a request the server makes for itself)."""
        with self._lock:  # (the engine thread, stopping, empties the inbox under it: nothing is left behind)
            if not self.healthy:
                raise APIError(f"the engine has stopped: {self.error}", status=503, kind="server_error")
            if self._open >= self.max_queued:
                raise APIError(f"the server is overloaded ({self._open} open requests; --max-queued-requests "
                               f"{self.max_queued}): retry later", status=503, kind="server_error")
            self._open += 1
            live = _Live(checked.detok, deliver, ending=checked.ending, counted=counted)
            self._inbox.put(("add", checked.request, live))
        return checked.request.rid

    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver: Callable[[Event], None],
               keep_special: bool = False, counted: bool = True) -> int:
        """`check` then `enqueue`, on the caller's thread."""
        return self.enqueue(self.check(prompt_ids, params, keep_special), deliver, counted)

    def call(self, fn: Callable, what: str = "the call", timeout: float = CALL_TIMEOUT_S):
        """fn() run by the engine thread between two steps with no round in flight (e.g. a cache flush, a leak
        check: Engine.call); its result. APIError 503 once the engine has stopped, if it stops before running fn
        (`what` names it), or if no safe point came within `timeout` seconds (a step longer than that): then fn is
        cancelled and never runs. One that started meanwhile (no longer cancellable) is waited for up to `timeout`
        seconds more (it runs between two steps: it should be short); past that a 503 says it has not finished (it
        runs on in the engine thread, unreported)."""
        if not self.healthy:
            raise APIError(f"the engine has stopped: {self.error}", status=503, kind="server_error")
        done = self.engine.call(fn, what)
        if not wait([done], timeout).done:
            if done.cancel():
                raise APIError(f"{what} did not run: the engine had no pause between steps for {timeout:g} s; it was "
                               "cancelled, retry later", status=503, kind="server_error")
            if not wait([done], timeout).done:  # (it started: bounded too, however long fn runs)
                raise APIError(f"{what} had not finished {2 * timeout:g} s after it was asked for: it runs on in the "
                               "engine thread, unreported", status=503, kind="server_error")
        try:
            return done.result()
        except RunEnded as e:
            raise APIError(str(e), status=503, kind="server_error") from None

    def abort(self, rid: int) -> None:
        """The client went away: the engine frees the request's KV before its next step."""
        self._inbox.put(("abort", rid))

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            for step in self.engine.run([], poll=self._poll, wake=lambda: self._inbox.put(("wake",))):
                for out in step:
                    self._handle(out)
            self._end_open("the server is shutting down", 503)
        except FastspecError as e:  # its own line (the LLM was running a stream: the server never started)
            self._end_open(str(e), 500)
        except Exception as e:  # a bug in a step: every open request ends with the error, /health says so
            self._end_open(f"{type(e).__name__}: {e}", 500)
        finally:
            self._holding.set()

    def _end_open(self, error: str, status: int) -> None:
        """The engine thread is done: every open request, running or still in the inbox, ends with `error`."""
        with self._lock:
            self.error = error
            ending = list(self._live.values())
            while not self._inbox.empty():
                item = self._inbox.get()
                if item[0] == "add":
                    ending.append(item[2])
            self._live.clear()
            self._open = 0
        for live in ending:
            live.deliver(Event("", "abort", None, live.tokens, SpecMetrics(), APIError(error, status,
                                                                                       kind="server_error")))

    def _poll(self, idle: bool) -> list | None:
        """What arrived since the last step; blocks while the engine is idle until something does (a `wake`: a call
        from another thread waits for the engine's next safe point)."""
        self._holding.set()
        arrived = []
        while True:
            try:
                item = self._inbox.get(block=idle and not arrived)
            except queue.Empty:
                return arrived
            if item[0] == "stop":
                return None
            if item[0] == "wake":
                return arrived
            if item[0] == "add":
                arrived.append(item[1])
                self._live[item[1].rid] = item[2]
                if self.metrics is not None and item[2].counted:
                    self.metrics.submitted(len(item[1].prompt_ids))
            elif item[1] in self._live:
                self.engine.abort(item[1])

    def _handle(self, out) -> None:
        live = self._live.get(out.index)
        if live is None:  # finished by a stop string already: the engine confirming the abort
            return
        d = live.detok
        ids, reason = out.new_ids, out.finish_reason
        if reason == "stop" and ids and ids[-1] in live.ending:
            ids = ids[:-1]
        text = d.add(ids)
        if d.stopped and reason is None:
            self.engine.abort(out.index)  # the stop string ends it; its KV is freed before the next step
        if d.stopped and reason in (None, "length"):  # (found in the last token allowed: a stop too, as vLLM says)
            reason = "stop"
        if reason is not None:
            text += d.finish()
        before = live.tokens  # (a stop string: its tokens were generated, and count; tokens past it do not)
        live.tokens = d.num_tokens_generated if d.stopped else live.tokens + len(out.new_ids)
        logprobs = None if out.logprobs is None else self._shown_logprobs(live, out.logprobs, reason is not None)
        if self.metrics is not None and live.counted:
            self._report(live, live.tokens - before, reason, out.metrics)
        if reason is not None:  # its place is given back before its client hears (and may send the next one)
            self.aborted += reason == "abort"
            del self._live[out.index]
            self._close()
        live.deliver(Event(text, reason, logprobs, live.tokens, out.metrics, prompt_logprobs=out.prompt_logprobs))

    @staticmethod
    def _shown_logprobs(live: _Live, new: tuple, finished: bool) -> tuple:
        """The logprobs of the tokens whose text is handed out now: those of a token whose text is held back wait
        for it, and a stop string's tokens, never shown, get none (a finished request's: one per kept token, so
        after a stop string fewer than the generated tokens usage counts)."""
        held = live.held + tuple(new)
        shown = live.tokens if finished and not live.detok.stopped else live.detok.num_tokens_shown
        count = max(0, shown - live.logprobs_sent)
        live.held, live.logprobs_sent = held[count:], live.logprobs_sent + count
        return held[:count]

    def _report(self, live: _Live, new_tokens: int, reason: str | None, spec: SpecMetrics) -> None:
        now = time.perf_counter()
        if live.first_at is None and new_tokens > 0:
            live.first_at = now
            self.metrics.first_token(now - live.submitted_at)
        if reason is not None:
            since_first = None if live.first_at is None else now - live.first_at
            self.metrics.finished(reason, live.tokens, now - live.submitted_at, since_first, spec)

    def _close(self) -> None:
        with self._lock:
            self._open -= 1
