"""NgramCache test helpers shared by test_ngram.py and test_ngram_oracle.py."""

from __future__ import annotations

from fastspec.spec_config import NgramParams
from fastspec.speculative.ngram import NgramCache


def cache_of(history: list[int], **params) -> NgramCache:
    cache = NgramCache(NgramParams(**params))
    cache.insert(history)
    return cache


def trie_ngrams(cache: NgramCache) -> list[list[int]]:
    """Every live node's n-gram, rebuilt from the parent links (white-box)."""
    grams = []
    for node in cache._edges.values():
        gram = []
        while node and len(gram) <= cache.params.branch_length:  # bounded: a corrupt trie may hold a cycle
            gram.append(cache._token[node])
            node = cache._parent[node]
        assert node == 0, "a node's parent chain does not reach the root within branch_length steps"
        grams.append(gram[::-1])
    return grams


def node_depths(parents: list[int]) -> list[int]:
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth


def occurs(sequence: list[int], history: list[int]) -> bool:
    return any(history[i:i + len(sequence)] == sequence for i in range(len(history) - len(sequence) + 1))
