"""How processes share a cache directory safely: the GGUF conversions (and a conversion's folder of packed weights),
the C kernels' builds.

Invariants:
- a finished conversion appears by one rename under its directory's lock (LOCK_FILE), and replaces only a directory
  that is not the conversion wanted: two processes converting one file at once keep the first one published, so a
  process reading it never sees it vanish;
- a directory or file being written (`.NAME.fastspec-tmp-*`, or what `held_temp` names) is held (flock) by its
  writer for as long as it exists: one whose lock can be taken belongs to a process that is gone (killed midway) and
  is removed by the next writer in that directory; where the file system has no locks, once older than STALE_AGE_S;
- `.NAME.fastspec-old-*` holds a replaced conversion on its way out and is removed by whoever sees it.
Does not own: what a conversion holds nor which one is current (models/gguf.py), what is built (kernels/).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

LOCK_FILE = ".fastspec-convert.lock"
STALE_AGE_S = 24 * 3600  # a temp entry this old is abandoned even where no lock can tell
_LEFTOVER = re.compile(r"\..+\.fastspec-(?:tmp|(?P<old>old))-[^/]+")  # .NAME.fastspec-tmp-X / .NAME.fastspec-old-X


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """`directory`'s lock (exclusive) held for the block; unlocked where the file system has none or the directory
    is read-only (its renames stay atomic either way)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o644)  # (flock needs no write access)
    except OSError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # (no locks on this file system)
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)


def abandoned(path: Path) -> bool:
    """True when no process holds `path` (its writer's flock went with the writer), or where locks are not
    supported, when it is older than STALE_AGE_S. Call under the directory's lock (`locked`): writers create and
    lock their entries under it, so none is caught between the two."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # (gone already)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # its writer is alive
        return False
    except OSError:
        return time.time() - os.fstat(fd).st_mtime > STALE_AGE_S
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep(directory: Path, pattern: re.Pattern = _LEFTOVER) -> None:
    """Remove `directory`'s leftovers named by `pattern` (its group `old` matched: a replaced conversion on its way
    out, always; else a temp entry, when `abandoned`). Call under the directory's lock."""
    for entry in directory.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and (match.groupdict().get("old") or abandoned(entry)):
            _remove(entry)


@contextmanager
def staging(out_dir: Path) -> Iterator[Path]:
    """A fresh private directory beside `out_dir` to write its conversion (or a C library's build) into, held by this
    process until the block ends and removed then unless `publish` renamed it; the leftovers of writers that are gone
    are removed first."""
    with locked(out_dir.parent):
        sweep(out_dir.parent)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.fastspec-tmp-"))
        fd = _hold(tmp)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (published: no longer there)
        if fd is not None:
            os.close(fd)


@contextmanager
def held_temp(directory: Path, prefix: str, pattern: re.Pattern) -> Iterator[Path]:
    """A fresh temp file in `directory` (named `prefix`*, which `pattern` matches), held by this process until the
    block ends and removed then unless renamed; `pattern`'s abandoned entries are removed first."""
    with locked(directory):
        sweep(directory, pattern)
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)
        os.close(fd)


def _hold(path: Path) -> int | None:
    """An fd of `path` holding its flock (None where it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (no locks here: the age rule applies to it)
        pass
    return fd


def publish(tmp: Path, out_dir: Path, current: Callable[[Path], bool]) -> bool:
    """Rename the finished `tmp` to `out_dir` unless `current(out_dir)` (the wanted conversion is already there,
    published meanwhile by another process that may be reading it: kept, and False returned). A replaced `out_dir` is
    moved aside under the lock and deleted after it."""
    with locked(out_dir.parent):
        if current(out_dir):
            return False
        old = move_aside(out_dir) if out_dir.exists() else None
        os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return True


def move_aside(entry: Path) -> Path:
    """Move the directory `entry` into a fresh `.NAME.fastspec-old-*` beside it (one rename: no reader sees half of it)
    and return that, for the caller to delete (sweep removes it otherwise)."""
    aside = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.fastspec-old-"))
    os.replace(entry, aside / "dir")
    return aside
