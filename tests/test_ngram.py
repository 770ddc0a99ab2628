"""fastspec.speculative.ngram: hand-worked proposals (chain, frequency-ordered branches, window fallback,
breadth limits, PROB order), eviction, the drafter feeding tree_from_parents / verify_greedy, and hypothesis
properties against a brute-force oracle that recounts n-gram continuations straight from the history."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch
from ngram_helpers import cache_of, node_depths, occurs, trie_ngrams

from fastspec.cli.options import ModelOptions
from fastspec.errors import FastspecError
from fastspec.spec_config import NgramError, NgramParams, SpecConfig
from fastspec.speculative.ngram import NgramCache, NgramDrafter
from fastspec.speculative.tree import tree_from_parents, verify_greedy

# ---------------------------------------------------------------------------------------------------------
# Hand-worked proposals
# ---------------------------------------------------------------------------------------------------------

def test_repeated_phrase_proposes_its_continuation_as_a_chain():
    # defaults: windows 12..1, scale = 9/12. Windows 10..4 end the history (no children); [1 2 3] occurred
    # at 0 followed by 4 5 9 9 1 2 3; its breadth (12-3)*.75+1 = 7.75 still yields one child per level
    history = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert cache_of(history).match(history, 5) == ([4, 5, 9, 9], [0, 1, 2, 3])
    assert cache_of(history).match(history, 12) == ([4, 5, 9, 9, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6])


def test_two_continuations_branch_more_frequent_first():
    # B = 4, windows 2..1, breadths 1..4: scale = 3/2. [1 2] -> 3 (twice) | 4 (once).
    # w=2, breadth 1: 3 (pos 1) -> 7 (pos 2); [1 2 3 7] is 4 deep = B, no children.
    # w=1 [2], breadth 2.5 -> 2: 3 (merged into 1), 4 (pos 3); then breadth 1: [2 3] -> 7 (merged into 2),
    # [2 4] -> 8 (pos 4); then [2 3 7] -> 1 (pos 5), [2 4 8] -> 1 (pos 6)
    history = [1, 2, 3, 7, 1, 2, 4, 8, 1, 2, 3, 7, 1, 2]
    params = dict(max_match_window_size=2, max_bfs_breadth=4, branch_length=4)
    assert cache_of(history, **params).match(history, 8) == ([3, 7, 4, 8, 1, 1], [0, 1, 0, 3, 2, 4])
    assert cache_of(history, **params).match(history, 4) == ([3, 7, 4], [0, 1, 0])


def test_equal_frequency_prefers_the_latest_continuation():
    history = [5, 6, 5, 7, 5]  # [5] -> 6 (at 1), 7 (at 3): equal counts, 7 is more recent
    params = dict(max_match_window_size=1, min_bfs_breadth=2, max_bfs_breadth=2, branch_length=2)
    assert cache_of(history, **params).match(history, 12) == ([7, 6], [0, 0])


def test_recency_is_the_latest_occurrence_not_the_first():
    history = [9, 1, 9, 2, 9, 2, 9, 1, 9]  # [9] -> 1 (at 1, 7), 2 (at 3, 5): equal counts, 1 seen last
    params = dict(max_match_window_size=1, min_bfs_breadth=2, max_bfs_breadth=2, branch_length=2)
    assert cache_of(history, **params).match(history, 3) == ([1, 2], [0, 0])


def test_longest_matching_window_wins():
    # [3] is followed by 8 three times and by 9 once, but only after [1 2 3], which the context ends with
    history = [1, 2, 3, 9, 3, 8, 3, 8, 3, 8, 1, 2, 3]
    params = dict(max_match_window_size=3, min_bfs_breadth=1, max_bfs_breadth=1, branch_length=6)
    assert cache_of(history, **params).match(history, 2) == ([9], [0])
    assert cache_of(history, **params).match(history, 3) == ([9, 3], [0, 1])
    short = dict(params, max_match_window_size=1)
    assert cache_of(history, **short).match(history, 2) == ([8], [0])
    assert cache_of(history, **params).match([4, 3], 2) == ([8], [0])  # [4 3] never occurred: falls back to [3]


def test_breadth_shrinks_with_window_size_and_depth():
    # [0] -> 5, 4, 3, 2, 1 (once each, latest first). Windows 2..1, breadths 1..5: scale 2.
    # w=2 [5 0] only ends the history; w=1: breadth (2-1)*2+1 = 3 -> 5 4 3, then breadth 1 per node
    history = [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0]
    params = dict(max_match_window_size=2, min_bfs_breadth=1, max_bfs_breadth=5, branch_length=3)
    assert cache_of(history, **params).match(history, 12) == ([5, 4, 3, 0, 0, 0], [0, 0, 0, 1, 2, 3])
    flat = dict(params, min_bfs_breadth=2, max_bfs_breadth=2)  # scale 0: breadth 2 everywhere
    assert cache_of(history, **flat).match(history, 12) == ([5, 4, 0, 0], [0, 0, 1, 2])
    # [2] -> 3 only (breadth 3); [2 3] -> 1 (latest), 2 but breadth is down to 1: only 1
    history = [2, 3, 2, 3, 1, 2]
    assert cache_of(history, **params).match(history, 4) == ([3, 1], [0, 1])


def test_prob_mode_is_best_first_by_path_probability():
    # [5] -> 1 (3 of 4) -> 2 -> 3 (certain), [5] -> 9 (1 of 4): PROB goes deep first, BFS level by level
    history = [5, 1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 3, 5, 9, 5]
    params = dict(max_match_window_size=1, min_bfs_breadth=2, max_bfs_breadth=2, branch_length=4)
    assert cache_of(history, match_type="PROB", **params).match(history, 4) == ([1, 2, 3], [0, 1, 2])
    assert cache_of(history, match_type="PROB", **params).match(history, 5) == ([1, 2, 3, 9], [0, 1, 2, 0])
    assert cache_of(history, match_type="BFS", **params).match(history, 4) == ([1, 9, 2], [0, 0, 1])
    # [2] -> 2 (twice) p 2/3, 1 (once) p 1/3; [2 2] -> 2 (its only child): 2/3 * 1 beats the sibling's 1/3
    history = [2, 1, 0, 2, 2, 2]
    assert cache_of(history, match_type="PROB", **params).match(history, 4) == ([2, 2, 1], [0, 1, 0])


def test_eviction_bounds_the_trie_and_forgets_the_oldest_ngrams():
    rng = random.Random(0)
    history = [200, 201, 202] + [rng.randrange(50) for _ in range(300)] + [100, 101, 102, 103, 104]
    params = dict(max_match_window_size=2, branch_length=4)
    bounded = NgramCache(NgramParams(capacity=60, **params))
    for end in range(1, len(history) + 1, 7):
        bounded.insert(history[:end])
        assert bounded.num_nodes <= 60
    bounded.insert(history)
    assert bounded.num_nodes <= 60
    unbounded = cache_of(history, **params)
    assert unbounded.num_nodes > 600
    assert unbounded.match([200], 3)[0] == [201, 202]
    assert bounded.match([200], 3) == ([], [])                        # the oldest n-grams are gone
    assert bounded.match([7, 100], 4)[0] == [101, 102, 103]          # the newest are kept


def test_tiny_capacity_keeps_only_ngrams_of_the_history():
    rng = random.Random(1)
    history = [rng.randrange(3) for _ in range(120)]
    cache = NgramCache(NgramParams(max_match_window_size=2, branch_length=5, capacity=6))
    for end in range(len(history) + 1):  # one token per round: the growing suffixes get evicted too
        cache.insert(history[:end])
        grams = trie_ngrams(cache)
        assert len(grams) == cache.num_nodes <= 6
        assert all(occurs(gram, history[:end]) for gram in grams)


BAD_PARAMS = [
    dict(min_match_window_size=0), dict(min_match_window_size=5, max_match_window_size=4),
    dict(max_match_window_size=18), dict(min_bfs_breadth=0), dict(min_bfs_breadth=3, max_bfs_breadth=2),
    dict(match_type="DFS"), dict(capacity=17)]
FIELDS = "|".join(f.name for f in dataclasses.fields(NgramParams))


@pytest.mark.parametrize("bad", BAD_PARAMS)
def test_params_are_validated(bad):
    # named as LLM(ngram={...}) takes them, each field the message names "ngram <field>", the refused one with its
    # value: "ngram min_match_window_size=5 must be <= ngram max_match_window_size=4"
    field, value = next(iter(bad.items()))
    with pytest.raises(FastspecError, match=f"^ngram {field}={re.escape(repr(value))} must be ") as refused:
        NgramParams(**bad)
    message = str(refused.value)
    assert not re.search(f"(?<!ngram )\\b({FIELDS})\\b", message) and message.count("(") <= 1, message


@pytest.mark.parametrize("bad", BAD_PARAMS)
def test_cli_names_each_field_by_its_flag(bad):
    # "--speculative-ngram-min-match-window-size 5 must be <= --speculative-ngram-max-match-window-size 4":
    # every field the message names is a flag, none an LLM key nor a half-renamed one ("max-match-window-size")
    field, value = next(iter(bad.items()))
    options = ModelOptions(speculative_algorithm="NGRAM", **{f"speculative_ngram_{k}": v for k, v in bad.items()})
    with pytest.raises(FastspecError) as refused:
        options.llm_kwargs()
    message = str(refused.value)
    assert message.startswith(f"--speculative-ngram-{field.replace('_', '-')} {value} must be "), message
    named = re.findall(f"(--speculative-ngram-)?\\b({FIELDS.replace('_', '[-_]')})\\b", message)
    assert named and all(flag for flag, _ in named) and "_" not in message, message
    assert "ngram " not in message and message.count("(") <= 1, message


def test_window_order_names_both_windows_with_their_values():
    with pytest.raises(FastspecError) as refused:
        NgramParams(min_match_window_size=5, max_match_window_size=4)
    assert str(refused.value) == "ngram min_match_window_size=5 must be <= ngram max_match_window_size=4"
    options = ModelOptions(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                           speculative_ngram_max_match_window_size=4)
    with pytest.raises(FastspecError) as refused:
        options.llm_kwargs()
    assert str(refused.value) == ("--speculative-ngram-min-match-window-size 5 must be <= "
                                  "--speculative-ngram-max-match-window-size 4")


def test_a_refused_value_is_quoted_as_given():
    # (braces in a value typed are the value's, never a field's placeholder)
    with pytest.raises(FastspecError, match="^ngram match_type='{capacity}' must be one of BFS, PROB$"):
        NgramParams(match_type="{capacity}")


@pytest.mark.parametrize("bad", [dict(capacity="17"), dict(capacity=2.0), dict(min_bfs_breadth=True),
                                 dict(max_match_window_size=None), dict(match_type=1)])
def test_a_field_of_another_type_is_refused_by_name(bad):
    # (LLM(ngram={...}) passes what its caller wrote: "17" is never compared, 2.0 nor True taken for a count)
    (field, value), = bad.items()
    with pytest.raises(NgramError) as refused:
        NgramParams(**bad)
    kind = "a string" if field == "match_type" else "an integer"
    assert str(refused.value) == f"ngram {field}={value!r} must be {kind}"


@pytest.mark.parametrize("key, hint", [("max_bfs_bredth", "did you mean max_bfs_breadth?"),
                                       ("nope", "its keys are min_match_window_size, max_match_window_size, ")])
def test_an_unknown_ngram_key_is_refused_by_name(key, hint):
    with pytest.raises(FastspecError) as refused:
        SpecConfig.resolve("NGRAM", "LlamaForCausalLM", ngram={"max_bfs_breadth": 2, key: 3})
    assert str(refused.value).startswith(f"ngram has no key {key!r}; {hint}")


# ---------------------------------------------------------------------------------------------------------
# The drafter: padding, the DraftTree it feeds, errors
# ---------------------------------------------------------------------------------------------------------

def test_drafter_pads_and_feeds_tree_from_parents():
    drafter = NgramDrafter(NgramParams(max_match_window_size=3, branch_length=8), num_draft_tokens=5)
    histories = {10: [1, 2, 3, 4, 5, 9, 9, 1, 2, 3], 11: [7, 8]}
    for rid, history in histories.items():
        drafter.update(rid, history)
    tokens, parents = drafter.propose([10, 11], list(histories.values()))
    assert tokens.dtype == parents.dtype == torch.int64
    assert tokens.tolist() == [[4, 5, 9, 9], [0, 0, 0, 0]]  # request 11 has no match: pads under the root
    assert parents.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0]]
    assert drafter.num_steps == 4

    seq_lens = torch.tensor([9, 1])  # the root (last token) is not in the KV cache yet
    tree = tree_from_parents(torch.tensor([3, 8]), tokens, parents, seq_lens, drafter.num_steps)
    expected = [seq_lens[b].item() + d for b in range(2) for d in node_depths(parents[b].tolist())]
    assert tree.positions.tolist() == expected
    assert tree.draft_tokens.tolist() == [[3, 4, 5, 9, 9], [8, 0, 0, 0, 0]]

    logits = torch.zeros(10, 16)
    for row, nxt in enumerate([4, 5, 9, 9, 11]):  # request 0: the target continues the chain, then emits 11
        logits[row, nxt] = 1.0
    logits[5, 7] = 1.0                             # request 1: the target emits 7 after the root
    result = verify_greedy(tree, logits)
    assert result.accept_len.tolist() == [4, 0]
    assert result.emitted[0].tolist() == [4, 5, 9, 9, 11]
    assert result.bonus_token.tolist() == [11, 7]


def test_drafter_errors_and_release():
    drafter = NgramDrafter(NgramParams(), num_draft_tokens=4)
    with pytest.raises(FastspecError):
        NgramDrafter(NgramParams(), num_draft_tokens=1)
    drafter.update(1, [1, 2, 1, 2])
    assert drafter.propose([1], [[1, 2, 1, 2]])[0].tolist() == [[1, 2, 0]]
    with pytest.raises(ValueError):
        drafter.update(1, [1, 2])           # histories only grow
    with pytest.raises(ValueError):
        drafter.update(1, [1, 2, 1, 2, -3])  # token ids are non-negative
    drafter.release(1)
    with pytest.raises(ValueError):
        drafter.propose([1], [[1, 2]])
    tokens, parents = drafter.propose([], [])
    assert tokens.shape == parents.shape == (0, 3)
