"""Batch-size buckets for static-shape graphs: the default list, the `--cuda-graph-bs` parser, bucket lookup.

Owns: which batch sizes get a graph and which graph a batch of `bs` requests runs in (the smallest bucket
>= bs; the rows in between are padding). Does not own: the graphs themselves (runner.py).
"""

from bisect import bisect_left

from fastspec.errors import FastspecError


def default_buckets(max_bs: int) -> list[int]:
    """SGLang's speculative default, capped at `max_bs` (which is always included).

    E.g. max_bs=48 -> [1..8, 10, 12, ..., 32, 40, 44, 48]; max_bs=300 -> [..., 256, 272, 288, 300].
    """
    if max_bs < 1:
        raise FastspecError(f"the largest graph batch size must be >= 1, got {max_bs}")
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    return sorted({bs for bs in sizes if bs <= max_bs} | {max_bs})


def parse_buckets(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8]: comma-separated positive integers, sorted, duplicates dropped."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p.isdigit() for p in parts):
        raise FastspecError(f"graph batch sizes must be comma-separated positive integers, got '{text}'")
    sizes = sorted({int(p) for p in parts})
    if sizes[0] < 1:
        raise FastspecError(f"graph batch sizes must be >= 1, got '{text}'")
    return sizes


def bucket_for(buckets: list[int], bs: int) -> int:
    """Smallest bucket >= bs in the ascending list `buckets`; e.g. ([1, 2, 4, 8], 3) -> 4."""
    if bs < 1:
        raise FastspecError(f"batch size must be >= 1, got {bs}")
    i = bisect_left(buckets, bs)
    if i == len(buckets):
        raise FastspecError(f"batch size {bs} exceeds the largest graph batch size {buckets[-1]}")
    return buckets[i]
