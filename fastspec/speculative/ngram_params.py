"""NGRAM's flags (SGLang's speculative_ngram_*), checked: kept apart from the trie so that checking them imports
no torch."""

from __future__ import annotations

from dataclasses import dataclass

from fastspec.errors import FastspecError

MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramParams:
    """SGLang's speculative_ngram_* flags. Windows are n-gram lengths matched against the context's tail;
    branch_length is the longest trie path (window + proposal); breadths bound children per tree level."""

    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"     # "BFS": breadth-limited BFS | "PROB": best-first by path probability
    branch_length: int = 18
    capacity: int = 1_000_000   # max trie nodes per cache; the least recently seen n-grams are evicted beyond it

    def __post_init__(self):
        checks = (
            (self.min_match_window_size >= 1, "ngram min_match_window_size must be >= 1"),
            (self.min_match_window_size <= self.max_match_window_size,
             "ngram min_match_window_size must be <= max_match_window_size"),
            (self.max_match_window_size < self.branch_length,
             "ngram max_match_window_size must be < branch_length (a matched window needs room to continue)"),
            (self.min_bfs_breadth >= 1, "ngram min_bfs_breadth must be >= 1"),
            (self.min_bfs_breadth <= self.max_bfs_breadth, "ngram min_bfs_breadth must be <= max_bfs_breadth"),
            (self.match_type in MATCH_TYPES, f"ngram match_type must be one of {', '.join(MATCH_TYPES)}"),
            (self.capacity >= self.branch_length, "ngram capacity must be >= branch_length"),
        )
        for ok, message in checks:
            if not ok:
                raise FastspecError(f"{message} (got {self})")

    @property
    def bfs_breadth_scale(self) -> float:  # breadth lost per window size below the max and per tree level
        windows = self.max_match_window_size - self.min_match_window_size + 1
        return (self.max_bfs_breadth - self.min_bfs_breadth) / windows
