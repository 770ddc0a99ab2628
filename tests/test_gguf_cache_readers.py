"""A reader of the conversion cache (an embedded model, a .gguf path, a .gguf file's tokenizer alone) holds the very
conversion it checked: another version's conversion published between its check and its hold is neither read nor
left unheld. Oracles: tiny random models written to GGUF (tests/gguf_writers.py), the conversion's marker
(is_current_conversion) and the reader's flock (shared_dirs.abandoned)."""

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from gguf_writers import tiny_llama, write_gguf

from fastspec.models import embedded
from fastspec.models.embedded import EmbeddedModel, embedded_model_dir
from fastspec.models.gguf import TOKENIZER_ONLY, convert_gguf, is_current_conversion, write_gguf_tokenizer
from fastspec.models.sources import resolve_model_dir, resolve_tokenizer_dir
from fastspec.utils import shared_dirs
from fastspec.utils.shared_dirs import abandoned


def reader(kind: str, tmp_path: Path, monkeypatch):
    """(the GGUF file, a function resolving it as `kind` reads it) with the models' cache in tmp_path."""
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    if kind != "embedded":
        path = write_gguf(tmp_path / "m.gguf", tiny_llama(True, seed=0))
        if kind == "tokenizer":
            return path, lambda: resolve_tokenizer_dir(str(path), 1000)
        return path, lambda: resolve_model_dir(str(path))
    package = tmp_path / "site" / "fastspec_fake_pkg"
    package.mkdir(parents=True)
    path = write_gguf(package / "tiny.gguf", tiny_llama(True, seed=0))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", EmbeddedModel("fake-pkg", "fastspec_fake_pkg", "tiny.gguf",
                                                                        "org/tiny"))
    return path, lambda: embedded_model_dir("fake")


def publish_before_the_lock(monkeypatch, other: Path, out: Path) -> list:
    """Another process publishes `other` (another version's conversion) at `out` just before this process next takes
    the lock of `out`'s folder (where a reader holds it), once; returns a list that says whether it did."""
    real, fired = shared_dirs.locked, []

    @contextmanager
    def locked(directory: Path):
        if not fired and directory == out.parent:
            fired.append(out)
            shared_dirs.publish(other, out, lambda d: False)  # (its own lock: `fired` is set)
        with real(directory):
            yield

    monkeypatch.setattr(shared_dirs, "locked", locked)
    return fired


@pytest.mark.parametrize("kind", ["embedded", "gguf", "tokenizer"])
def test_a_reader_holds_the_conversion_it_checked(kind, tmp_path, monkeypatch):
    """A reader checked that the conversion was current, then held whatever was there: another version's conversion
    (another fastspec, package or file sharing the cache) published between the two was read as if checked (and a
    .gguf file's tokenizer-only conversion was never held, so a republish could delete it under its reader). Now the
    check is made under the hold: the reader converts again and holds its own conversion."""
    path, resolve = reader(kind, tmp_path, monkeypatch)
    out = resolve()
    dtype = TOKENIZER_ONLY if kind == "tokenizer" else "float32"
    other_gguf = write_gguf(tmp_path / "other.gguf", tiny_llama(True, seed=1))
    write = write_gguf_tokenizer if kind == "tokenizer" else convert_gguf
    other = write(other_gguf, tmp_path / "elsewhere" / "other")
    fired = publish_before_the_lock(monkeypatch, other, out)
    assert resolve() == out and fired == [out]
    assert is_current_conversion(out, path, dtype)  # its own conversion, not the one published meanwhile
    assert not abandoned(out)  # (held by this process: a replacement leaves its files in place)


@pytest.mark.parametrize("when", ["before_the_hold", "while_converting"])
@pytest.mark.parametrize("kind", ["gguf", "tokenizer"])
def test_a_gguf_files_conversion_is_named_for_the_version_it_holds(kind, when, tmp_path, monkeypatch):
    """A .gguf path's conversion is named by the file's size and time (conversion_name), and that name was taken
    before the hold under which the conversion is checked: a file rewritten between the two was converted into the
    earlier version's name, a directory whose name says one version and whose files are another's (the next start,
    naming the file as it is now, converted it again beside it). Now the name is taken again under the hold; a
    conversion the file was rewritten under (its files the earlier version's, its marker the new one's: never read,
    its name is not the file's now) is removed by the conversion after it."""
    from fastspec.models import gguf as gguf_mod
    from fastspec.models.gguf import conversion_name, read_marker

    path, resolve = reader(kind, tmp_path, monkeypatch)
    rewritten = []

    def rewriting(real):  # `real`, after the file was rewritten, once
        def call(*args):
            if not rewritten:
                rewritten.append(write_gguf(path, tiny_llama(True, seed=1)))
                os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
            return real(*args)
        return call

    name = {"before_the_hold": "hold_for_reading", "while_converting": "_write_tokenizer"}[when]
    monkeypatch.setattr(gguf_mod, name, rewriting(getattr(gguf_mod, name)))
    out = resolve()
    dtype = TOKENIZER_ONLY if kind == "tokenizer" else "float32"
    assert rewritten and out.name == conversion_name(path) and is_current_conversion(out, path, dtype)
    for entry in out.parent.glob("[!.]*"):  # every conversion there is named for the version it holds
        marker = read_marker(entry)
        assert (marker["size"], marker["mtime_ns"]) == (path.stat().st_size, 1) and entry.name == out.name
    assert resolve() == out  # (not converted again)
