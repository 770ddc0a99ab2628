"""The OpenAI HTTP API's requests as values: bodies checked and turned into (prompt, SamplingParams, options) (the
response and stream-chunk objects: fastspec.serve.responses).

Owns: which fields each endpoint takes (an unknown one is a 400, as OpenAI answers), their types and ranges,
OpenAI's defaults (temperature 1, completions max_tokens 16), the error object. Does not own: reading the body
(body.py), running requests (service.py), HTTP (app.py) or the messages' keys (messages.py). Extra fields SGLang
and vLLM accept ride along: top_k, min_p, repetition_penalty, ignore_eos, regex, ebnf; chat's add_generation_prompt and
continue_final_message (the answer continues the last message: Tokenizer.apply_chat_template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from fastspec.errors import FastspecError
from fastspec.sampling.params import SamplingParams
from fastspec.serve.api_error import APIError, type_name
from fastspec.serve.messages import parse_messages
from fastspec.serve.tools import Tools, close_objects, parse_tools

COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs", "response_format",
          "top_k", "min_p", "repetition_penalty", "ignore_eos", "regex", "ebnf"}
PLATFORM_FIELDS = {"metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
                   "safety_identifier": str, "reasoning_effort": str, "verbosity": str, "prediction": dict,
                   "modalities": list}  # chat: OpenAI's own platform's (stored completions, tiers, caching keys)
# and its reasoning models' hints (effort, verbosity, a predicted output): no part of this model's answer,
# type-checked and unused, as vLLM and SGLang take them. modalities: text only; web_search_options: refused
CHAT_FIELDS = COMMON | set(PLATFORM_FIELDS) | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                               "tool_choice", "parallel_tool_calls", "web_search_options",
                                               "add_generation_prompt", "continue_final_message"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
MAX_CHOICES = 16  # n: each choice is a request of its own in the running batch
MAX_REQUESTS = 256  # completions: a request's prompts x n (each a request of its own)
MAX_STOPS = 64  # stop strings (OpenAI's limit is 4; vLLM and SGLang set none, and lm-eval's tasks may send more)
DEFAULT_CHAT_MAX_TOKENS = 1024  # OpenAI's chat default is "the rest of the context"; capped so the KV pool holds it


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    messages: list[dict] | None  # chat
    prompts: tuple[str | list[int], ...] | None  # completions: text or token ids each (choice p * n + i: prompt p's)
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool  # report logprobs (chat: `logprobs: true`; completions: `logprobs: n`)
    max_tokens_field: str | None  # the field that set the length (max_tokens / max_completion_tokens); None: the
    # default applies once the prompt's length is known
    n: int = 1  # choices: n requests over the same prompt (seeded: choice i draws with seed + i)
    tools: Tools | None = None  # chat: the tools the answer may call (fastspec.serve.tools)
    echo: bool = False  # completions: each choice's text (and logprobs) start with its prompt's
    prompt_only: bool = False  # completions: max_tokens 0 with echo: the prompt scored, nothing generated
    add_generation_prompt: bool | None = None  # chat: as given (None: unless continue_final_message)
    continue_final_message: bool = False  # chat: the answer continues the last message

    def choice_params(self, params: SamplingParams) -> list[SamplingParams]:
        """Each choice's parameters: with a seed, choice i's is seed + i (reproducible and not all the same)."""
        if params.seed is None:
            return [params] * self.n
        return [replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63) for i in range(self.n)]  # (wraps)


IGNORE_EOS_WITH_TOOLS = "ignore_eos must be off with tools: the tool-call grammar ends the output at EOS"


def parse_request(body: dict, chat: bool, model_name: str) -> ParsedRequest:
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise APIError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model", model_name)  # (omitted: the served model, as SGLang and vLLM take it)
    if not isinstance(model, str):
        raise APIError(f"model must be of type str, got {type_name(model)}", param="model")
    if model != model_name:
        raise APIError(f"the model '{model}' does not exist (this server serves '{model_name}')", status=404,
                       param="model", code="model_not_found")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    if _get(body, "best_of", int, n) != n:
        raise APIError("best_of other than n is not supported", param="best_of")
    echo = not chat and _get(body, "echo", bool, False)
    if not chat and _get(body, "suffix", str, None):
        raise APIError("suffix is not supported", param="suffix")
    messages, prompts = (parse_messages(body), None) if chat else (None, _prompts(body))
    if prompts is not None and len(prompts) * n > MAX_REQUESTS:
        raise APIError(f"{len(prompts)} prompts x n {n} = {len(prompts) * n} choices: at most {MAX_REQUESTS} in one "
                       "request", param="prompt")
    tools = parse_tools(body) if chat else None
    schema = _response_format(body)
    if tools is not None and tools.grammar() is not None:
        if schema is not None or body.get("regex") is not None or body.get("ebnf") is not None:
            raise APIError("tool_choice required or a named function constrains the answer already: drop "
                           "response_format / regex / ebnf", param="tool_choice")
        if _get(body, "ignore_eos", bool, False):
            raise APIError(IGNORE_EOS_WITH_TOOLS, param="ignore_eos")
        schema = tools.grammar()
    stop = _get(body, "stop", (str, list), None)
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
        raise APIError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", param="stop")
    if chat:
        want_logprobs = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, 0)
        if top and not want_logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        top = _get(body, "logprobs", int, None)
        want_logprobs = top is not None
    max_tokens, length_field, prompt_only = _max_tokens(body, echo)
    include_usage = _stream_options(body)
    _get(body, "user", str, None)  # (taken and unused, as OpenAI's abuse-monitoring id)
    for name, kind in PLATFORM_FIELDS.items() if chat else ():
        _get(body, name, kind, None)
    if chat and not all(isinstance(v, str) for v in _get(body, "metadata", dict, {}).values()):
        raise APIError("metadata must map keys to strings", param="metadata")
    if chat and any(m != "text" for m in _get(body, "modalities", list, [])):
        raise APIError("modalities: this server answers in text only", param="modalities")
    if chat and body.get("web_search_options") is not None:  # (an answer without the search asked for misleads)
        raise APIError("web_search_options: this server does not search the web", param="web_search_options")
    try:
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=_get(body, "top_k", int, -1), min_p=_number(body, "min_p", 0.0),
            seed=_get(body, "seed", int, None), max_new_tokens=max_tokens or (DEFAULT_CHAT_MAX_TOKENS if chat else 16),
            stop=stop, ignore_eos=_get(body, "ignore_eos", bool, False),
            logprobs=top if want_logprobs else None, prompt_logprobs=top if want_logprobs and echo else None,
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            logit_bias=_logit_bias(body), regex=_get(body, "regex", str, None), ebnf=_get(body, "ebnf", str, None),
            json_schema=schema)
    except FastspecError as e:  # (response_format's schema is the json_schema a grammar clash names)
        message = str(e).replace("json_schema and", "response_format and")
        if chat and message.startswith("logprobs must"):  # (chat's count of alternatives is top_logprobs)
            message = "top_" + message
        field = message.partition(" must ")[0]  # (SamplingParams' subject is its keyword: "top_p must be in ...")
        raise APIError(message, param=field if field in body else None) from None
    return ParsedRequest(chat, messages, prompts, params, _get(body, "stream", bool, False), include_usage,
                         want_logprobs, length_field, n, tools, echo, prompt_only,
                         _get(body, "add_generation_prompt", bool, None) if chat else None,
                         chat and _get(body, "continue_final_message", bool, False))


def _max_tokens(body: dict, echo: bool) -> tuple[int | None, str | None, bool]:
    """(max tokens or None, the field that gave it or None, whether the prompt alone is scored: max_tokens 0 with
    echo, where one token is made and not shown). Chat's max_completion_tokens comes before max_tokens; each given
    one is checked."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < (0 if echo else 1)):
            least = ">= 0 with echo" if echo else ">= 1"
            raise APIError(f"{name} must be an integer {least}, got {value!r}", param=name)
    field = next((name for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None), None)
    value = None if field is None else body[field]
    prompt_only = echo and value == 0
    return (1 if prompt_only else value), field, prompt_only


def _stream_options(body: dict) -> bool:
    """Whether the stream ends with a usage chunk (OpenAI's stream_options: include_usage, and include_obfuscation,
    taken and unused: fastspec's chunks carry no obfuscation field)."""
    options = _get(body, "stream_options", dict, {})
    if body.get("stream_options") is not None and body.get("stream") is not True:  # (OpenAI's rule)
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise APIError(f"unknown field(s) in stream_options: {', '.join(unknown)}", param="stream_options")
    for name in ("include_usage", "include_obfuscation"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise APIError(f"stream_options.{name} must be of type bool, got {type_name(options[name])}",
                           param="stream_options")
    return bool(options.get("include_usage"))


def _get(body: dict, name: str, kind, default):
    value = body.get(name, default)
    if value is None or value is default:
        return default
    if isinstance(value, bool) and kind is int or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise APIError(f"{name} must be of type {names}, got {type_name(value)}", param=name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(f"{name} must be a number, got {type_name(value)}", param=name)
    try:
        return float(value)
    except OverflowError:  # (an integer past a float's range)
        raise APIError(f"{name} must be a finite number, got an integer of {len(str(abs(value)))} digits",
                       param=name) from None


def _prompts(body: dict) -> tuple[str | list[int], ...]:
    """OpenAI's four forms: a string, a list of token ids, a list of strings, a list of token-id lists."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    batch = prompt if batched else [prompt]
    for p in batch:
        if not (isinstance(p, str) and p or isinstance(p, list) and p
                and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
            raise APIError("prompt must be a non-empty string or list of token ids, or a list of them",
                           param="prompt")
    return tuple(batch)


def _logit_bias(body: dict) -> dict:
    bias = _get(body, "logit_bias", dict, {}) or {}
    try:
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in bias.values()):
            raise TypeError
        bias = {int(k): v for k, v in bias.items()}
    except (TypeError, ValueError):
        raise APIError("logit_bias must map token ids to numbers", param="logit_bias") from None
    if any(not -100 <= v <= 100 for v in bias.values()):  # (OpenAI's range; compared before float() may overflow)
        raise APIError("logit_bias values must be in [-100, 100]", param="logit_bias")
    return {k: float(v) for k, v in bias.items()}


def _response_format(body: dict) -> str | None:
    fmt = _get(body, "response_format", dict, None)
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return json.dumps({"type": "object"})
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        return _schema_text(fmt["json_schema"])
    raise APIError("response_format must be text, json_object or json_schema {schema}", param="response_format")


def _schema_text(spec: dict) -> str:
    """A json_schema response format's schema as text; with `strict: true` held as a strict tool's parameters are
    (fastspec.serve.tools.close_objects): every property required, and an object that allows more keys a 400."""
    schema, strict = spec.get("schema", {"type": "object"}), spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"response_format.json_schema.strict must be of type bool, got {type_name(strict)}",
                       param="response_format")
    if not strict:
        return schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return json.dumps(close_objects(json.loads(schema) if isinstance(schema, str) else schema, strict=True,
                                        where="schema"))
    except json.JSONDecodeError as e:
        raise APIError(f"response_format's schema is not valid JSON: {e}", param="response_format") from None
    except ValueError as e:
        raise APIError(f"response_format: strict needs closed objects, but {e}", param="response_format") from None
