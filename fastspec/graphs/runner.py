"""GraphRunner: one function with static shapes per batch-size bucket, run as a CUDA graph, compiled, or eager.

Owns: the static input buffers (sized for the largest bucket), padding a batch up to its bucket, the
`torch.compile(fullgraph=True, dynamic=False)` compile per bucket (Inductor fuses the function's kernels; a
successful fullgraph compile proves it has no host sync and no data-dependent Python control flow), CUDA-graph
capture of that compiled code and replay with one memory pool shared by all buckets (as SGLang: compiled without
Inductor's own cudagraphs, captured here), and Inductor's on-disk cache. Buckets are prepared by `prepare`: all
ahead, or each before its first run (StepGraphs). A size that differs between processes (a KV pool's capacity:
`size_varies`) is symbolic in the compiled graph, so Inductor's on-disk cache serves the next process.
Does not own: what the function computes (the draft loop, draft-extend and verify are handed in; this file knows
nothing about EAGLE, models or attention) nor tensors the function reads or writes by closure (KV pools), which
are never copied; the compile backend that refuses host syncs and `size_varies` live in compile_backend.
"""

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fastspec.errors import FastspecError
from fastspec.graphs.buckets import bucket_for
from fastspec.graphs.compile_backend import cause_line, inductor_without_host_sync
from fastspec.graphs.compile_cache import configure_compile_caches, renew_compile_cache

log = logging.getLogger(__name__)
BACKENDS = ("cuda", "compile", "eager")
CUDA_WARMUP_RUNS = 2  # eager runs on a side stream before capture (lazy init, cuBLAS workspaces, autotune)

Outputs = dict[str, Tensor] | tuple[Tensor, ...]
GraphFn = Callable[[dict[str, Tensor]], Outputs]


@dataclass(frozen=True)
class StaticInput:
    """One per-request input of a graph: its buffer holds `bs * rows_per_request` rows of `shape`."""

    name: str
    shape: tuple[int, ...]  # per-row trailing shape; the leading dim is bs * rows_per_request
    dtype: torch.dtype
    rows_per_request: int = 1
    pad_value: float | int = 0  # what padded rows hold, e.g. KV slot 0 = the dummy slot padded rows write to

    def rows(self, bs: int) -> int:
        return bs * self.rows_per_request


class GraphRunner:
    """Runs `fn(inputs) -> outputs` with static shapes: one CUDA graph / compiled callable per bucket.

    `fn` gets a dict of static buffer views with leading dim `bucket * rows_per_request`, must not keep or
    rebind them, and returns a dict or tuple of tensors whose leading dims are `bucket * rows` (each
    output's rows per request are inferred as leading dim // bucket; every output must be per-request).
    Outputs returned by `run` are views, not copies: on the cuda backend they live in graph-owned memory
    and are overwritten by the next replay of the same bucket; clone what must outlive the next `run`.
    """

    def __init__(self, name: str, fn: GraphFn, inputs: list[StaticInput], buckets: list[int], backend: str,
                 device: str | torch.device = "cpu", on_bucket: Callable[[str, int], None] | None = None,
                 fuse: bool | None = None, fallback: bool | None = None):
        """`on_bucket(name, bs)` is called before a bucket is prepared (a progress line). `fuse` (cuda): capture the
        Inductor-compiled function (default; FASTSPEC_FUSE=0 captures the eager kernels, to compare). `fallback`: a
        bucket whose compile fails runs its eager kernels instead (cuda: captured; compile: uncompiled) after one
        warning line naming the graph, the bucket and the reason (default; FASTSPEC_GRAPH_FALLBACK=0 raises instead,
        as the test suite does: there a failed compile is a defect to see, not to survive)."""
        if backend not in BACKENDS:
            raise FastspecError(f"unknown graph backend '{backend}' (known: {', '.join(BACKENDS)})")
        if backend == "cuda" and (torch.device(device).type != "cuda" or not torch.cuda.is_available()):
            raise FastspecError(f"graph '{name}': backend 'cuda' needs a CUDA device, got '{device}'")
        if not buckets or min(buckets) < 1:
            raise FastspecError(f"graph '{name}': batch-size buckets must be >= 1, got {buckets}")
        if len({spec.name for spec in inputs}) != len(inputs):
            raise FastspecError(f"graph '{name}': static input names must be unique")
        self.name, self.fn, self.inputs, self.backend = name, fn, list(inputs), backend
        self.buckets = sorted(set(buckets))
        self.device = torch.device(device)
        self.pool = None  # cuda: the memory pool every bucket's graph shares (made at the first capture)
        max_bs = self.buckets[-1]
        self.buffers = {s.name: torch.full((s.rows(max_bs), *s.shape), s.pad_value, dtype=s.dtype,
                                           device=self.device) for s in self.inputs}
        self._views = {bs: {s.name: self.buffers[s.name][: s.rows(bs)] for s in self.inputs} for bs in self.buckets}
        self.on_bucket = on_bucket
        self.fuse = backend == "compile" or (backend == "cuda" and (
            os.environ.get("FASTSPEC_FUSE", "1") != "0" if fuse is None else fuse))
        self.fallback = os.environ.get("FASTSPEC_GRAPH_FALLBACK", "1") != "0" if fallback is None else fallback
        self._compiled: dict[int, GraphFn] = {}  # bucket -> compiled fn
        self.prepare_seconds: dict[int, float] = {}  # bucket -> seconds its compile / capture took
        self._prepared: set[int] = set()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_outputs: dict[int, Outputs] = {}

    def bucket_for(self, bs: int) -> int:
        """Smallest bucket >= bs; FastspecError past the largest bucket."""
        return bucket_for(self.buckets, bs)

    def prepare(self, on_bucket: Callable[[str, int], None] | None = None, buckets: list[int] | None = None) -> None:
        """Compile and capture (cuda), or compile (compile) `buckets` (default: all) not prepared yet, largest first;
        eager has nothing to prepare.

        `on_bucket(name, bs)` (default: the constructor's) is called before each bucket. Largest first so the
        smaller graphs fit into the memory the larger ones already reserved in the shared pool.
        """
        if self.backend == "eager":
            return
        if self.fuse:
            configure_compile_caches()
        if self.backend == "cuda" and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        on_bucket = on_bucket or self.on_bucket
        todo = self.buckets if buckets is None else sorted({self.bucket_for(bs) for bs in buckets})
        for bs in reversed([bs for bs in todo if bs not in self._prepared]):
            if on_bucket is not None:
                on_bucket(self.name, bs)
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._slice_outputs(self._prepare_bucket(bs), bs, bs)
            except FastspecError:
                raise
            except Exception as e:  # a graph break, a host sync, a CUDA capture error, a shape error in fn...
                verb = "compile" if self.backend == "compile" else "capture"
                raise FastspecError(f"cannot {verb} graph '{self.name}' for batch bucket {bs}: {cause_line(e)}") from e
            self._prepared.add(bs)
            self.prepare_seconds[bs] = time.perf_counter() - start

    def prepared(self, bs: int) -> bool:
        """Whether bs's bucket runs without preparing first (always, eagerly)."""
        return self.backend == "eager" or self.bucket_for(bs) in self._prepared

    def run(self, bs: int, inputs: dict[str, Tensor]) -> Outputs:
        """Copy `inputs` (leading dim bs * rows_per_request) into the static buffers, pad, replay, slice to bs.

        The copies are non-blocking: a pinned host tensor in `inputs` must not be overwritten before the
        replay has run. The returned views are valid until the next `run` (see the class docstring).
        """
        bucket = self.bucket_for(bs)
        with torch.inference_mode():
            self._load(bs, bucket, inputs)
            return self._slice_outputs(self._call(bucket), bucket, bs)

    # ---- internals ----

    def _prepare_bucket(self, bs: int) -> Outputs:
        if self.fuse:
            try:
                outputs = self._compile_once_more_if_damaged(bs)
            except Exception as e:
                if not self.fallback:
                    raise
                log.warning("graph '%s', batch bucket %d: compiling failed (%s); using its eager kernels instead",
                            self.name, bs, cause_line(e))
                self._compiled[bs] = self.fn  # cuda: captured as they are; compile: run as they are
                self._reset(bs)
                outputs = self.fn(dict(self._views[bs])) if self.backend == "compile" else None
            if self.backend == "compile":
                return outputs
        return self._capture(bs)

    def _compile_once_more_if_damaged(self, bs: int) -> Outputs:
        try:
            return self._compile(bs)
        except Exception as e:
            if not renew_compile_cache(e):  # not a damaged on-disk entry, or the cache is already new
                raise
            return self._compile(bs)

    def _compile(self, bs: int) -> Outputs:
        """Compile for the bucket by running once (cuda: on a side stream, before capture)."""
        self._reset(bs)
        compiled = torch.compile(self.fn, backend=inductor_without_host_sync, fullgraph=True, dynamic=False)
        outputs = self._aside(lambda: compiled(dict(self._views[bs])))
        self._compiled[bs] = compiled
        return outputs

    def _capture(self, bs: int) -> Outputs:
        """Warm up on a side stream, then record one graph of the compiled (or eager) function over the bucket's
        buffer views into the shared pool."""
        views, fn = self._views[bs], self._compiled.get(bs, self.fn)

        def warm_up():
            for _ in range(CUDA_WARMUP_RUNS):
                self._reset(bs)  # fn may update its inputs in place; every run starts from the pad values
                fn(dict(views))
        self._aside(warm_up)
        self._reset(bs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(dict(views))
        self._graphs[bs], self._graph_outputs[bs] = graph, outputs
        return outputs

    def _aside(self, call: Callable[[], Outputs | None]) -> Outputs | None:
        """call() (cuda: on a side stream the current one then waits for, so warm-up runs stay off the capture
        stream)."""
        if self.backend != "cuda":
            return call()
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            outputs = call()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return outputs

    def _call(self, bucket: int) -> Outputs:
        if self.backend == "eager":
            return self.fn(dict(self._views[bucket]))
        if bucket not in self._prepared:
            raise FastspecError(f"graph '{self.name}' is not prepared for bucket {bucket}: call prepare() first")
        if self.backend == "compile":
            return self._compiled[bucket](dict(self._views[bucket]))
        self._graphs[bucket].replay()
        return self._graph_outputs[bucket]

    def _load(self, bs: int, bucket: int, inputs: dict[str, Tensor]) -> None:
        """Real rows [0, bs*rows) from `inputs`, padded rows [bs*rows, bucket*rows) = pad_value."""
        if inputs.keys() != self.buffers.keys():
            raise FastspecError(f"graph '{self.name}' takes inputs {sorted(self.buffers)}, got {sorted(inputs)}")
        for spec in self.inputs:
            src, buf = inputs[spec.name], self.buffers[spec.name]
            real, padded = spec.rows(bs), spec.rows(bucket)
            if src.shape != (real, *spec.shape):
                raise FastspecError(f"graph '{self.name}' input '{spec.name}' has shape {tuple(src.shape)}, "
                                    f"expected {(real, *spec.shape)} for batch size {bs}")
            buf[:real].copy_(src, non_blocking=True)
            if padded > real:
                buf[real:padded].fill_(spec.pad_value)

    def _reset(self, bs: int) -> None:
        """All rows of the bucket = pad_value (the state capture / compile runs start from)."""
        for spec in self.inputs:
            self.buffers[spec.name][: spec.rows(bs)].fill_(spec.pad_value)

    def _slice_outputs(self, outputs: Outputs, bucket: int, bs: int) -> Outputs:
        """Each output [bucket * rows, ...] -> its real rows [bs * rows, ...] (a view, no copy)."""
        def real_rows(key, t: Tensor) -> Tensor:
            if t.dim() == 0 or t.shape[0] % bucket:
                raise FastspecError(f"graph '{self.name}' output {key!r} of shape {tuple(t.shape)} is not "
                                    f"per-request (leading dim not a multiple of bucket {bucket})")
            return t[: t.shape[0] // bucket * bs]

        if isinstance(outputs, dict):
            return {k: real_rows(k, t) for k, t in outputs.items()}
        if isinstance(outputs, tuple):
            return tuple(real_rows(i, t) for i, t in enumerate(outputs))
        raise FastspecError(f"graph '{self.name}' must return a dict or tuple of tensors, got {type(outputs).__name__}")

