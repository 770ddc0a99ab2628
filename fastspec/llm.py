"""The Python API: `fastspec.LLM(model=...).generate(prompts, params)` — text in, text out.

Owns tokenisation and chat templating around the engine (which speaks token ids only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from functools import cached_property

from fastspec.config import EngineConfig
from fastspec.engine.engine import Engine, collect
from fastspec.errors import FastspecError, no_attribute
from fastspec.foreign_names import FOREIGN_METHODS, check_call_keywords, check_options
from fastspec.models.embedded import default_speculation
from fastspec.models.sources import resolve_sources
from fastspec.models.weights_fit import resolve_model_dtype
from fastspec.sampling.params import SamplingParams
from fastspec.spec_config import Schedule, SpecConfig, check_spec_flags
from fastspec.speculative.tuned import find_schedule, settings, weights_label
from fastspec.text.completion import Completion, TextDelta
from fastspec.text.detokenizer import IncrementalDetokenizer
from fastspec.text.inputs import as_prompts
from fastspec.text.tokenizer import Tokenizer
from fastspec.utils.threads import apply_threads


class LLM:
    def __init__(self, model: str | os.PathLike | None = EngineConfig.model, speculative_algorithm: str | None = None,
                 draft_model: str | None = None, num_steps: int | None = None, topk: int | None = None,
                 num_draft_tokens: int | None = None, accept_threshold_single: float = 1.0,
                 accept_threshold_acc: float = 1.0, token_map: str | None = None, ngram=None, on_prepare=None,
                 schedule: Schedule | None = None, tuned: bool = True, say: Callable[[str], None] | None = None,
                 revision: str | None = None, draft_revision: str | None = None, threads: int | None = 0,
                 tokenizer: str | os.PathLike | None = None, **engine_options):
        """`speculative_algorithm`: NONE, EAGLE (alias NEXTN), EAGLE3, STANDALONE or NGRAM; unset: EAGLE3 with the
        shipped head on an embedded model, NONE otherwise. Tree shape: `schedule` (per batch size, see
        SpecConfig.schedule), else explicit num_steps / topk / num_draft_tokens, else (`tuned`) the schedule
        `fastspec tune` measured for this target, draft and machine, else SGLang's per-architecture defaults.
        `say` receives notes on a tuned file that exists but is not used, or was measured under other engine
        settings (default: stderr). `model` and
        `draft_model` may be Hugging Face hub ids (`org/name`, at `revision` / `draft_revision`): the cached
        snapshot, or downloaded into the hub cache unless HF_HUB_OFFLINE is set. `load_format="dummy"` (an engine
        option): random weights from the model's config.json alone (see fastspec.models.dummy). `threads`: torch's
        CPU thread count (fastspec's C kernels share it), 0 = auto as the CLI's `--threads` (every core no other
        process keeps busy, measured once per process), None = leave torch's setting alone. `tokenizer`: a directory,
        hub id, .gguf file or embedded model whose tokenizer (and chat template) replaces the model's own, e.g. for a
        checkpoint shipped without one; its ids must fit the model's vocabulary.

        Checks run cheapest first: the flags, then the models' configs (fastspec.models.sources), and only then
        the tuned file."""
        model = EngineConfig.model if model is None else model
        model, draft_model, token_map, tokenizer = (_path_or_name(value, name) for value, name in (
            (model, "model"), (draft_model, "draft_model"), (token_map, "token_map"), (tokenizer, "tokenizer")))
        for name, value in (("revision", revision), ("draft_revision", draft_revision)):
            if value is not None and not isinstance(value, str):
                raise FastspecError(f"{name} must be a branch, tag or commit, got {value!r}")
        check_options(LLM, engine_options)
        config = EngineConfig(model=model, **engine_options)
        check_spec_flags(speculative_algorithm, num_steps, topk, num_draft_tokens, accept_threshold_single,
                         accept_threshold_acc, draft_model, token_map=token_map,
                         draft_revision=draft_revision, ngram=ngram is not None)
        if threads is not None:
            apply_threads(threads, "threads")
        algorithm, draft_model = default_speculation(model, speculative_algorithm, draft_model)
        if algorithm is None:  # (no shipped head: the default decodes plainly, reading no tree option nor threshold)
            check_spec_flags("NONE", num_steps, topk, num_draft_tokens, accept_threshold_single, accept_threshold_acc)
        self.sources = sources = resolve_sources(
            model, algorithm, draft_model, revision=revision, draft_revision=draft_revision,
            quantization=config.quantization, device=config.device, load_format=config.load_format,
            tokenizer=tokenizer)
        config = dataclasses.replace(config, model=str(sources.model_dir), quantization=sources.quantization,
                                     dtype=resolve_model_dtype(config.dtype, config.device, sources))
        draft = None if sources.draft_dir is None else str(sources.draft_dir)
        spec = SpecConfig.resolve(algorithm, sources.config.architecture, draft_model=draft, num_steps=num_steps,
                                  topk=topk, num_draft_tokens=num_draft_tokens, token_map=token_map,
                                  accept_threshold_single=accept_threshold_single,
                                  accept_threshold_acc=accept_threshold_acc, ngram=ngram, device=config.device)
        untuned = schedule is None and num_steps is None and topk is None and num_draft_tokens is None
        self.tuned_schedule: Schedule | None = None  # what a tuned file set (() = plain at every batch size)
        if tuned and untuned and spec.algorithm in ("EAGLE", "EAGLE3"):
            weights = weights_label(config.dtype, config.quantization, config.kv_cache_torch_name)
            found = find_schedule(sources.model_dir, sources.draft_dir, weights, config.device, say or _to_stderr,
                                  settings(config))
            if found is not None:
                schedule, all_off = found
                self.tuned_schedule = schedule
                spec = SpecConfig() if all_off else spec  # tuned: plain at every batch size (no threshold is read)
        if schedule:
            spec = spec.with_schedule(schedule)
        self.planned_spec = spec  # what was asked for and tuned (banners say it); the engine runs `spec`
        if spec.schedule and all(spec.params_for(bs) is None for bs in range(1, config.max_running_requests + 1)):
            spec = SpecConfig()  # no batch size this engine runs speculates: the draft is never loaded
        self.engine = Engine(config, spec, on_prepare, sources)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: token-id prompts need none (tiny test models ship no tokenizer)."""
        return Tokenizer(self.sources.tokenizer_dir)

    @property
    def has_tokenizer(self) -> bool:
        """Whether text can be read and written: without a tokenizer, token-id prompts still run (text None)."""
        return (self.sources.tokenizer_dir / "tokenizer.json").is_file()

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not chat:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool | None = None, continue_final_message: bool = False) -> list[int]:
        return self.tokenizer.encode_chat(messages, tools, add_generation_prompt, continue_final_message)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False,
                 should_stop: Callable[[], bool] = lambda: False, **foreign) -> list[Completion]:
        """Prompts as text (optionally chat-templated) or as token ids (a list of ints is one prompt, a list of lists
        several; numpy / torch integer arrays: see fastspec.text.inputs); one SamplingParams (None: the defaults) or
        one each (vLLM's names: `llm.generate(prompts, sampling_params=...)`). `should_stop()` (asked after every
        step; Ctrl-C) ends every request with what it has, reason "abort". The engine's stream is closed however this
        ends (Ctrl-C in the middle too), so its KV is back and the next call may run."""
        check_call_keywords(self.generate, foreign)
        ids, params = self._inputs(prompts, sampling_params, chat)
        with contextlib.closing(self.engine.stream(ids, params)) as steps:
            if not any(p.stop for p in params):  # no stop strings: token ids are final, decode once at the end
                got = collect(self._until(steps, len(ids), should_stop), params)
                text = self._text if self.has_tokenizer else lambda prompt, output: None
                return [Completion(ids[i], got.ids[i], text(ids[i], got.ids[i]), got.final[i].finish_reason,
                                   got.final[i].metrics, got.logprobs[i], got.prompt_logprobs[i])
                        for i in range(len(ids))]
            streams = [IncrementalDetokenizer(self.tokenizer, i, p.stop) for i, p in zip(ids, params)]
            got = collect(self._until(self._deltas(steps, streams), len(ids), should_stop), params)
        kept = {i: got.final[i].kept_tokens for i in range(len(ids))}
        return [Completion(ids[i], got.ids[i][: kept[i]], streams[i].text, got.final[i].finish_reason,
                           got.final[i].metrics, None if got.logprobs[i] is None else got.logprobs[i][: kept[i]],
                           got.prompt_logprobs[i]) for i in range(len(ids))]

    def chat(self, messages: list[dict] | list[list[dict]] | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool | None = None,
             continue_final_message: bool = False, **foreign) -> list[Completion]:
        """One conversation (a list of {"role": ..., "content": ...} messages) or a list of them, each through the
        model's chat template (`tools`: OpenAI-style function dicts for it); one Completion per conversation.
        `continue_final_message`: the model continues the last message (an assistant's answer begun) instead of
        answering it in a new one (see Tokenizer.apply_chat_template)."""
        check_call_keywords(self.chat, foreign)
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in messages):
            raise FastspecError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such "
                                "conversations")
        return self.generate([self.encode_chat(list(c), tools, add_generation_prompt, continue_final_message)
                              for c in messages], sampling_params)

    def stream(self, prompts=None, sampling_params=None, chat: bool = False, **foreign) -> Iterator[list[TextDelta]]:
        """Like generate, yielding text deltas after every step (never a split UTF-8 character; text that may
        start a stop string is held back until it is ruled out). Until it is finished or closed, the LLM runs
        nothing else (see Engine.run). Token-id prompts to a model without a tokenizer (and without stop strings,
        which are text) yield deltas of token ids, their text None, as generate's Completions have. The prompts and
        params are checked here, at the call (a FastspecError now, as generate's); the engine runs from the first
        next(). `abort(index)` named after this call and before that ends the request at the first step."""
        check_call_keywords(self.stream, foreign)
        ids, params = self._inputs(prompts, sampling_params, chat)
        streams = None
        if self.has_tokenizer or any(p.stop for p in params):
            streams = [IncrementalDetokenizer(self.tokenizer, i, p.stop) for i, p in zip(ids, params)]
        return self._stream(self.engine.stream(ids, params), streams)

    def _stream(self, steps, streams) -> Iterator[list[TextDelta]]:
        """The engine's `steps` as text deltas, or (`streams` None: no tokenizer) deltas of token ids, their text
        None; `steps` closed however it ends (the engine's KV and its turn back)."""
        with contextlib.closing(steps):
            if streams is not None:
                yield from self._deltas(steps, streams)
                return
            for step in steps:
                yield [TextDelta(out.index, None, out.finish_reason, out.metrics, out.new_ids, None, out.logprobs,
                                 out.prompt_logprobs) for out in step]

    def _deltas(self, steps, streams) -> Iterator[list[TextDelta]]:
        """The engine's `steps` as text deltas, one IncrementalDetokenizer per request."""
        for step in steps:
            deltas = []
            for out in step:
                stream = streams[out.index]
                if stream.stopped:
                    continue  # a stop string ended it last step; this is the engine confirming the abort
                text = stream.add(out.new_ids)
                reason = out.finish_reason
                if stream.stopped and reason is None:
                    self.engine.abort(out.index)  # the stop string ends it; the engine frees its KV next step
                if stream.stopped and reason in (None, "length"):  # (found in the last token allowed: a stop too)
                    reason = "stop"
                if reason is not None:
                    text += stream.finish()
                kept = stream.num_tokens_kept if stream.stopped else None
                deltas.append(TextDelta(out.index, text, reason, out.metrics, out.new_ids, kept, out.logprobs,
                                        out.prompt_logprobs))
            yield deltas

    def abort(self, index: int) -> None:
        self.engine.abort(index)

    def __getattr__(self, name: str):
        raise no_attribute(self, name, FOREIGN_METHODS)

    def _until(self, steps: Iterator[list], n: int, should_stop: Callable[[], bool]) -> Iterator[list]:
        """`steps` of a stream of `n` requests, every one aborted once should_stop() says so."""
        stopped = False
        for step in steps:
            yield step
            if not stopped and should_stop():
                stopped = True
                for index in range(n):
                    self.engine.abort(index)

    def _inputs(self, prompts, params, chat) -> tuple[list[list[int]], list[SamplingParams]]:
        """(token ids per prompt, params per prompt), or one FastspecError naming what is malformed."""
        prompts = as_prompts(prompts)
        if chat and any(not isinstance(p, str) for p in prompts):
            raise FastspecError("chat=True applies the chat template to text prompts, not to token ids")
        params = SamplingParams() if params is None else params
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params):
            hint = " (SGLang's dict d: SamplingParams(**d))" if any(isinstance(p, dict) for p in params) else ""
            raise FastspecError(f"sampling_params must be a SamplingParams or a list of them, one per prompt{hint}")
        if len(params) != len(prompts):
            raise FastspecError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one each")
        return [p if not isinstance(p, str) else self.encode(p, chat) for p in prompts], params

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, prompt_ids: list[int], output_ids: list[int]) -> str:
        """The output's text as a stream shows it: decoded after the prompt's last tokens, since decode(output) alone
        is not that for every tokenizer (SentencePiece drops the first word's space; see fastspec.text.detokenizer)."""
        return IncrementalDetokenizer(self.tokenizer, prompt_ids).finish(output_ids)


def _path_or_name(value, name: str) -> str | None:
    """A model, draft or token map as given: text or a path (None stays None); else a one-line FastspecError."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    what = {"model": "a directory, a hub id, a .gguf file or an embedded model's name",
            "draft_model": "a directory or a hub id",
            "tokenizer": "a directory, a hub id, a .gguf file or an embedded model's name"}.get(name, "a file")
    raise FastspecError(f"{name} must be {what}, got {type(value).__name__}")


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)
