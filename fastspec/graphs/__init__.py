"""Static-shape graphs per batch-size bucket: CUDA graphs on GPU, fullgraph torch.compile on CPU, or eager.

The names are loaded on first use, so `fastspec.graphs.buckets` (the CLI's flag parsing) does not import torch."""

from fastspec.graphs.buckets import bucket_for, default_buckets, parse_buckets

_LAZY = {"configure_compile_caches": "fastspec.graphs.compile_cache", "BACKENDS": "fastspec.graphs.runner",
         "GraphRunner": "fastspec.graphs.runner", "StaticInput": "fastspec.graphs.runner",
         "size_varies": "fastspec.graphs.compile_backend", "GraphPlan": "fastspec.graphs.step_graphs",
         "StepGraphs": "fastspec.graphs.step_graphs"}

__all__ = ["BACKENDS", "GraphPlan", "GraphRunner", "StaticInput", "StepGraphs", "bucket_for",
           "configure_compile_caches", "default_buckets", "parse_buckets", "size_varies"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastspec.graphs' has no attribute {name!r}")
