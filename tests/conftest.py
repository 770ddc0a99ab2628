"""Shared fixtures: tiny random Hugging Face model directories and a paged-pool runner for fastspec models.

The tiny models are real transformers models with random weights saved with `save_pretrained`, so
transformers' own implementation is the oracle for logits. Everything here runs on CPU in seconds.

Speed (`make test` runs the suite on two cores in two processes, pytest-xdist): each process takes its share of
the cores for torch (two threads each beside a busy core run small ops many times slower); Inductor compiles
scalar C++ kernels (TORCHINDUCTOR_VEC_ISA_OK=0, about 40% less compile time; test_graph_cache compiles vectorized
ones, as a user's run does); memory goes back to the OS only when the process has grown (a full collection per
test cost ~0.6 s, a third of the suite).
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # before torch reads it; inherited by the CLI subprocesses
os.environ["FASTSPEC_GRAPH_FALLBACK"] = "0"  # a graph that fails to compile fails its test (users get eager kernels)
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter (read when a kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from gpu_marker import pytest_collection_modifyitems  # noqa: F401  (skips @pytest.mark.gpu without CUDA)
from tiny_models import FAMILIES, make_hf_model  # noqa: F401  (tests import them from here)

from fastspec.attention import AttentionContext, TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.kernels.cpu_linear import trim_host_heap
from fastspec.memory import KVPool, ReqToTokenTable, make_allocator
from fastspec.memory.state_pool import StatePool
from fastspec.models.embedded import cache_root
from fastspec.models.heads import write_random_head


def _isolate_caches() -> tuple[Path, Path]:
    """Point every cache the suite can touch (fastspec's: tuned files, chats, converted models, compiled graphs;
    the Hugging Face hub cache, offline; and any other tool's under $XDG_CACHE_HOME) at a fresh directory of the
    suite's own, removed at exit, so the user's cache can neither change a result nor be changed. Runs at import,
    before any test (fastspec and torch read these variables when they use a cache, not at import).

    The one explicit exception: FASTSPEC_TEST_SHARED_CACHE=DIR keeps the converted models and Inductor's compiled
    graphs (read-only, keyed by their sources) in DIR between runs. Returns (the user's cache, the suite's)."""
    user = cache_root()
    own = Path(tempfile.mkdtemp(prefix="fastspec-test-cache-"))
    atexit.register(shutil.rmtree, own, ignore_errors=True)
    shared = os.environ.get("FASTSPEC_TEST_SHARED_CACHE")
    if shared and Path(shared).expanduser().resolve() in (user.resolve(), *user.resolve().parents):
        raise pytest.UsageError(f"FASTSPEC_TEST_SHARED_CACHE={shared} holds your own fastspec cache {user}; "
                                "give the tests a directory of their own")
    keep = Path(shared).expanduser() if shared else own
    os.environ.update(FASTSPEC_CACHE=str(own / "fastspec"), XDG_CACHE_HOME=str(own),
                      FASTSPEC_MODEL_CACHE=str(keep / "models"), TORCHINDUCTOR_CACHE_DIR=str(keep / "inductor"),
                      TRITON_CACHE_DIR=str(keep / "triton"), HF_HOME=str(own / "huggingface"),
                      HF_HUB_CACHE=str(own / "huggingface" / "hub"), HF_HUB_OFFLINE="1")
    return user, own


USER_CACHE, SUITE_CACHE = _isolate_caches()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # processes sharing the cores (pytest -n)
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))
os.environ["FASTSPEC_THREADS"] = str(torch.get_num_threads())  # CLI commands run in-process: keep the suite's count

RELEASE_GROWTH = 512 << 20  # bytes of resident growth after which a test's teardown hands memory back


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_resident_after_release = [0]


@pytest.fixture(autouse=True)
def _release_memory():
    """After a test that grew the process, hand freed memory back to the OS. Many tests build an engine over the
    embedded model (~3 GB with its prepacked weights); glibc keeps freed blocks in its heap (its mmap threshold
    grows after the first large free), so without a trim the suite's resident memory only grows and CI runs out
    of it. A full collection costs ~0.6 s in a process this size, so it runs only after RELEASE_GROWTH."""
    yield
    if sys.platform != "linux" or resident_bytes() > _resident_after_release[0] + RELEASE_GROWTH:
        gc.collect()
        trim_host_heap()
        if sys.platform == "linux":
            _resident_after_release[0] = resident_bytes()

@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> (directory, transformers model) for every target family."""
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        model = make_hf_model(family)
        model.save_pretrained(d)
        out[family] = (d, model)
    return out


class PoolRunner:
    """Runs a fastspec model over a static paged KV pool: prefill chunks and one-token decode steps."""

    def __init__(self, model, page_size: int = 1, capacity: int = 1024, max_requests: int = 8, max_len: int = 256,
                 kv_dtype: torch.dtype | None = None, kv_scales=None):
        c = model.config
        self.model, self.page_size = model, page_size
        dtype = kv_dtype or next(model.parameters()).dtype
        layers, heads, dim, separate_v = c.kv_layout
        self.pool = KVPool(layers, heads, dim, capacity, page_size, dtype, separate_v=separate_v, scales=kv_scales)
        self.allocator = make_allocator(self.pool.capacity, page_size)
        self.table = ReqToTokenTable(max_requests, max_len)
        self.backend = TorchAttnBackend()
        self.rows = [self.table.alloc() for _ in range(max_requests)]
        self.states = StatePool(c.hybrid, max_requests, 0) if c.hybrid is not None else None

    def extend(self, seq_lens: list[int], chunks: list[list[int]]):
        """Append chunks[b] to request b (which holds seq_lens[b] tokens). Returns the model output."""
        rows = torch.tensor(self.rows[: len(chunks)])
        prefix = torch.tensor(seq_lens)
        lens = torch.tensor([len(c) for c in chunks])
        last_loc = torch.where(prefix > 0, self.table.table[rows, (prefix - 1).clamp(min=0)].long(), -1)
        slots = self.allocator.alloc_extend(prefix, prefix + lens, last_loc)
        self.table.write(rows, prefix, lens, slots)
        if bool((lens == 1).all()) and bool((prefix > 0).all()):
            meta = decode_metadata(self.table.table, rows, prefix + 1)
        else:
            meta = extend_metadata(self.table.table, rows, prefix, lens)
        ids = torch.tensor([t for c in chunks for t in c])
        positions = torch.cat([torch.arange(p, p + len(c)) for p, c in zip(seq_lens, chunks)])
        states = None
        if self.states is not None:  # a hybrid model: its linear layers read and advance the rows' states
            self.states.reset(rows[prefix == 0])
            states = self.states.view(rows, lens=tuple(len(c) for c in chunks))
        with torch.inference_mode():
            return self.model(ids, positions, AttentionContext.build(self.backend, meta, self.pool, states))


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct, converted once per run into the suite's own cache."""
    from fastspec.models.embedded import embedded_model_dir

    return embedded_model_dir()


@pytest.fixture(scope="session")
def draft_dirs(tiny_dirs, tmp_path_factory):
    """family -> {"eagle": dir, "eagle3": dir, "standalone": dir (a different random model)}."""
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        _, hf = tiny_dirs[family]
        root = tmp_path_factory.mktemp(f"drafts-{family}")
        other = make_hf_model("llama", seed=5, num_hidden_layers=1)
        other.save_pretrained(root / "standalone")
        c = hf.config
        out[family] = {"eagle": write_random_head(root / "eagle", c.hidden_size, c.vocab_size, "eagle"),
                       "eagle3": write_random_head(root / "eagle3", c.hidden_size, c.vocab_size, "eagle3"),
                       "standalone": root / "standalone"}
    return out


def all_slots_free(engine) -> bool:
    """Nothing leaked: the KV the prefix cache holds accounts for every slot not free (check_kv), and once the
    cache hands its entries back every slot is free."""
    engine.check_kv()
    engine.flush_cache()
    return engine.allocator.num_free() == engine.pool.capacity


def hf_greedy(hf, prompt, new):
    """A transformers model's `new` greedy tokens after `prompt`: the oracle of the greedy-equality tests."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(new):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(prompt):].tolist()
