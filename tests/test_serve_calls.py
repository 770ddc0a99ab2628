"""Calls other threads hand a served engine (POST /flush_cache, a leak check: EngineService.call, Engine.call), run by
its engine thread at its next pause between steps: the 503s of a call the server stops before running, of one that
finds no pause within its timeout (cancelled: it never runs, and leaves the queue at once) and of one that started
and does not finish. A tiny Llama with a character tokenizer, decoding plainly."""

import threading
import time
from concurrent.futures import Future

import pytest
from serve_helpers import engine_settled, plain_char_llm, raw, start_server

from fastspec.engine.streams import OneRun
from fastspec.sampling import SamplingParams
from fastspec.serve.api_error import APIError
from fastspec.serve.service import EngineService

MODEL = "tiny-calls"


@pytest.fixture
def own_llm(tiny_dirs, tmp_path_factory):
    """An LLM of the test's own, for a server it starts and stops (a served LLM runs nothing else)."""
    return plain_char_llm(tiny_dirs, tmp_path_factory)


def test_a_call_pending_when_the_server_stops_is_a_one_line_503(own_llm):
    """A call routed to the engine thread (POST /flush_cache) that the server stops before running is a one-line
    503 naming it (it was a raw RuntimeError: a 500 'internal error'); once stopped, a call is a 503 at once (it
    waited 60 s for a thread that had gone)."""
    server, thread, service, url, _ = start_server(own_llm, MODEL, 4)
    entered, gate, answer = threading.Event(), threading.Event(), []

    def deliver(event) -> None:  # the engine thread waits here, between two steps, until the stop and the call queue
        entered.set()
        gate.wait(30)

    flusher = threading.Thread(target=lambda: answer.append(raw(url, "POST", "/flush_cache")))
    try:
        service.submit(own_llm.encode("abc"), SamplingParams(max_new_tokens=50, ignore_eos=True), deliver)
        assert entered.wait(30)
        service.stop(timeout=0)  # queued behind the step being handed out
        flusher.start()
        deadline = time.monotonic() + 30
        while service._inbox.qsize() < 2 and time.monotonic() < deadline:  # the stop, then the call's
            time.sleep(0.01)
        gate.set()
        flusher.join(30)
        assert answer == [(503, {"error": {"message": "the server stopped before running flush_cache",
                                           "type": "server_error", "param": None, "code": None}})]
        service.stop()
        with pytest.raises(APIError, match="^the engine has stopped: the server is shutting down$") as e:
            service.call(lambda: None)
        assert e.value.status == 503
    finally:
        gate.set()
        server.should_exit = True
        thread.join(10)
        service.stop()


def test_a_call_the_engine_has_no_pause_for_is_a_one_line_503_and_never_runs(own_llm):
    """A call routed to the engine thread (POST /flush_cache) that finds no pause between steps within its timeout
    is a one-line 503 naming it, and is cancelled: it never runs later (it was a raw TimeoutError, a 500, and the
    flush still ran once the engine paused). The server goes on serving."""
    service = EngineService(own_llm, max_queued=4).start()
    entered, gate, ran, events = threading.Event(), threading.Event(), [], []

    def deliver(event) -> None:  # the engine thread waits here, between two steps, until the call has timed out
        entered.set()
        events.append(event)
        gate.wait(30)

    try:
        service.submit(own_llm.encode("abc"), SamplingParams(max_new_tokens=4, ignore_eos=True), deliver)
        assert entered.wait(30)
        with pytest.raises(APIError) as e:
            service.call(lambda: ran.append("flushed"), "flush_cache", timeout=0.05)
        assert (e.value.status, str(e.value)) == (503, "flush_cache did not run: the engine had no pause between "
                                                       "steps for 0.05 s; it was cancelled, retry later")
        gate.set()
        assert engine_settled(service) and ran == [] and events[-1].finish_reason == "length"
        assert service.call(lambda: ran.append("later"), "flush_cache", timeout=30) is None and ran == ["later"]
    finally:
        gate.set()
        service.stop()


def test_a_cancelled_call_leaves_the_queue_at_once_and_never_runs():
    """A call another thread queued for a server's next safe point, cancelled by its caller (who stopped waiting),
    leaves the queue at once, not at that safe point: under a stalled engine, retried flushes would pile up, and a
    waiting call keeps the next round from running ahead. It never runs; a live one still does."""
    runs, ran, woken = OneRun(), [], []
    steps = runs.serve((step for step in range(3)), wake=lambda: woken.append(True))
    next(steps)  # this thread holds the engine, as a server's engine thread does
    calls = []

    def ask(*numbers: int) -> None:  # (from another thread: queued for the holder's next safe point)
        asker = threading.Thread(target=lambda: calls.extend(runs.call(lambda i=i: ran.append(i), f"call {i}")
                                                              for i in numbers))
        asker.start()
        asker.join()

    ask(0, 1)
    assert runs.calls_waiting and len(woken) == 2
    assert calls[0].cancel() and calls[1].cancel()
    assert not runs.calls_waiting  # (they stayed till the next safe point, and no round ran ahead meanwhile)
    ask(2, 3)
    assert calls[2].cancel() and runs.calls_waiting  # call 3 still waits
    runs.run_calls()
    assert ran == [3] and calls[3].result() is None and not runs.calls_waiting
    steps.close()


def test_a_call_that_started_and_does_not_finish_is_a_503(own_llm, monkeypatch):
    """A call the engine thread started (late, or one that runs long) can no longer be cancelled when its caller's
    wait ends: it is waited for as long again, then a one-line 503 says it has not finished (it was waited for
    without limit, holding one of the event loop's worker threads for as long as the call ran)."""
    service = EngineService(own_llm, max_queued=4).start()
    started = Future()
    started.set_running_or_notify_cancel()  # what Engine.call hands back once the engine thread runs fn
    monkeypatch.setattr(service.engine, "call", lambda fn, what: started)
    answer = []

    def ask() -> None:
        try:
            answer.append(service.call(lambda: None, "flush_cache", timeout=0.01))
        except APIError as e:
            answer.append((e.status, str(e)))
    asker = threading.Thread(target=ask)
    try:
        asker.start()
        asker.join(30)
        started.set_result("finished")  # (a wait without a bound would end only now, with this result)
        asker.join(30)
        assert answer == [(503, "flush_cache had not finished 0.02 s after it was asked for: it runs on in the engine "
                                "thread, unreported")]
    finally:
        service.stop()
