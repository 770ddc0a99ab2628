"""Building fastspec's C kernels (fastspec.kernels.cpu_library): built once into the cache and loaded, built again
when the cache's copy is damaged, single-threaded without OpenMP, and, where they cannot be built, one line saying
why (the callers then run their torch twins)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from fastspec.kernels import cpu_fused, cpu_library

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler for the fused CPU kernels")


def load_in_child(cache, **env) -> str:
    """Whether a fresh process with FASTSPEC_CACHE=cache (and `env`) has the kernels: "True" or "False"."""
    code = "from fastspec.kernels import cpu_fused; print(cpu_fused.available())"
    env = {**os.environ, "FASTSPEC_CACHE": str(cache), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path):
    """A library cut short in the cache (by another process: this one keeps the file it loaded) is compiled again."""
    assert load_in_child(tmp_path) == "True"
    (library,) = (tmp_path / "kernels").glob("cpu_fused-*.so")
    size = library.stat().st_size
    library.write_bytes(library.read_bytes()[:100])
    assert load_in_child(tmp_path) == "True" and library.stat().st_size == size


def test_a_compiler_without_openmp_builds_them_single_threaded_and_none_runs_the_twins(tmp_path):
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    assert load_in_child(tmp_path / "a", CC=str(wrapper)) == "True"
    assert load_in_child(tmp_path / "b", CC="/bin/false") == "False"
    assert not list((tmp_path / "b").glob("kernels/*.so"))


def test_a_failed_build_says_which_file_and_what_the_compiler_said(tmp_path, monkeypatch):
    """Every file is compiled side by side and the first failure is raised once all have ended; its log line names
    the file and the compiler's error (or the time limit it ran past), not the whole command line."""
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int good(void) { return 1; }\n")
    bad.write_text("int bad( {\n")
    commands = [["cc", "-c", str(c), "-o", str(c.with_suffix(".o"))] for c in (good, bad)]
    with pytest.raises(subprocess.CalledProcessError) as failed:
        cpu_library._compile_all(commands)
    assert good.with_suffix(".o").exists()  # (its compile ended before the failure was raised)
    why = cpu_library._why(failed.value)
    assert why.startswith("cc failed on bad.c: ") and "error" in why and "\n" not in why
    monkeypatch.setattr(cpu_library, "COMPILE_SECONDS", 0.5)
    with pytest.raises(subprocess.TimeoutExpired) as slow:
        cpu_library._compile_all([[sys.executable, "-c", "import time; time.sleep(30)", "slow.c"]])
    assert cpu_library._why(slow.value) == f"{sys.executable} took over 0.5 s on slow.c"


def test_a_build_killed_midway_is_cleaned_up_by_the_next(tmp_path):
    """A process killed while it compiles (its compilers with it) leaves its work in the cache; the next build there
    removes it (the one that is gone holds it no longer), so the cache holds the library and nothing else of it."""
    slow = tmp_path / "slow-cc"
    slow.write_text('#!/bin/sh\nsleep 60\nexec cc "$@"\n')
    slow.chmod(0o755)
    code = "from fastspec.kernels import cpu_fused; cpu_fused.available()"
    env = {**os.environ, "FASTSPEC_CACHE": str(tmp_path / "cache"), "CC": str(slow)}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    kernels = tmp_path / "cache" / "kernels"

    def work() -> list[str]:  # what a build writes beside the library
        return [p.name for p in kernels.glob(".*") if p.name != ".fastspec-convert.lock"]

    try:
        deadline = time.monotonic() + 120
        while not work() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert work()  # (what the killed build left)
    assert load_in_child(tmp_path / "cache") == "True"
    assert work() == [] and len(list(kernels.glob("cpu_fused-*.so"))) == 1
