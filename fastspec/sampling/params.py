"""Per-request sampling parameters (`SamplingParams`), checked once at construction. How tokens are drawn from
them lives in fastspec.sampling.draw, grammars in fastspec.sampling.grammar. No torch here: a command checks its
sampling flags before torch is imported."""

from __future__ import annotations

import json
import math
from numbers import Integral, Real
from dataclasses import dataclass, fields
from pathlib import Path

from fastspec.errors import FastspecError, name_hint

KINDS = ("json_schema", "regex", "ebnf", "lark")  # the structured-output fields, at most one set
_GRAMMAR_WORDS = {"json_schema": "a JSON schema", "regex": "a regex", "ebnf": "an EBNF grammar",
                  "lark": "a Lark grammar"}  # (each surface spells the fields apart: --json-schema, response_format)
GREEDY_BELOW = 1e-6  # a temperature below this samples greedily, as SGLang's does
INT32_MAX = 2**31 - 1  # top_k's bound (any k past the vocabulary keeps the whole of it)
_ONE_EACH = "fastspec answers each prompt once: give the prompt that many times (unseeded, or each with its own seed)"
_NO_TRIM = "fastspec always trims a stop string from the text, and its tokens from output_ids"
_SPECIAL = "fastspec's text always skips special tokens (output_ids keep them)"
_GRAMMAR = "structured output is one of the fields json_schema, regex or ebnf"
_MIN = "fastspec has no minimum: ignore_eos=True runs an answer to max_new_tokens"
_LOGPROBS = "logprobs=N reports each output token's logprob and its N most likely alternatives"
# vLLM's SamplingParams fields and SGLang's sampling_params keys that fastspec spells otherwise or does not take
FOREIGN_FIELDS = {
    "max_tokens": "use max_new_tokens", "max_completion_tokens": "use max_new_tokens", "sampling_seed": "use seed",
    "n": _ONE_EACH, "best_of": _ONE_EACH, "min_tokens": _MIN, "min_new_tokens": _MIN,
    "include_stop_str_in_output": _NO_TRIM, "no_stop_trim": _NO_TRIM,
    "stop_regex": "stop takes strings, stop_token_ids token ids; a regex can only shape the whole answer (regex)",
    "skip_special_tokens": _SPECIAL, "spaces_between_special_tokens": _SPECIAL,
    "detokenize": "fastspec decodes text wherever the model has a tokenizer",
    "truncate_prompt_tokens": "fastspec refuses a prompt longer than the context rather than cut it",
    "guided_decoding": _GRAMMAR, "structured_outputs": _GRAMMAR, "structural_tag": _GRAMMAR,
    "guided_json": "use json_schema", "guided_regex": "use regex", "guided_grammar": "use ebnf (a GBNF grammar)",
    "return_logprob": _LOGPROBS, "top_logprobs_num": _LOGPROBS,
    "bad_words": "logit_bias={token_id: -100} keeps a token out",
    "allowed_token_ids": "logit_bias or a grammar (regex, ebnf) can restrict the tokens",
    "logits_processors": "the controls are the penalties, logit_bias, min_p and the grammars",
    "output_kind": "LLM.stream hands out deltas, LLM.generate whole completions",
}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the target's logprob of each output token and of its top-n alternatives
    prompt_logprobs: int | None = None  # ... and of each prompt token after the first (vLLM's; the prompt is computed
    #                                     whole then, not read from the prefix cache)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (fastspec.sampling.controls)
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if the token occurs in the output
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); a dict is accepted too
    # structured output (fastspec.sampling.grammar), at most one of:
    json_schema: str | None = None  # a JSON schema (a dict too),
    regex: str | None = None  # a regular expression the whole output matches,
    ebnf: str | None = None  # or a GBNF grammar (llama.cpp's / xgrammar's EBNF: `root ::= ...`),
    lark: str | None = None  # or llguidance's Lark grammar (serve's `auto` tool calls)

    def __new__(cls, *args, **kwargs):
        """A keyword that is no field (vLLM's `max_tokens`, SGLang's `no_stop_trim`...) is a one-line FastspecError
        that names what fastspec has instead, not Python's bare TypeError."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                hint = name_hint(key, names, FOREIGN_FIELDS, "its fields are")
                raise FastspecError(f"SamplingParams has no {key!r}; {hint}")
        return super().__new__(cls)

    def __post_init__(self):
        # Each refusal's subject is the field's keyword, first ("top_p must be in ..."): the CLI swaps it for the
        # flag typed (fastspec.cli.common.flag_names), a server names its request field by it.
        self._check_types()
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise FastspecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastspecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= INT32_MAX:
            raise FastspecError(f"top_k must be -1 (off) or in [1, {INT32_MAX}], got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise FastspecError(f"seed must be a 64-bit integer, in [-2^63, 2^63), got {self.seed}")
        if self.max_new_tokens < 1:
            raise FastspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_stop(self.stop)
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise FastspecError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise FastspecError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_p <= 1:
            raise FastspecError(f"min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))  # hashable
        self._check_grammar()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise FastspecError(f"{name} must be in [0, 20] (top alternatives per token), got "
                                    f"{getattr(self, name)}")

    def _check_types(self) -> None:
        """Each field's type (bool is no number here); a lone stop string or stop id is taken as a one-item tuple,
        as vLLM takes it (a string is not a sequence of one-character stop strings)."""
        for name in ("top_k", "max_new_tokens", *(("seed",) if self.seed is not None else ()),
                     *(n for n in ("logprobs", "prompt_logprobs") if getattr(self, n) is not None)):
            if not isinstance(getattr(self, name), Integral) or isinstance(getattr(self, name), bool):
                raise FastspecError(f"{name} must be an integer, got {getattr(self, name)!r}")
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"):
            if not isinstance(getattr(self, name), Real) or isinstance(getattr(self, name), bool):
                raise FastspecError(f"{name} must be a number, got {getattr(self, name)!r}")
            object.__setattr__(self, name, float(getattr(self, name)))
        for name, one in (("stop", str), ("stop_token_ids", Integral)):
            value = getattr(self, name)
            value = (value,) if isinstance(value, one) else value
            if not isinstance(value, (tuple, list)) or not all(isinstance(v, one) and not isinstance(v, bool)
                                                               for v in value):
                what = "string" if one is str else "token id"
                raise FastspecError(f"{name} must be a {what} or a list of them, got {value!r}")
            object.__setattr__(self, name, tuple(v if one is str else int(v) for v in value))
        if not isinstance(self.ignore_eos, bool):
            raise FastspecError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in KINDS:
            value = getattr(self, name)
            allowed = (str, dict) if name == "json_schema" else str  # (a JSON schema as a dict too)
            if value is not None and not isinstance(value, allowed):
                raise FastspecError(f"{name} must be a string, got {type(value).__name__}")

    def _check_grammar(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise FastspecError(f"one grammar per request: {' and '.join(kinds)} are both set")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", normalise_schema(self.json_schema))
        if kinds and self.ignore_eos:
            raise FastspecError(f"ignore_eos must be off with {_GRAMMAR_WORDS[kinds[0]]}: the grammar ends the output "
                                "at EOS")

    @property
    def greedy(self) -> bool:
        """Temperature 0, top-k 1, or a temperature below GREEDY_BELOW (float32 logits divided by one that small can
        overflow, and every overflowed logit would tie)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def check_stop(stop: tuple[str, ...]) -> None:
    """No empty stop string (every text holds one at once): SamplingParams' check, and the detokenizer's."""
    if any(not s for s in stop):
        raise FastspecError(f"stop must not hold an empty string, got {stop!r}")


def bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """A logit bias (a dict, or (token id, bias) pairs) as sorted pairs; else a one-line FastspecError."""
    pairs = list(bias.items() if isinstance(bias, dict) else bias) if isinstance(bias, (dict, tuple, list)) else None
    if pairs is None or not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], Integral)
                                and not isinstance(p[0], bool) and p[0] >= 0 and isinstance(p[1], Real)
                                and not isinstance(p[1], bool) and math.isfinite(p[1]) for p in pairs):
        raise FastspecError("logit_bias must map token ids >= 0 to finite numbers")
    return tuple(sorted((int(t), float(v)) for t, v in pairs))


def normalise_schema(schema) -> str:
    """A JSON schema as canonical text (a dict, or text that must parse as JSON)."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        if not schema.lstrip().startswith(("{", "[")):  # (a path to a file that is not there, most likely)
            raise FastspecError(f"invalid json schema: {schema[:80]!r} is neither a file nor JSON") from None
        raise FastspecError(f"invalid json schema: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(parsed, dict):
        raise FastspecError("invalid json schema: it must be a JSON object")
    return schema


def read_grammar_arg(value: str | None) -> str | None:
    """A CLI grammar flag: a file's text when it names a file, else the text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        return path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError as e:
        raise FastspecError(f"cannot read {value}: {e.strerror}") from None
