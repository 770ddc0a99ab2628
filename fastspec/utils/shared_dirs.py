"""How processes share a cache directory safely: the GGUF conversions (and a conversion's folder of packed weights),
the C kernels' builds.

Invariants:
- a finished conversion appears by one rename under its directory's lock (LOCK_FILE), and replaces only a directory
  that is not the conversion wanted: two processes converting one file at once keep the first one published, so a
  process reading it never sees it vanish;
- a directory or file being written (`.NAME.fastspec-tmp-*`, or what `held_temp` names) is held (flock) by its
  writer for as long as it exists: one whose lock can be taken belongs to a process that is gone (killed midway) and
  is removed by the next writer in that directory; where the file system has no locks, once older than STALE_AGE_S;
- a process reading a published directory holds it (`hold_for_reading`: a shared flock) until it exits; a replaced
  one is moved into `.NAME.fastspec-old-*` and removed by whoever sees it once no process holds it (where the file
  system has no locks, once older than STALE_AGE_S), so no reader's files vanish midway;
- an earlier fastspec's staging or replaced directory (`.NAME.tmp-*`, `.NAME.gguf-tmp-*`, `.NAME.old-*`,
  `.NAME.gguf-old-*`) is removed once older than STALE_AGE_S and held by no process, and only where the caller's `ours`
  proves it fastspec's (it, the conversion inside it or its destination NAME); the others stay (`sweep`).
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
# an earlier fastspec's mkdtemp names: .NAME.tmp-X / .NAME.gguf-tmp-X (staging), .NAME.old-X / .NAME.gguf-old-X
_EARLIER = re.compile(r"\.(?P<name>.+)\.(?:gguf-)?(?:tmp|(?P<old>old))-[a-z0-9_]{8}")
_READING: dict[tuple[Path, int], int] = {}  # (directory, inode) -> the fd holding it for this process's life


@contextmanager
def locked(directory: Path, name: str = LOCK_FILE) -> Iterator[None]:
    """`directory`'s lock (exclusive; the file `name` in it) held for the block; unlocked where the file system has
    none or the directory is read-only (its renames stay atomic either way)."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_CREAT, 0o644)  # (flock needs no write access)
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


def abandoned(path: Path, aged: Path | None = None) -> bool:
    """True when no process holds `path` (its writer's flock went with the writer, its readers' with them), or where
    locks are not supported, when `aged` (default `path`) is older than STALE_AGE_S. Call under the directory's lock
    (`locked`): writers and readers take their flocks under it, so none is caught between open and flock."""
    try:  # (O_NONBLOCK: a FIFO of a leftover's name would block a plain open until some process wrote to it)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # (gone already)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # its writer or a reader is alive
        return False
    except OSError:
        return _older_than(aged or path, STALE_AGE_S)
    finally:
        os.close(fd)


def _older_than(path: Path, age_s: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > age_s
    except OSError:
        return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep(directory: Path, pattern: re.Pattern = _LEFTOVER, ours: Callable[[Path], bool] | None = None) -> None:
    """Remove `directory`'s leftovers named by `pattern` that no process holds (its group `old` matched: a replaced
    conversion, held by its readers; else a temp entry, held by its writer), and with `ours` (whether a directory is,
    or was bound to be, one of the caller's) an earlier fastspec's abandoned staging and replaced directories (_EARLIER:
    `_earlier_abandoned`). Call under the directory's lock."""
    for entry in directory.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and (_unheld_old(entry) if match.groupdict().get("old") else abandoned(entry)):
            _remove(entry)
        elif ours and (earlier := _EARLIER.fullmatch(entry.name)) and _earlier_abandoned(entry, earlier, ours):
            _remove(entry)


def _unheld_old(aside: Path) -> bool:
    """True when no reader holds the conversion `move_aside` put in `aside` (or it never got there)."""
    inner = aside / "dir"
    return abandoned(inner, aged=aside) if inner.exists() else abandoned(aside)


def _earlier_abandoned(entry: Path, earlier: re.Match, ours: Callable[[Path], bool]) -> bool:
    """An earlier fastspec's staging or replaced directory `entry` (their writers held no lock, or one of another
    name: only a day's age tells them gone), held by no process now and proven the caller's by `ours`: the conversion
    in it (a replaced one's is in `dir`), else its destination NAME (a staging directory killed before it wrote its
    marker: a conversion there, or a name only the caller gives). What `ours` cannot prove stays: in a folder shared
    with other tools (FASTSPEC_MODEL_CACHE) a `.NAME.tmp-*` may be another tool's, still in use."""
    if not entry.is_dir() or entry.is_symlink() or not _older_than(entry, STALE_AGE_S):
        return False
    inner = entry / "dir" if earlier["old"] and (entry / "dir").is_dir() else entry
    return (ours(inner) or ours(entry.parent / earlier["name"])) and abandoned(inner, aged=entry)


@contextmanager
def staging(out_dir: Path, ours: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """A fresh private directory beside `out_dir` to write its conversion (or a C library's build) into, held by this
    process until the block ends and removed then unless `publish` renamed it; the leftovers of writers that are gone
    (and of readers, `sweep`; `ours`: whether a directory is one of the caller's) are removed first."""
    with locked(out_dir.parent):
        sweep(out_dir.parent, ours=ours)
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
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
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
    moved aside under the lock and deleted after it unless a reader holds it (`discard`)."""
    with locked(out_dir.parent):
        if current(out_dir):
            return False
        old = move_aside(out_dir) if out_dir.exists() else None
        os.replace(tmp, out_dir)
    if old is not None:
        discard(old)
    return True


def move_aside(entry: Path) -> Path:
    """Move the directory `entry` into a fresh `.NAME.fastspec-old-*` beside it (one rename: no reader sees half of it)
    and return that, for the caller to `discard`."""
    aside = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.fastspec-old-"))
    os.replace(entry, aside / "dir")
    return aside


def discard(aside: Path) -> None:
    """Remove what `move_aside` returned unless a process still reads it (`hold_for_reading`): a later `sweep` then
    removes it once that process is gone. (No lock needed: the aside path is new, so no reader can take it now.)"""
    if _unheld_old(aside):
        _remove(aside)


def hold_for_reading(directory: Path, current: Callable[[Path], bool] = lambda d: True) -> bool:
    """Hold the published `directory` (a shared flock) for the rest of this process, so that a replacement leaves its
    files in place while this process may read them (`discard`, `sweep`), when it is `current`: checked after the hold
    is taken, under the parent's lock (where `publish` replaces it), so the directory checked is the one held and the
    one the path names. False (nothing held) for a directory that is not current or cannot be opened; where it cannot
    be locked, whether it is current."""
    with locked(directory.parent):
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return False
        key = (directory, os.fstat(fd).st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (waits only for a writer between its publish and closing its hold)
        except OSError:  # (no locks here)
            os.close(fd)
            return current(directory)
        is_current = current(directory)
        if key in _READING or not is_current:  # (held already: one fd per directory and version)
            os.close(fd)  # (a flock belongs to its own fd: the one held before keeps it)
            return is_current
        _READING[key] = fd
        return True
