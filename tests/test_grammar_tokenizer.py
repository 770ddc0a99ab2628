"""GrammarCompiler.tokenizer, llguidance's reading of the tokenizer built once for every caller: a caller that
arrives while the build runs waits for it and hears how it ended, however the threads interleave."""

import threading

from fastspec.sampling.grammar import GrammarCompiler


class _PausingLock:
    """A lock that, released by thread `name`, first lets `passed` go and then waits for `resume`: it holds that
    thread between the compiler's lock and what it does next."""

    def __init__(self, name: str, passed: threading.Event, resume: threading.Event):
        self.lock, self.name, self.passed, self.resume = threading.Lock(), name, passed, resume
        self.exits = 0

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        self.exits += 1
        if threading.current_thread().name == self.name:
            self.passed.set()
            assert self.resume.wait(30)
        elif self.exits == 3:  # the builder's second release: after its failed build emptied the attribute
            self.resume.set()


def test_a_caller_waiting_on_a_build_that_fails_unexpectedly_hears_its_error(tmp_path):
    """The builder raises an unexpected error while a second caller is past the compiler's lock: the second hears
    that error (it read the attribute the failure had emptied: AttributeError 'NoneType' has no attribute 'result'),
    and the next caller builds again."""
    compiler = GrammarCompiler(tmp_path, 97, [2])
    building, waiter_in, failed = threading.Event(), threading.Event(), threading.Event()
    compiler._lock = _PausingLock("waiter", waiter_in, failed)
    builds = []

    def failing_build():
        builds.append(1)
        building.set()
        assert waiter_in.wait(30)  # (the second caller has found this build under way)
        raise RuntimeError("a bug in the build")
    compiler._read_tokenizer = failing_build
    heard = {}

    def call(name):
        try:
            compiler.tokenizer
        except Exception as e:
            heard[name] = e
    builder = threading.Thread(target=call, args=("builder",), name="builder")
    builder.start()
    assert building.wait(30)
    waiter = threading.Thread(target=call, args=("waiter",), name="waiter")
    waiter.start()
    builder.join(30)
    waiter.join(30)
    assert [type(heard.get(n)) for n in ("builder", "waiter")] == [RuntimeError, RuntimeError], heard
    compiler._read_tokenizer = lambda: "built"
    compiler._lock = threading.Lock()
    assert compiler.tokenizer == "built" and len(builds) == 1
