"""Frozen speculative-decoding configuration: the algorithm, the draft-tree shape (SGLang's auto rules, resolved
once by `SpecConfig.resolve`), NGRAM's trie parameters and the per-batch-size schedule `fastspec tune` writes.
Checks every flag that needs no model (`check_spec_flags`, `check_tree`); imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from numbers import Integral, Real

from fastspec.errors import FastspecError, OptionError, name_hint

SPEC_ALGORITHMS = ("NONE", "EAGLE", "EAGLE3", "STANDALONE", "NGRAM")
# SGLang's auto_choose_speculative_params: (num_steps, topk, num_draft_tokens) by target architecture
_AUTO_SPEC = {"LlamaForCausalLM": (5, 4, 8), "DeepseekV2ForCausalLM": (3, 1, 4), "DeepseekV3ForCausalLM": (3, 1, 4)}
_AUTO_SPEC_FALLBACK = (3, 1, 4)
# On a CPU a verify of N tokens is not free as on a GPU (a GEMM over 8 rows costs more than a one-row GEMV), so
# Llama's wide default does not pay there; bench/bench_shapes.py ranks the shapes, `fastspec tune` measures them.
_AUTO_SPEC_CPU = {"LlamaForCausalLM": (2, 2, 3)}


@dataclass(frozen=True)
class SpecParams:
    """One draft-tree shape."""
    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def shape(self) -> str:
        """"steps/topk/draft tokens", as banners and tables print it, e.g. "5/4/8"."""
        return f"{self.num_steps}/{self.topk}/{self.num_draft_tokens}"

    @property
    def max_depth(self) -> int:
        """The most draft tokens one round can accept: a path is at most num_steps deep and holds a node each."""
        return min(self.num_steps, self.num_draft_tokens - 1)


MATCH_TYPES = ("BFS", "PROB")


class NgramError(OptionError):
    """A refused NgramParams: its placeholders are the fields it names, which LLM takes as keys of its `ngram`
    ("ngram min_bfs_breadth=3 must be <= ngram max_bfs_breadth=2"); a command names each by the flag that gives it
    (flag_names' renamed: "--speculative-ngram-min-bfs-breadth 3 must be <= --speculative-ngram-max-bfs-breadth 2")."""

    @staticmethod
    def keyword(name: str) -> str:
        return f"ngram {name}"


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
        for field in dataclasses.fields(self):  # (LLM's ngram dict may hold "17", 2.0 or True: refused, not compared)
            text, value = field.type == "str", getattr(self, field.name)
            if not isinstance(value, str if text else Integral) or isinstance(value, bool):
                raise NgramError(f"{{{field.name}=}} must be {'a string' if text else 'an integer'}",
                                 **dataclasses.asdict(self))
        # (field, the rule it must meet, whether it does, why): a refusal names the field with its value and any field
        # its rule compares with, each as the caller gave it (`{name=}`: "ngram capacity=17", "--speculative-ngram-
        # capacity 17"); a value goes in as a placeholder's, so braces in a value typed are never read as one
        checks = (
            ("min_match_window_size", ">= 1", self.min_match_window_size >= 1, ""),
            ("min_match_window_size", "<= {max_match_window_size=}",
             self.min_match_window_size <= self.max_match_window_size, ""),
            ("max_match_window_size", "< {branch_length=}", self.max_match_window_size < self.branch_length,
             " (a matched window needs room to continue)"),
            ("min_bfs_breadth", ">= 1", self.min_bfs_breadth >= 1, ""),
            ("min_bfs_breadth", "<= {max_bfs_breadth=}", self.min_bfs_breadth <= self.max_bfs_breadth, ""),
            ("match_type", f"one of {', '.join(MATCH_TYPES)}", self.match_type in MATCH_TYPES, ""),
            ("capacity", ">= {branch_length=}", self.capacity >= self.branch_length, ""),
        )
        for field, rule, ok, why in checks:
            if not ok:
                raise NgramError(f"{{{field}=}} must be {rule}{why}", **dataclasses.asdict(self))

    @property
    def bfs_breadth_scale(self) -> float:  # breadth lost per window size below the max and per tree level
        windows = self.max_match_window_size - self.min_match_window_size + 1
        return (self.max_bfs_breadth - self.min_bfs_breadth) / windows


Schedule = tuple[tuple[int, "SpecParams | None"], ...]  # (up to this batch size, params or None = decode plainly)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding parameters, fully resolved (SGLang's rules) by `resolve`."""

    algorithm: str = "NONE"
    draft_model: str | None = None
    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    token_map: str | None = None
    ngram: NgramParams | None = None  # NGRAM's trie parameters
    schedule: Schedule = ()  # per batch-size tiers (`fastspec tune`); num_steps / topk / N are then their maxima

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @property
    def params(self) -> SpecParams:
        return SpecParams(self.num_steps, self.topk, self.num_draft_tokens)

    @property
    def tiers(self) -> list[SpecParams]:
        """The distinct tree shapes the engine may run (one without a schedule)."""
        if not self.schedule:
            return [self.params]
        return list(dict.fromkeys(p for _, p in self.schedule if p is not None))

    def params_for(self, bs: int) -> SpecParams | None:
        """The tree shape for a round of `bs` requests, or None to decode plainly."""
        for max_bs, params in self.schedule:
            if bs <= max_bs:
                return params
        return self.schedule[-1][1] if self.schedule else self.params

    def with_schedule(self, schedule: Schedule) -> SpecConfig:
        """This config switching tree shapes by batch size; memory is sized for the largest of each."""
        if not isinstance(schedule, (tuple, list)) or not all(
                isinstance(t, (tuple, list)) and len(t) == 2 and isinstance(t[0], int)
                and (t[1] is None or isinstance(t[1], SpecParams)) for t in schedule):
            raise FastspecError(f"schedule must be (largest batch size, SpecParams or None) pairs, got {schedule!r}")
        tiers = [p for _, p in schedule if p is not None]
        if self.algorithm not in ("EAGLE", "EAGLE3") or not tiers:
            raise FastspecError("a batch-size schedule needs EAGLE / EAGLE3 and at least one speculative tier")
        for p in tiers:
            check_tree(p.num_steps, p.topk, p.num_draft_tokens)
        return dataclasses.replace(self, schedule=tuple(sorted(schedule, key=lambda t: t[0])),
                                   num_steps=max(p.num_steps for p in tiers), topk=max(p.topk for p in tiers),
                                   num_draft_tokens=max(p.num_draft_tokens for p in tiers))

    @classmethod
    def resolve(cls, algorithm: str | None, target_arch: str, *, draft_model=None, num_steps=None, topk=None,
                num_draft_tokens=None, accept_threshold_single=1.0, accept_threshold_acc=1.0, token_map=None,
                ngram=None, device: str = "cuda") -> SpecConfig:
        """SGLang's rules; on a CPU `device` the tree flags left unset default to the CPU's measured shape."""
        algo = check_spec_flags(algorithm, num_steps, topk, num_draft_tokens, accept_threshold_single,
                                accept_threshold_acc)
        common = dict(algorithm=algo, accept_threshold_single=accept_threshold_single,
                      accept_threshold_acc=accept_threshold_acc)
        if algo == "NONE":
            return cls(**common)
        if algo == "NGRAM":
            return cls._resolve_ngram(common, ngram, num_steps, topk, num_draft_tokens)
        if draft_model is None:
            raise OptionError(f"{algo} needs a draft model ({{draft_model}})", draft_model=draft_model)
        if algo != "EAGLE" and token_map is not None:
            token_map = None  # SGLang ignores --speculative-token-map except for EAGLE (EAGLE-3 has d2t)
        steps, k, n = _auto_spec_params(algo, target_arch, num_steps, topk, num_draft_tokens, device == "cpu")
        return cls(draft_model=draft_model, num_steps=steps, topk=k, num_draft_tokens=n, token_map=token_map,
                   **common)

    @classmethod
    def _resolve_ngram(cls, common, ngram, num_steps, topk, num_draft_tokens) -> SpecConfig:
        if isinstance(ngram, dict):  # (the API's shorthand: NgramParams' fields by name)
            names = [field.name for field in dataclasses.fields(NgramParams)]
            for key in ngram:
                if key not in names:
                    raise FastspecError(f"ngram has no key {key!r}; {name_hint(str(key), names, {}, 'its keys are')}")
            ngram = NgramParams(**ngram)
        if ngram is not None and not isinstance(ngram, NgramParams):
            raise FastspecError(f"ngram must be an NgramParams or a dict of its fields, got {type(ngram).__name__}")
        ngram = ngram or NgramParams()
        n = num_draft_tokens or ngram.max_match_window_size
        if n < 2:
            raise OptionError("{num_draft_tokens} must be >= 2 for NGRAM, got {num_draft_tokens!s}", num_draft_tokens=n)
        return cls(num_steps=n - 1, topk=ngram.max_bfs_breadth, num_draft_tokens=n, ngram=ngram, **common)


MAX_TREE = (64, 64, 1024)  # num_steps, topk, num_draft_tokens: far past any tuned tree, short of absurd buffers


# the LLM keywords' command-line flags, which name them in the CLI's messages
CLI_FLAGS = {"speculative_algorithm": "--speculative-algorithm", "draft_model": "--speculative-draft-model-path",
             "num_steps": "--speculative-num-steps", "topk": "--speculative-eagle-topk",
             "num_draft_tokens": "--speculative-num-draft-tokens",
             "accept_threshold_single": "--speculative-accept-threshold-single",
             "accept_threshold_acc": "--speculative-accept-threshold-acc", "token_map": "--speculative-token-map",
             "draft_revision": "--speculative-draft-model-revision", "ngram": "--speculative-ngram-* options"}


def check_spec_flags(algorithm: str | None, num_steps: int | None = None, topk: int | None = None,
                     num_draft_tokens: int | None = None, accept_threshold_single: float = 1.0,
                     accept_threshold_acc: float = 1.0, draft_model: str | None = None, *,
                     token_map: str | None = None, draft_revision: str | None = None, ngram: bool = False) -> str:
    """The canonical algorithm name, after every check that needs no model: the name, the thresholds, the tree
    options as far as they are given (whether a partial shape is feasible depends on the target's defaults, which
    `resolve` checks), and no option the algorithm would ignore (a draft without a drafting algorithm; tree options
    and acceptance thresholds for NONE, all but num_draft_tokens for NGRAM; a token map but for EAGLE; a draft
    revision without a draft; NGRAM options (`ngram`: any given) but for NGRAM). `algorithm` None: the default (no
    tree option is ignored then; callers that know the model check its default: see `default_speculation`).
    Refusals are OptionErrors naming LLM's keywords (a command names them by CLI_FLAGS: cli.common.flag_names)."""
    if algorithm is not None and not isinstance(algorithm, str):
        raise OptionError("{speculative_algorithm} must be a name such as 'EAGLE3', got {speculative_algorithm!r}",
                          speculative_algorithm=algorithm)
    thresholds = {"accept_threshold_single": accept_threshold_single, "accept_threshold_acc": accept_threshold_acc}
    tree = {"num_steps": num_steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
    for key, value in (tree | thresholds).items():  # (an API caller's "3")
        kind = Real if key in thresholds else Integral  # (a threshold has no "unset": its default is 1)
        if (value is not None or kind is Real) and (not isinstance(value, kind) or isinstance(value, bool)):
            raise OptionError(f"{{{key}}} must be {'a number' if kind is Real else 'an integer'}, got {{{key}!r}}",
                              **{key: value})
    algo = (algorithm or "NONE").upper()
    algo = "EAGLE" if algo == "NEXTN" else algo
    if algo not in SPEC_ALGORITHMS:
        raise FastspecError(f"unknown speculative algorithm {algorithm!r}; choose one of "
                            f"{', '.join(SPEC_ALGORITHMS)} (NEXTN = EAGLE)")
    for key, value in thresholds.items():
        if not 0 <= value <= 1:
            raise OptionError(f"{{{key}}} must be in [0, 1], got {{{key}!s}}", **{key: value})
    for (key, value), least, most in zip(tree.items(), (1, 1, 2), MAX_TREE):
        if value is not None and not least <= value <= most:
            raise OptionError(f"{{{key}}} must be in [{least}, {most}], got {{{key}!s}}", **{key: value})
    if algo in ("EAGLE", "EAGLE3", "STANDALONE") and None not in (num_steps, topk, num_draft_tokens):
        check_tree(num_steps, topk, num_steps + 1 if topk == 1 else num_draft_tokens)
    named = dict(speculative_algorithm=algorithm, draft_model=draft_model)
    if draft_model is not None and algorithm is None:
        raise OptionError("{draft_model} needs {speculative_algorithm} (EAGLE, EAGLE3 or STANDALONE): without it the "
                          "draft would be ignored", **named)
    if draft_model is not None and algo in ("NONE", "NGRAM"):
        raise OptionError(f"{{draft_model}} with {{speculative_algorithm}} {algo}, which drafts without one: the "
                          "draft would be ignored", **named)
    ignored = [key for key, value in tree.items() if value is not None and algorithm is not None
               and (algo == "NONE" or algo == "NGRAM" and key != "num_draft_tokens")]
    ignored += [key for key, value in thresholds.items()
                if value != 1.0 and algorithm is not None and algo == "NONE"]  # (nothing drafts: nothing to accept)
    ignored += ["token_map"] if token_map is not None and (algorithm is None or algo != "EAGLE") else []
    ignored += ["ngram"] if ngram and algo != "NGRAM" else []
    given = tree | thresholds | {"token_map": token_map, "ngram": ngram}
    if ignored:
        raise OptionError(f"{{{ignored[0]}}} does not apply to {{speculative_algorithm}} "
                          f"{algo if algorithm else 'unset'}: it would be ignored"
                          + (" (an FR-Spec token map is for EAGLE heads; EAGLE-3 heads bring their own d2t)"
                             if ignored[0] == "token_map" else ""), **named, **{ignored[0]: given[ignored[0]]})
    if draft_revision is not None and draft_model is None:
        raise OptionError("{draft_revision} needs {draft_model} (a hub id): without it the revision would be "
                          "ignored", draft_revision=draft_revision, draft_model=draft_model)
    return algo


def _auto_spec_params(algo, target_arch, num_steps, topk, num_draft_tokens, cpu=False) -> tuple[int, int, int]:
    auto = _AUTO_SPEC_FALLBACK if algo == "STANDALONE" else _AUTO_SPEC.get(target_arch, _AUTO_SPEC_FALLBACK)
    auto = _AUTO_SPEC_CPU.get(target_arch, auto) if cpu and algo != "STANDALONE" else auto
    steps = num_steps if num_steps is not None else auto[0]
    k = topk if topk is not None else auto[1]
    n = num_draft_tokens if num_draft_tokens is not None else auto[2]
    if k == 1:
        n = steps + 1  # a chain: SGLang forces num_draft_tokens = num_steps + 1
    check_tree(steps, k, n)
    return steps, k, n


def check_tree(steps: int, k: int, n: int) -> None:
    if steps < 1 or k < 1:
        raise OptionError("{num_steps} and {topk} must be >= 1, got {num_steps!s}, {topk!s}", num_steps=steps, topk=k)
    capacity = 1 + k + (steps - 1) * k * k  # root + every candidate the top-k expansion produces
    if not 2 <= n <= capacity or (k == 1 and n != steps + 1):
        raise OptionError(f"{{num_draft_tokens=}} is infeasible with {{num_steps=}}, {{topk=}}: it must be in "
                          f"[2, {capacity}]" + (" and = {num_steps} + 1 for {topk=}" if k == 1 else ""),
                          num_draft_tokens=n, num_steps=steps, topk=k)


def refuse_lossy_thresholds(threshold_single: float, threshold_acc: float, why: str) -> None:
    """One line naming the acceptance thresholds (as CLI_FLAGS) set below 1 where a command decodes only greedily
    (`why` says where): greedy acceptance is exact whatever the thresholds, so they would change nothing there. (An
    engine serving sampled and greedy requests takes them: only its sampled rows read them.)"""
    given = [CLI_FLAGS[key] for key, value in (("accept_threshold_single", threshold_single),
                                               ("accept_threshold_acc", threshold_acc)) if value != 1.0]
    if given:
        raise FastspecError(f"{', '.join(given)} {'are' if len(given) > 1 else 'is'} not used: {why}, where "
                            "acceptance is exact whatever the thresholds")
