"""Static-shape graphs per batch-size bucket: CUDA graphs on GPU, fullgraph torch.compile on CPU, or eager."""

from fastspec.graphs.buckets import bucket_for, default_buckets, parse_buckets
from fastspec.graphs.compile_cache import configure_compile_caches
from fastspec.graphs.runner import BACKENDS, GraphRunner, StaticInput, size_varies

__all__ = ["BACKENDS", "GraphRunner", "StaticInput", "bucket_for", "configure_compile_caches", "default_buckets",
           "parse_buckets", "size_varies"]
