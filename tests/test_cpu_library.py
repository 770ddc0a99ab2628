"""Building fastspec's C kernels (fastspec.kernels.cpu_library): built once into the cache (by `make setup`'s
`python -m fastspec.kernels.cpu_library`, else on first use) and loaded, built again when the cache's copy is
damaged, single-threaded without OpenMP, and, where they cannot be built, one line saying why (the callers then run
their torch twins); the compilers of an interrupted build do not outlive it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastspec.kernels import cpu_fused, cpu_library

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="no C compiler for the fused CPU kernels")


def load_in_child(cache, **env) -> str:
    """Whether a fresh process with FASTSPEC_CACHE=cache (and `env`) has the kernels: "True" or "False"."""
    code = "from fastspec.kernels import cpu_fused; print(cpu_fused.available())"
    env = {**os.environ, "FASTSPEC_CACHE": str(cache), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def build_in_child(cache, **env) -> subprocess.CompletedProcess:
    """`python -m fastspec.kernels.cpu_library` (make setup's step) with FASTSPEC_CACHE=cache (and `env`)."""
    env = {**os.environ, "FASTSPEC_CACHE": str(cache), **env}
    return subprocess.run([sys.executable, "-m", "fastspec.kernels.cpu_library"], env=env, capture_output=True,
                          text=True)


def test_a_damaged_library_in_the_cache_is_built_again(tmp_path):
    """`make setup` builds the library (one line naming it); one cut short in the cache (by another process: this one
    keeps the file it loaded) is compiled again."""
    built = build_in_child(tmp_path)
    (library,) = (tmp_path / "kernels").glob("cpu_fused-*.so")
    assert (built.returncode, built.stdout, built.stderr) == (0, f"fastspec's CPU kernels: {library}\n", "")
    assert load_in_child(tmp_path) == "True"
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
    # CC is a command and its arguments ("ccache gcc"), as make reads it; unbalanced quotes: one name that fails
    for cc, why in (("/bin/false", "/bin/false failed on cpu_"), (str(tmp_path / "none"), "[Errno 2] "),
                    (" /bin/false -pipe", "/bin/false failed on cpu_"), ('/bin/false "', "[Errno 2] ")):
        built = build_in_child(tmp_path / "c", CC=cc)  # make setup goes on without a compiler
        assert built.returncode == 0 and built.stdout.startswith(f"fastspec's CPU kernels: not built ({why}"), built
        assert built.stdout.endswith("); the torch twins run\n") and built.stdout.count("\n") == 1


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
    """A process killed outright while it compiles leaves its work in the cache (and its compilers, in sessions of
    their own, to finish); the next build there removes it (the one that is gone holds it no longer), so the cache
    holds the library and nothing else of it."""
    slow, compilers = tmp_path / "slow-cc", tmp_path / "compilers"
    slow.write_text(f'#!/bin/sh\necho $$ >> {compilers}\nsleep 60\nexec cc "$@"\n')
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
        time.sleep(0.5)  # (a compiler it was starting: recorded)
        for pid in compilers.read_text().split() if compilers.exists() else ():  # (each leads its own group)
            kill_group(int(pid))
    assert work()  # (what the killed build left)
    assert load_in_child(tmp_path / "cache") == "True"
    assert work() == [] and len(list(kernels.glob("cpu_fused-*.so"))) == 1


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ended(pid: int) -> bool:
    """Whether process `pid` runs no more (gone, or a zombie its new parent has not reaped yet)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_an_interrupted_build_kills_its_compilers_and_what_they_started(tmp_path, monkeypatch):
    """A build interrupted (Ctrl-C's KeyboardInterrupt) or past its time limit left its compilers running, and what
    they had started (cc1, as): a compiler killed alone leaves its children. Each command now runs in a session of its
    own, killed whole. The stand-in compiler starts a child that would sleep for a minute and records its id."""
    pid_file = tmp_path / "child"
    command = ["sh", "-c", f'sleep 60 & echo $! > {pid_file}; wait', "slow.c"]
    monkeypatch.setattr(cpu_library, "COMPILE_SECONDS", 2)
    with pytest.raises(subprocess.TimeoutExpired):
        cpu_library._compile_all([command])
    assert ended(int(pid_file.read_text()))
    pid_file.unlink()
    monkeypatch.setattr(cpu_library, "COMPILE_SECONDS", 900)
    real_sleep = time.sleep

    def interrupted(seconds):  # Ctrl-C, once the compiler has started its child
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            real_sleep(0.01)
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu_library.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cpu_library._compile_all([command, command[:2] + ["sleep 60", "other.c"]])
    monkeypatch.undo()
    assert ended(int(pid_file.read_text()))
