"""Structured output: JSON schema, regex and EBNF grammars, exact under speculation (llguidance).

Why llguidance and not xgrammar: one Rust wheel (abi3, every Python) with no dependencies, where xgrammar pulls
triton and a TVM FFI into a CPU install; JSON schema, regex and Lark grammars (GBNF, the EBNF of llama.cpp and
xgrammar, converts to Lark); token-level `rollback`; a mask for the 49k vocabulary in well under a millisecond on a CPU.

A request's `Grammar` is its matcher at its output so far; the worker advances it with every produced token.
Masks are applied to the target's logits at every position with the grammar state as of that position: a
plain round at the output so far, a verify node after the draft tokens on its own tree path (one walk per tree:
consume the path, mask, roll back), so greedy speculation under a grammar gives exactly the target-only tokens
and sampled speculation follows the masked target. EAGLE-family drafts are masked too: each draft step keeps
the top-k among the tokens the grammar allows after its path, renormalised, so a forced stretch (a JSON key, a
closing brace) is drafted with probability 1. A node whose path the grammar rejects (NGRAM drafts are copied
from the context unmasked; a draft step with fewer allowed tokens than top-k) gets no mask: its target parent
gives its token probability 0, so it is never accepted. Not done: jump-forward (forced tokens are drafted and
verified, never inserted unverified).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch

from fastspec.errors import BadField, FastspecError
from fastspec.sampling.params import KINDS
from fastspec.utils.transfer import to_device


def grammar_kind(params) -> str | None:
    """Which grammar field of a SamplingParams is set (at most one is: checked there)."""
    return next((k for k in KINDS if getattr(params, k) is not None), None)


class GrammarCompiler:
    """Builds each request's matcher for one model: the tokenizer's token bytes are read once, on first use."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_ids):
        self.tokenizer_dir, self.vocab_size, self.eos_ids = Path(tokenizer_dir), vocab_size, sorted(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer: Future | None = None  # llguidance's tokenizer, or the FastspecError it could not be built with

    @property
    def tokenizer(self):
        """llguidance's reading of the tokenizer, built once by its first caller: callers meanwhile (a server's
        first requests) wait for that build and share it; a tokenizer it cannot read is the same one-line
        FastspecError to every caller, never read again."""
        with self._lock:
            first = self._tokenizer is None
            if first:
                self._tokenizer = Future()
            future = self._tokenizer  # (read here: a failed build empties the attribute for the next caller)
        if first:
            try:
                future.set_result(self._read_tokenizer())
            except FastspecError as e:
                future.set_result(e)
            except BaseException as e:  # (a bug: the callers waiting hear it, and the next caller tries again)
                future.set_exception(e)
                with self._lock:
                    self._tokenizer = None
                raise
        built = future.result()
        if isinstance(built, FastspecError):
            raise FastspecError(str(built))
        return built

    def _read_tokenizer(self):
        import llguidance

        from fastspec.models.hub import read_tokenizer

        path = self.tokenizer_dir / "tokenizer.json"
        if not path.is_file():
            raise FastspecError(f"structured output needs the model's tokenizer ({path} does not exist)")
        try:
            return llguidance.LLTokenizer(read_tokenizer(path).to_str(), n_vocab=self.vocab_size,
                                          eos_token=self.eos_ids)
        except ValueError as e:
            raise FastspecError(f"{path}: structured output cannot use this tokenizer ({e})") from None

    def compile(self, params) -> Grammar | None:
        """The request's grammar at its start (None without one); a one-line BadField naming its field (`kind`) for
        a grammar that does not compile or that no token can start (a tokenizer it cannot read: a FastspecError)."""
        kind = grammar_kind(params)
        if kind is None:
            return None
        import llguidance

        source = getattr(params, kind)
        try:
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(source)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            elif kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(source)
            else:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(source))
        except Exception as e:  # the converters raise on malformed input; the matcher reports the rest
            raise BadField(f"invalid {kind.replace('_', ' ')}: {_brief(str(e))}", kind) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise BadField(f"invalid {kind.replace('_', ' ')}: {_brief(matcher.get_error())}", kind)
        state = Grammar(matcher, self.vocab_size, self.eos_ids)
        allowed = state.masks([[]])[0]
        allowed[self.eos_ids] = False  # llguidance offers EOS where no token can go on
        if not bool(allowed.any()):  # (accepting at once: only the empty output, e.g. `root ::= `; else none)
            what = "matches only the empty output" if matcher.is_accepting() else "allows no token to start the output"
            raise BadField(f"the {kind.replace('_', ' ')} {what}", kind)
        return state


class Grammar:
    """One request's matcher (llguidance.LLMatcher) at the request's output so far."""

    def __init__(self, matcher, vocab_size: int, eos_ids=()):
        self._m, self.vocab_size, self.eos_ids = matcher, vocab_size, list(eos_ids)
        self._words = (vocab_size + 31) // 32

    def advance(self, token: int) -> None:
        """Consume a produced token: it was sampled under this grammar's mask, so the grammar accepts it (or it is
        the EOS a dead end allows)."""
        if token in self.eos_ids and not self._m.is_accepting():
            return  # a dead end's EOS (masks): the output ends here, short of what the grammar wanted
        if not self._m.consume_token(token):
            raise AssertionError(f"grammar rejected produced token {token}: {self._m.get_error()}")

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """bool [len(paths), V]: the tokens allowed after each path (draft tokens after the output so far).
        A path the grammar rejects gets every token (its row belongs to a node that is never accepted)."""
        words = torch.full((len(paths), self._words), -1, dtype=torch.int32)
        m = self._m
        for i, path in enumerate(paths):
            if path and m.validate_tokens(path) < len(path):
                continue
            if path:
                m.consume_tokens(path)
            m.unsafe_compute_mask_ptr(words[i].data_ptr(), self._words * 4)
            if path:
                m.rollback(len(path))
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # bit j of word w = token 32w + j
        allowed = bits.view(len(paths), -1)[:, : self.vocab_size].bool()
        if self.eos_ids:
            for i in (allowed.sum(dim=1) <= 2).nonzero()[:, 0].tolist():
                self._dead_end(allowed[i], paths[i])
        return allowed

    def _dead_end(self, allowed: torch.Tensor, path: list[int]) -> None:
        """A row of one or two tokens may be a dead end: the grammar wants text no token writes (a space, for a
        tokenizer without one), and llguidance then offers a token it would refuse. Such a row gets EOS: the output
        ends there, short of the grammar, instead of failing the engine."""
        m = self._m
        if path and m.validate_tokens(path) < len(path):
            return
        m.consume_tokens(path)
        if not any(m.validate_tokens([t]) == 1 for t in allowed.nonzero()[:, 0].tolist()):
            allowed[:] = False
            allowed[self.eos_ids] = True
        if path:
            m.rollback(len(path))


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's draft tokens from below the root to itself (root: []); parents[i] < i, -1 for the root."""
    paths = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return paths


def verify_paths(tree) -> list[list[list[int]]]:
    """Per request of a DraftTree, each verify node's path (the draft tokens below the root down to it)."""
    from fastspec.models.recurrent import tree_parents

    return [tree_paths(t, p) for t, p in zip(tree.draft_tokens.tolist(), tree_parents(tree.tree_mask).tolist())]


def mask_logits(logits: torch.Tensor,  # [bs * n, V]  n positions per request
                grammars, paths: list[list[list[int]]]) -> torch.Tensor:  # per request, its n positions' paths
    """Disallowed tokens at -inf for the requests with a grammar (None: untouched)."""
    bs = len(grammars)
    n = logits.shape[0] // bs
    out = logits.clone()
    for b, g in enumerate(grammars):
        if g is not None:
            allowed = to_device(g.masks(paths[b]), logits.device)
            out[b * n:(b + 1) * n].masked_fill_(~allowed, -torch.inf)
    return out


def draft_masks(grammars, paths: torch.Tensor) -> torch.Tensor:
    """bool [R, V] for draft rows: R = bs * r rows (request b owns rows b*r..), paths int64 [R, depth]."""
    rows, bs = paths.shape[0], len(grammars)
    per = rows // bs
    host = paths.tolist()
    V = next(g for g in grammars if g is not None).vocab_size
    allowed = torch.ones(rows, V, dtype=torch.bool)
    for b, g in enumerate(grammars):
        if g is not None:
            allowed[b * per:(b + 1) * per] = g.masks(host[b * per:(b + 1) * per])
    return to_device(allowed, paths.device)


def _brief(message: str) -> str:
    """llguidance's messages span lines (a caret under the source): keep what names the error."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (lines[0] if lines else "unknown error") + (f" ({errors[0][6:].strip()})" if errors else "")
