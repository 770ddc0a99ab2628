"""fastspec.LLM driven as a vLLM / SGLang offline-engine user drives it: one generate or stream at a time (a second,
from another thread or while a stream is open, refused in one line), Ctrl-C in the middle of a generate, a script
that exits with a stream open, and other projects' names (keywords without the prompts, dict prompts and params, a
Completion's vLLM fields, the LLM's methods) answered with fastspec's own."""

import itertools
import os
import pickle
import subprocess
import sys
import threading

import pytest
from conftest import all_slots_free
from tiny_models import write_chat_target

import fastspec
from fastspec import SamplingParams
from fastspec.errors import FastspecError

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [7, 8]]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny llama with a word-level tokenizer, so stop strings, streams and chat run."""
    return write_chat_target(tmp_path_factory.mktemp("chat-target"))


@pytest.fixture(scope="module")
def llm(chat_dir):
    return fastspec.LLM(str(chat_dir), speculative_algorithm="NGRAM", max_total_tokens=512)


def ids(completions) -> list[list[int]]:
    return [c.output_ids for c in completions]


def test_one_generate_or_stream_at_a_time(llm, chat_dir):
    """While a stream is open, a generate from this thread or another is a FastspecError naming why (both ran over
    the one worker: another thread's failed inside the NGRAM drafter); the open stream goes on, and once it is done
    every slot is back and the answers are what they were. A stream closed early leaves the engine's load (a
    server's /metrics) reading the pool as it is (it read the closed stream's last step: 2 running). `abort`
    before any stream is a no-op (it was an AttributeError)."""
    fastspec.LLM(str(chat_dir), speculative_algorithm="NONE", max_total_tokens=256).abort(0)
    expected = ids(llm.generate(PROMPTS, PARAMS))
    stream = llm.stream(PROMPTS, PARAMS)
    first = next(stream)
    refused = []

    def other_thread():
        try:
            llm.generate(PROMPTS, PARAMS)
        except FastspecError as e:
            refused.append(str(e))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(refused) == 1 and "already running a generate or stream" in refused[0]
    with pytest.raises(FastspecError, match=r"already running a generate or stream .*close\(\) the stream"):
        llm.generate(PROMPTS, PARAMS)
    got = [[], []]
    for step in [first, *stream]:
        for delta in step:
            got[delta.index] += delta.new_ids
    assert got == expected
    assert all_slots_free(llm.engine)
    early = llm.stream(PROMPTS, PARAMS)
    next(early)
    early.close()  # walked away from: its slots are back (the load says so too) and the next call runs
    assert (llm.engine.load.running, llm.engine.load.free_kv) == (0, llm.engine.worker.available_kv())
    assert ids(llm.generate(PROMPTS, PARAMS)) == expected


def test_another_threads_abort_is_taken_and_its_flush_refused_while_a_stream_runs(llm, monkeypatch):
    """As a vLLM user expects of an engine: another thread's abort ends that request at the stream's next step, also
    one landing while the stream applies other aborts (it went into the set the stream then cleared: lost, the
    request ran to its length); another thread's prefix-cache flush while the stream runs is refused in one line
    (vLLM and SGLang refuse a flush with requests running; it raced the stream's steps over the cache), the
    stream's own thread may flush between its steps, and another thread's runs once the stream is done."""
    engine = llm.engine
    prompts, params = [[3, 4, 5, 6], [7, 8], [9, 10, 11], [12, 13]], SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = ids(llm.generate(prompts, params))
    release, refused = engine.worker.release, []

    def release_while_another_aborts(r) -> None:  # the stream applying request 3's abort: another thread aborts 1
        if r.rid == 3 and r.finish_reason == "abort":
            aborting = threading.Thread(target=engine.abort, args=(1,))
            aborting.start()
            aborting.join()
        release(r)

    def flush_elsewhere() -> None:
        try:
            engine.flush_cache()
        except FastspecError as e:
            refused.append(str(e))

    monkeypatch.setattr(engine.worker, "release", release_while_another_aborts)
    got, reasons = [[] for _ in prompts], {}
    for n, step in enumerate(engine.stream(prompts, [params] * len(prompts))):
        for out in step:
            got[out.index] += out.new_ids
            reasons[out.index] = out.finish_reason
        if n == 1:
            engine.abort(3)
            engine.flush_cache()  # (the stream's own thread, between its steps)
            flushing = threading.Thread(target=flush_elsewhere)
            flushing.start()
            flushing.join()
    assert refused == ["this LLM is running a generate or stream in another thread: flush_cache runs between runs, "
                       "or in the thread running it"]
    assert reasons == {0: "length", 1: "abort", 2: "length", 3: "abort"}
    assert [got[0], got[2]] == [expected[0], expected[2]]
    assert all(0 < len(got[i]) < 40 and got[i] == expected[i][:len(got[i])] for i in (1, 3))
    flushing = threading.Thread(target=flush_elsewhere)  # between runs: it runs
    flushing.start()
    flushing.join()
    assert len(refused) == 1 and all_slots_free(engine)


@pytest.mark.parametrize("stop", [(), ("w89",)])  # token ids alone, and through the detokenizer (stop strings)
def test_an_abort_named_before_a_streams_first_step_ends_that_request(llm, stop):
    """An abort named after LLM.stream(...) returned and before its first next(), from this thread or another, ends
    that request at the first step, as one named later does (it was dropped when the stream started: the request
    ran to its length); one named with no stream handed out stays a no-op, and the next stream runs in full."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=stop)
    expected = ids(llm.generate(PROMPTS, params))
    llm.abort(1)  # no stream handed out: nothing to end

    def from_another_thread(index: int) -> None:
        thread = threading.Thread(target=llm.abort, args=(index,))
        thread.start()
        thread.join()

    for abort in (llm.abort, from_another_thread):
        stream = llm.stream(PROMPTS, params)
        abort(0)
        got, reasons = [[], []], {}
        for step in stream:
            for delta in step:
                got[delta.index] += delta.new_ids
                reasons[delta.index] = delta.finish_reason
        assert reasons == {0: "abort", 1: "length"} and got == [[], expected[1]]
    assert ids(llm.generate(PROMPTS, params)) == expected and all_slots_free(llm.engine)


def test_a_stream_handed_to_another_thread_is_that_threads_to_flush(llm):
    """A stream started in one thread and consumed in another (a web framework's worker pool): the thread that
    steps it now may flush the prefix cache between its steps (it was refused: the stream was taken to be the
    first thread's, which could flush while the consumer stepped); a third thread's flush and leak check are
    refused in one line (check_kv read the allocator while the stream ran); the output is unchanged."""
    expected = ids(llm.generate(PROMPTS, PARAMS))
    stream, got, refused = llm.stream(PROMPTS, PARAMS), [[], []], []
    starting = threading.Thread(target=lambda: got.append(next(stream)))
    starting.start()
    starting.join()

    def elsewhere() -> None:
        for call in (llm.engine.flush_cache, llm.engine.check_kv):
            try:
                call()
            except FastspecError as e:
                refused.append(str(e))

    for n, step in enumerate(itertools.chain([got.pop()], stream)):
        for delta in step:
            got[delta.index] += delta.new_ids
        if n == 1:
            llm.engine.flush_cache()
            other = threading.Thread(target=elsewhere)
            other.start()
            other.join()
    assert got == expected
    assert refused == [f"this LLM is running a generate or stream in another thread: {what} runs between runs, or "
                       "in the thread running it" for what in ("flush_cache", "check_kv")]
    assert all_slots_free(llm.engine)


@pytest.mark.parametrize("stop", [(), ("w89",)])  # token ids alone, and through the detokenizer (stop strings)
def test_ctrl_c_in_a_generate_leaves_the_llm_usable(llm, stop):
    """KeyboardInterrupt raised between steps (here from should_stop, in the frames that read the engine's stream):
    the stream is closed at once, though the traceback (a REPL keeps the last one) holds those frames, so every
    slot is back and the next generate runs (the slots were held until the traceback was dropped)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=stop)
    expected = ids(llm.generate(PROMPTS, params))

    def ctrl_c():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        llm.generate(PROMPTS, params, should_stop=ctrl_c)
    assert (llm.engine.load.running, llm.engine.load.free_kv) == (0, llm.engine.worker.available_kv())
    assert all_slots_free(llm.engine)
    assert ids(llm.generate(PROMPTS, params)) == expected
    assert caught.traceback  # (held to here)


def test_other_projects_names_are_answered_in_one_line(llm):
    """vLLM's and SGLang's spellings: a keyword given without the prompts (was a TypeError about the missing
    argument), their dict prompts and params, a Completion's RequestOutput fields and the LLM's methods (were bare
    AttributeErrors) each name fastspec's own; a name no one has stays Python's plain AttributeError."""
    with pytest.raises(FastspecError, match="generate has no keyword 'prompt_token_ids'; pass token-id lists as the"):
        llm.generate(prompt_token_ids=PROMPTS)
    with pytest.raises(FastspecError, match="generate has no keyword 'prompt'; use prompts"):
        llm.generate(prompt="w3 w4", sampling_params=PARAMS)
    with pytest.raises(FastspecError, match="chat has no keyword 'chat_template'; fastspec uses the model's own"):
        llm.chat([{"role": "user", "content": "w3"}], PARAMS, chat_template="{{ messages }}")
    for prompts in ([{"prompt_token_ids": [3, 4]}], {"prompt": "w3 w4"}):
        with pytest.raises(FastspecError, match=r"token-id lists \(not vLLM's \{'prompt': text\}"):
            llm.generate(prompts, PARAMS)
    with pytest.raises(FastspecError, match=r"one per prompt \(SGLang's dict d: SamplingParams\(\*\*d\)\)"):
        llm.generate("w3 w4", {"max_new_tokens": 2})
    completion = llm.generate([[3, 4]], PARAMS)[0]
    with pytest.raises(AttributeError, match=r"^'Completion' object has no attribute 'outputs'; a Completion is its "
                                             r"prompt's one answer \(vLLM's .outputs\[0\]\): read .text"):
        completion.outputs
    with pytest.raises(AttributeError, match="no attribute 'token_ids'; use output_ids$"):
        completion.token_ids
    with pytest.raises(AttributeError, match="^'Completion' object has no attribute 'nope'$"):
        completion.nope
    assert not hasattr(completion, "outputs") and pickle.loads(pickle.dumps(completion)) == completion
    with pytest.raises(AttributeError, match=r"^'LLM' object has no attribute 'get_tokenizer'; use llm.tokenizer"):
        llm.get_tokenizer()
    with pytest.raises(AttributeError, match="^'LLM' object has no attribute 'nope'$"):
        llm.nope


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_script_that_exits_with_a_stream_open_exits_cleanly(chat_dir, overlap):
    """A script that ends with a stream still open (kept in a variable, not run to its end): the stream is closed at
    exit, its requests released while the interpreter is whole. Left to the interpreter's last collection,
    torch aborted the process (exit status 134, an internal assert in THPVariable_clear); under overlap the worker's
    thread has already stopped then, so the releases run in the main thread."""
    code = f"""
import fastspec
llm = fastspec.LLM({str(chat_dir)!r}, speculative_algorithm="NGRAM", max_total_tokens=512, overlap_schedule={overlap!r})
stream = llm.stream([[3, 4, 5]], fastspec.SamplingParams(max_new_tokens=8, ignore_eos=True))
next(stream)
print("left with a stream open")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert (done.returncode, done.stdout) == (0, "left with a stream open\n"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
