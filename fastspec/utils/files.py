"""Files written whole or not at all, and files read or refused in one line.

A writer fills a private temporary file in the target's directory, syncs it, makes it an ordinary 0644 file and
then renames it over the target (`write_atomic`) or links it to the first name not taken (`write_new`, which never
overwrites): a reader or a crash sees the old file or the new one, never half of one; `write_directory` makes a new
directory of files the same way. `read_or_refuse` turns whatever a damaged file raises into one FastspecError naming
it. Knows nothing about what the files hold.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, TypeVar

from fastspec.errors import FastspecError, first_line

T = TypeVar("T")
Writer = Callable[[BinaryIO], object]  # fills an open binary file, e.g. lambda f: torch.save(obj, f)


def write_atomic(path: Path, write: Writer) -> None:
    """Replace `path` with what `write` writes."""
    tmp = _write_temp(Path(path).parent, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_new(directory: Path, names: Iterable[str], write: Writer) -> Path:
    """Write to the first of `names` in `directory` not taken yet; FileExistsError if every one is."""
    tmp = _write_temp(Path(directory), write)
    try:
        for name in names:
            try:
                os.link(tmp, Path(directory) / name)  # fails if the name is taken
                return Path(directory) / name
            except FileExistsError:
                continue
        raise FileExistsError(f"every name offered in {directory} is taken")
    finally:
        tmp.unlink()


def write_directory(directory: Path, files: dict[str, Writer]) -> None:
    """Make `directory` (absent or empty) holding `files` ({name: writer}), all of them or none: they are written
    into a hidden sibling that is then renamed to it, so a crash leaves no half-written directory behind."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        for name, write in files.items():
            os.replace(_write_temp(tmp, write), tmp / name)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        os.rename(tmp, directory)  # (POSIX: over an empty directory, or none)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_or_refuse(path: Path, read: Callable[[Path], T], hint: str) -> T:
    """read(path), or a FastspecError `<path> is damaged (<why>); <hint>` whatever the damage raised."""
    try:
        return read(path)
    except Exception as e:  # truncated archives, bad JSON, foreign pickles: each library raises its own kinds
        raise FastspecError(f"{path} is damaged ({first_line(e)}); {hint}") from None


def _write_temp(directory: Path, write: Writer) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the result is an ordinary file
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)

