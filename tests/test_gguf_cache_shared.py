"""The conversion cache shared by several processes: a conversion killed midway cleaned up by the next (an earlier
fastspec's too, where provably its own), two processes converting one file at once, a replaced conversion kept while
a process reads it, and the packed weights' caches and temp files. Oracles: tiny random models written to GGUF
(tests/gguf_writers.py), and processes started, held or killed by the tests."""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import torch
from gguf_writers import tiny_llama, write_gguf
from transformers import LlamaForCausalLM

from fastspec.models import embedded
from fastspec.models.embedded import EmbeddedModel, embedded_model_dir
from fastspec.models.gguf import SOURCE_MARKER, convert_gguf
from fastspec.utils.shared_dirs import STALE_AGE_S, abandoned, sweep

REPO = Path(__file__).resolve().parents[1]
KILLED_CONVERSION = """
import os, signal, sys
from fastspec.models import gguf
gguf._write_tokenizer = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # killed midway: no cleanup runs
gguf.convert_gguf(sys.argv[1], sys.argv[2])
"""
RACING_CONVERSION = """
import json, sys, time
from pathlib import Path
from fastspec.models.gguf import convert_gguf, is_current_conversion

path, out, sync, me, n = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])

def barrier(name):  # every process reaches `name` before any goes on
    (sync / f"{name}-{me}").touch()
    deadline = time.monotonic() + 600
    while len(list(sync.glob(f"{name}-*"))) < n:
        assert time.monotonic() < deadline, "a sibling process died"
        time.sleep(0.01)

assert not is_current_conversion(out, path)
barrier("start")  # all found no conversion: all convert
convert_gguf(path, out)
handed = (out / "model.safetensors").stat().st_ino
barrier("published")
files = json.loads((out / "fastspec_source.json").read_text())["files"]  # what it was handed is still whole
assert all((out / name).stat().st_size == size for name, size in files.items())
print(handed, (out / "model.safetensors").stat().st_ino)
"""


def python(code: str, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_killed_conversions_directory_is_removed_by_the_next_conversion_only(tmp_path):
    """A conversion killed midway left its `.NAME.fastspec-tmp-*` directory forever. The next conversion beside it
    removes it (its writer's lock is gone) and any replaced conversion left on its way out, never a directory another
    process is still writing (it holds its lock) nor what is not the cache's."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(True))
    child = python(KILLED_CONVERSION, path, tmp_path / "cache" / "hf")
    assert child.wait() == -signal.SIGKILL, child.stderr.read()
    (killed,) = (tmp_path / "cache").glob(".hf.fastspec-tmp-*")
    assert (killed / "model.safetensors").is_file() and not (tmp_path / "cache" / "hf").exists()
    writing = tmp_path / "cache" / ".other.fastspec-tmp-live"
    writing.mkdir()
    aside = tmp_path / "cache" / ".other.fastspec-old-x"
    (aside / "dir").mkdir(parents=True)
    foreign = tmp_path / "cache" / ".other.tmp-1"  # (another writer's name: not the cache's to judge)
    foreign.mkdir()
    held = os.open(writing, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a live writer holds it
        out = convert_gguf(path, tmp_path / "cache" / "hf")
        left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    finally:
        os.close(held)
    assert left == sorted([".fastspec-convert.lock", "hf", writing.name, foreign.name])
    assert LlamaForCausalLM.from_pretrained(out) is not None


def test_processes_converting_one_file_at_once_keep_the_first_published(tmp_path):
    """Two processes that found no conversion convert the same file at once: the later one replaced the directory the
    first had just handed to its caller (who then read files that vanished). Now the conversion published first
    stays: both are handed the same directory, whole after both have finished, and no temp directory is left."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(True))
    out, sync = tmp_path / "cache" / "hf", tmp_path / "sync"
    sync.mkdir()
    children = [python(RACING_CONVERSION, path, out, sync, i, 2) for i in range(2)]
    results = [(child.wait(), *child.communicate()) for child in children]
    assert all(code == 0 for code, _, _ in results), results
    inodes = {tuple(stdout.split()) for _, stdout, _ in results}
    assert len(inodes) == 1 and len(set(next(iter(inodes)))) == 1, inodes  # one directory, handed to both, unchanged
    assert sorted(p.name for p in out.parent.iterdir()) == [".fastspec-convert.lock", "hf"]


def test_packed_caches_no_start_reads_are_removed(tmp_path):
    """Packed caches of another torch version were never removed. A packed load removes this torch's other layouts
    and other torch versions' caches no start has read for UNUSED_S (a start that reads one touches it), and a temp
    file a killed writer left (whether the start writes a packed cache or not), not one another process is writing."""
    from fastspec.models.gguf_packed import PACKED_LAYOUT, UNUSED_S
    from fastspec.models.loader import load_target

    out = convert_gguf(write_gguf(tmp_path / "q.gguf", tiny_llama(True), qtype=gguf.GGMLQuantizationType.Q4_0),
                       tmp_path / "hf")
    blocks = out / "gguf_blocks"
    old = time.time() - UNUSED_S - 60
    unused, recent = blocks / "int4-cpu-torch-0.1.0-layout2.safetensors", blocks / "int4-cpu-torch-0.2.0.safetensors"
    ours_older = blocks / f"int4-cpu-torch-{torch.__version__}-layout1.safetensors"
    killed, writing = blocks / ".int4-killed.tmp", blocks / ".int4-live.tmp"
    for entry in (unused, recent, ours_older, killed, writing):
        entry.write_bytes(b"x")
    for entry in (unused, killed):
        os.utime(entry, (old, old))
    held = os.open(writing, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        load_target(out, torch.float32, quantization="gguf")
    finally:
        os.close(held)
    ours = f"int4-cpu-torch-{torch.__version__}-layout{PACKED_LAYOUT}.safetensors"
    assert sorted(p.name for p in blocks.glob("*int4-*")) == sorted([ours, recent.name, writing.name])
    os.utime(blocks / ours, (old, old))
    killed.write_bytes(b"x")  # (a start that reads, not writes, removes it too)
    load_target(out, torch.float32, quantization="gguf")  # read, not packed: its time is its last use
    assert time.time() - (blocks / ours).stat().st_mtime < UNUSED_S
    assert not killed.exists()


def test_an_earlier_fastspecs_leftovers_are_removed_only_where_provably_its_own(tmp_path):
    """Conversions killed before the rename to `.NAME.fastspec-tmp-*` left `.NAME.tmp-*` (`.NAME.gguf-tmp-*`)
    directories, and ones killed while removing the conversion they replaced `.NAME.old-*` (`.NAME.gguf-old-*`), that
    no sweep removed (nor a `.NAME.tmp-*` killed before writing its marker into a NAME never published). Their
    writers held no lock, so a day's age tells them gone; fastspec's marker in them (or in the conversion they
    replaced), in their destination NAME, or a NAME only a conversion of a .gguf path has, tells them fastspec's.
    One a process holds stays, as does what is not provably fastspec's."""
    cache = tmp_path / "gguf"  # (the folder of .gguf paths' conversions)
    convert_gguf(write_gguf(tmp_path / "a.gguf", tiny_llama(True)), cache / "hf")
    (cache / "data").mkdir()
    killed = cache / ".hf.tmp-abcd1234"  # killed writing its weights: hf/ is a conversion
    finished = cache / ".gone.gguf-tmp-abcd1234"  # killed after writing its marker
    unwritten = cache / ".m-0123456789ab.tmp-abcd1234"  # a .gguf path's first conversion killed before writing
    replaced = cache / ".gone.gguf-old-abcd1234" / "dir"  # killed removing the conversion it replaced
    older = cache / ".hf.old-abcd1234" / "dir"  # (the first naming; what it replaced was damaged: no marker)
    held = cache / ".kept.gguf-old-abcd1234" / "dir"  # (a process still reads it)
    young = cache / ".hf.tmp-young123"  # (maybe still written by an earlier fastspec: no lock can tell)
    foreign = cache / ".data.tmp-abcd1234"  # neither it nor data/ holds fastspec's marker
    foreign_old = cache / ".data.gguf-old-abcd1234" / "dir"
    for entry in (killed, finished, unwritten, replaced, older, held, young, foreign, foreign_old):
        entry.mkdir(parents=True)
        if entry != unwritten:
            (entry / "model.safetensors").write_bytes(b"x")
    for entry in (finished, replaced, held):
        (entry / SOURCE_MARKER).write_text("{}")
    old = time.time() - STALE_AGE_S - 60
    for entry in (killed, finished, unwritten, replaced.parent, older.parent, held.parent, foreign, foreign_old.parent):
        os.utime(entry, (old, old))
    reading = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(reading, fcntl.LOCK_SH)  # as a reader holds it
        convert_gguf(write_gguf(tmp_path / "b.gguf", tiny_llama(True, seed=1)), cache / "b")
    finally:
        os.close(reading)
    assert sorted(p.name for p in cache.iterdir()) == sorted([".fastspec-convert.lock", "b", "data", "hf", young.name,
                                                              foreign.name, held.parent.name, foreign_old.parent.name])
    # the name proves it only in a folder of .gguf paths' conversions: elsewhere (the models' root, which
    # FASTSPEC_MODEL_CACHE may share) another tool's day-old `.m-0123456789ab.tmp-*` stays
    outside = tmp_path / "shared" / unwritten.name
    outside.mkdir(parents=True)
    os.utime(outside, (old, old))
    convert_gguf(tmp_path / "b.gguf", tmp_path / "shared" / "c")
    assert outside.is_dir()


READER = """
import sys
from fastspec.models import embedded
embedded.EMBEDDED_MODELS["fake"] = embedded.EmbeddedModel("fake-pkg", "fastspec_fake_pkg", "tiny.gguf", "org/tiny")
out = embedded.embedded_model_dir("fake")
print((out / "model.safetensors").stat().st_ino, flush=True)
sys.stdin.read()  # reading it until told to exit
"""


def test_a_replaced_conversion_stays_while_a_process_reads_it(tmp_path, monkeypatch):
    """Replacing a conversion that is not current (the embedded model after an upgrade of its package) deleted the
    directory another process was reading. Now it is moved aside and stays while that process lives; the next
    conversion beside it after that removes it."""
    package, cache = tmp_path / "site" / "fastspec_fake_pkg", tmp_path / "cache"
    package.mkdir(parents=True)
    gguf_path = write_gguf(package / "tiny.gguf", tiny_llama(True, seed=0))
    env = {**os.environ, "FASTSPEC_MODEL_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    reader = subprocess.Popen([sys.executable, "-c", READER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        read = int(reader.stdout.readline() or 0)
        assert read, reader.stderr.read()
        write_gguf(gguf_path, tiny_llama(True, seed=1))  # the package upgraded
        os.utime(gguf_path, ns=(1, 1))  # a different mtime even on coarse clocks
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", EmbeddedModel("fake-pkg", "fastspec_fake_pkg",
                                                                            "tiny.gguf", "org/tiny"))
        monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(cache))
        out = embedded_model_dir("fake")
        (aside,) = cache.glob(".fake.fastspec-old-*")
        assert (aside / "dir" / "model.safetensors").stat().st_ino == read  # the reader's files, whole
        assert (out / "model.safetensors").stat().st_ino != read and not abandoned(out)  # (this process reads it)
    finally:
        reader.communicate("")
    assert reader.returncode == 0
    convert_gguf(write_gguf(tmp_path / "b.gguf", tiny_llama(True, seed=2)), cache / "b")
    assert sorted(p.name for p in cache.iterdir()) == [".fastspec-convert.lock", "b", "fake"]
    torch.testing.assert_close(LlamaForCausalLM.from_pretrained(out).model.norm.weight,
                               tiny_llama(True, seed=1).model.norm.weight)


def test_a_fifo_named_as_a_leftover_does_not_hang_the_sweep(tmp_path):
    # a plain open of a FIFO blocks until a writer comes: the sweep must look at it without waiting (the thread's
    # join bound only turns a hang into a failure)
    fifo = tmp_path / ".model.fastspec-tmp-abcd1234"
    os.mkfifo(fifo)
    done = threading.Event()
    threading.Thread(target=lambda: (sweep(tmp_path), done.set()), daemon=True).start()
    assert done.wait(30), "sweep blocked opening a FIFO"
    assert not fifo.exists()  # (no process holds it: a leftover like any other)
