"""The model / engine / speculative flags shared by `generate`, `chat`, `bench` (SGLang's flag names).

`@model_options` appends these parameters to a typer command's signature and hands the command one frozen
`ModelOptions` value instead, so every command takes exactly the same flags without repeating them.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Optional

import typer

from fastspec.cli.common import flag_names
from fastspec.errors import FastspecError
from fastspec.graphs.buckets import parse_buckets
from fastspec.models.embedded import DEFAULT_MODEL

SPEC = "Speculative decoding"
GRAPHS = "Graphs and kernels"
NGRAM = "NGRAM"
ENGINE_FLAGS = ("model", "load_format", "quantization", "dtype", "kv_cache_dtype", "device", "page_size", "graphs", "cuda_graph_max_bs", "cuda_graph_bs", "attention_backend",
                "max_total_tokens", "max_running_requests", "chunked_prefill_size", "max_context_len",
                "speculative_fallback", "overlap_schedule", "radix_cache", "mamba_track_interval")


@dataclass(frozen=True)
class ModelOptions:
    model: Annotated[str, typer.Option("--model", "-m", "--model-path", help="Embedded model name, HF directory, .gguf file or Hugging Face hub id (org/name: from the hub cache, else downloaded unless HF_HUB_OFFLINE is set).")] = DEFAULT_MODEL
    revision: Annotated[Optional[str], typer.Option(help="Hub id --model: the branch, tag or commit (default main).")] = None
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", "--tokenizer-path", help="Use this tokenizer and chat template instead of the model's own: a directory with tokenizer.json, a hub id, a .gguf file or an embedded model's name.")] = None
    load_format: Annotated[str, typer.Option(help="auto | dummy (random weights built on the device from config.json alone, none read: for benchmarks).")] = "auto"
    quantization: Annotated[str, typer.Option(help="auto | gguf | fp8 | int8 | int4 | none | the checkpoint's method: how the weights are stored and multiplied (docs/cli.md).")] = "auto"
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16. auto: on the CPU float32, but a bfloat16 checkpoint stays bfloat16 where the CPU has AVX512-BF16 (and any 16-bit one where float32 would not fit in memory); on CUDA the checkpoint's 16-bit dtype, bfloat16 for a float32 checkpoint (SGLang documents float16 there).")] = "auto"
    kv_cache_dtype: Annotated[str, typer.Option(help="How the KV cache is stored: auto (= --dtype; bfloat16 for quantised weights on the CPU in float32) | bfloat16 (bf16) | float16 (fp16) | float32 | fp8_e4m3 (fp8) | fp8_e5m2 (docs/cli.md).")] = "auto"
    device: Annotated[str, typer.Option(help="auto | cpu | cuda[:N] (auto: cuda when torch sees a GPU).")] = "auto"
    page_size: Annotated[int, typer.Option(help="KV page size in tokens.")] = 1
    max_total_tokens: Annotated[Optional[int], typer.Option(help="KV pool size in tokens, allocated at start (default: a fraction of free memory; on CPU that is only the limit: the pool starts small and grows as needed).")] = None
    max_running_requests: Annotated[int, typer.Option(help="Most requests decoded at once.")] = 48
    chunked_prefill_size: Annotated[int, typer.Option(help="Prompt tokens per prefill step.")] = 2048
    context_length: Annotated[Optional[int], typer.Option(help="The longest prompt + answer a request may have (default: the model's max_position_embeddings (a YaRN rope's original length x factor where longer), or its sliding window where shorter).")] = None
    graphs: Annotated[str, typer.Option(help="auto | cuda | compile | eager: how the draft loop, draft extend and verify run (auto: cuda on a GPU, eager on CPU).", rich_help_panel=GRAPHS)] = "auto"
    cuda_graph_max_bs: Annotated[Optional[int], typer.Option(help="Largest graph batch bucket.", rich_help_panel=GRAPHS)] = None
    cuda_graph_bs: Annotated[Optional[str], typer.Option(help="Explicit graph batch buckets, e.g. 1,2,4,8.", rich_help_panel=GRAPHS)] = None
    disable_cuda_graph: Annotated[bool, typer.Option(help="Run everything eagerly (= --graphs eager).", rich_help_panel=GRAPHS)] = False
    enable_torch_compile: Annotated[bool, typer.Option(help="torch.compile the graphs (= --graphs compile on CPU).", rich_help_panel=GRAPHS)] = False
    attention_backend: Annotated[str, typer.Option(help="torch | flashinfer (CUDA only).", rich_help_panel=GRAPHS)] = "torch"
    overlap_schedule: Annotated[str, typer.Option(help="auto | on | off: launch the next decode round before the last is read and handed out (auto: on for CUDA, off on CPU).")] = "auto"
    disable_overlap_schedule: Annotated[bool, typer.Option(help="= --overlap-schedule off (SGLang's flag).")] = False
    radix_cache: Annotated[bool, typer.Option("--radix-cache/--disable-radix-cache", help="Reuse the KV of cached token prefixes (chat turns, shared system prompts).")] = True
    threads: Annotated[int, typer.Option(envvar="FASTSPEC_THREADS", help="CPU threads for torch (0 = auto: every core no other process keeps busy).")] = 0
    mamba_track_interval: Annotated[int, typer.Option(help="Hybrid targets with --radix-cache: save the recurrent state every N tokens (a multiple of the page size), where a cached prefix can resume.")] = 256
    speculative_algorithm: Annotated[Optional[str], typer.Option(help="NONE | EAGLE (NEXTN) | EAGLE3 | STANDALONE | NGRAM", rich_help_panel=SPEC)] = None
    speculative_draft_model_path: Annotated[Optional[str], typer.Option("--speculative-draft-model-path", "--draft", help="Draft head / model: a directory or a hub id.", rich_help_panel=SPEC)] = None
    speculative_draft_model_revision: Annotated[Optional[str], typer.Option(help="Hub id draft: the branch, tag or commit.", rich_help_panel=SPEC)] = None
    speculative_num_steps: Annotated[Optional[int], typer.Option(help="Draft depth.", rich_help_panel=SPEC)] = None
    speculative_eagle_topk: Annotated[Optional[int], typer.Option(help="Branching per draft step.", rich_help_panel=SPEC)] = None
    speculative_num_draft_tokens: Annotated[Optional[int], typer.Option(help="Tree size incl. the root.", rich_help_panel=SPEC)] = None
    speculative_accept_threshold_single: Annotated[float, typer.Option(help="Accept any draft with target prob >= this (1 = lossless).", rich_help_panel=SPEC)] = 1.0
    speculative_accept_threshold_acc: Annotated[float, typer.Option(help="Inflate acceptance to min(1, p / this) (1 = lossless).", rich_help_panel=SPEC)] = 1.0
    speculative_fallback: Annotated[bool, typer.Option(help="Decode plainly while that is measured faster (per batch size and context length).", rich_help_panel=SPEC)] = True
    speculative_token_map: Annotated[Optional[str], typer.Option(help="FR-Spec hot-token list for EAGLE (.pt/.npy/.json).", rich_help_panel=SPEC)] = None
    speculative_ngram_min_match_window_size: Annotated[int, typer.Option(rich_help_panel=NGRAM)] = 1
    speculative_ngram_max_match_window_size: Annotated[int, typer.Option(rich_help_panel=NGRAM)] = 12
    speculative_ngram_min_bfs_breadth: Annotated[int, typer.Option(rich_help_panel=NGRAM)] = 1
    speculative_ngram_max_bfs_breadth: Annotated[int, typer.Option(rich_help_panel=NGRAM)] = 10
    speculative_ngram_match_type: Annotated[str, typer.Option(help="BFS | PROB", rich_help_panel=NGRAM)] = "BFS"
    speculative_ngram_branch_length: Annotated[int, typer.Option(rich_help_panel=NGRAM)] = 18
    speculative_ngram_capacity: Annotated[int, typer.Option(help="Trie nodes per request.", rich_help_panel=NGRAM)] = 1_000_000

    def validate(self) -> None:
        """Every check these flags allow without reading a model, a tuned file or a checkpoint, so that bad
        input fails first, in one line, whatever the cache holds."""
        from fastspec.config import EngineConfig
        from fastspec.models.embedded import default_speculation
        from fastspec.models.hub import check_model_spec, check_tokenizer_spec
        from fastspec.spec_config import check_spec_flags

        if self.disable_overlap_schedule and self.overlap_schedule == "on":
            raise FastspecError("--disable-overlap-schedule contradicts --overlap-schedule on: give one of them")
        kwargs = self.llm_kwargs()  # parses --cuda-graph-bs and the NGRAM flags
        if kwargs["device"] == "auto" and kwargs["graphs"] != "cuda":
            kwargs["device"] = "cpu"  # nothing else checked here depends on it: no torch import to find a GPU
        EngineConfig(**{k: kwargs[k] for k in ENGINE_FLAGS})
        ngram = any(getattr(self, f.name) != f.default for f in fields(self) if f.name.startswith("speculative_ngram_"))
        check_spec_flags(self.speculative_algorithm, self.speculative_num_steps, self.speculative_eagle_topk,
                         self.speculative_num_draft_tokens, self.speculative_accept_threshold_single,
                         self.speculative_accept_threshold_acc, self.speculative_draft_model_path,
                         token_map=self.speculative_token_map, draft_revision=self.speculative_draft_model_revision,
                         ngram=ngram)
        check_model_spec(self.model)
        if default_speculation(self.model, self.speculative_algorithm, self.speculative_draft_model_path)[0] is None:
            check_spec_flags("NONE", self.speculative_num_steps, self.speculative_eagle_topk,  # (plain: none is read)
                             self.speculative_num_draft_tokens, self.speculative_accept_threshold_single,
                             self.speculative_accept_threshold_acc)
        if self.tokenizer is not None:
            check_tokenizer_spec(self.tokenizer)
        if self.speculative_draft_model_path is not None:
            check_model_spec(self.speculative_draft_model_path, "--speculative-draft-model-path")
        if self.speculative_token_map is not None and not Path(self.speculative_token_map).expanduser().is_file():
            raise FastspecError(f"--speculative-token-map {self.speculative_token_map} is not a file")

    def llm_kwargs(self) -> dict:
        """Keyword arguments of `fastspec.LLM` for these options (the device as given: `auto` is resolved by the
        engine's config, which imports torch to see a GPU)."""
        ngram = None
        if (self.speculative_algorithm or "").upper() == "NGRAM":
            from fastspec.spec_config import NgramParams

            prefix = "speculative_ngram_"
            flags = {f.name[len(prefix):]: f.name for f in fields(self) if f.name.startswith(prefix)}
            with flag_names(flags.values(), renamed=flags):  # (its refusals name LLM's ngram keys: here the flags)
                ngram = NgramParams(**{field: getattr(self, flag) for field, flag in flags.items()})
        graphs = "eager" if self.disable_cuda_graph else "compile" if self.enable_torch_compile else self.graphs
        overlap = "off" if self.disable_overlap_schedule else self.overlap_schedule
        buckets = tuple(parse_buckets(self.cuda_graph_bs)) if self.cuda_graph_bs else None
        return dict(model=self.model, load_format=self.load_format, quantization=self.quantization, dtype=self.dtype,
                    kv_cache_dtype=self.kv_cache_dtype, device=self.device,
                    threads=None,  # set by model_options as the command starts
                    page_size=self.page_size,
                    graphs=graphs,
                    cuda_graph_max_bs=self.cuda_graph_max_bs, cuda_graph_bs=buckets,
                    attention_backend=self.attention_backend,
                    max_total_tokens=self.max_total_tokens, max_running_requests=self.max_running_requests,
                    chunked_prefill_size=self.chunked_prefill_size, max_context_len=self.context_length,
                    speculative_fallback=self.speculative_fallback,
                    overlap_schedule=overlap, radix_cache=self.radix_cache,
                    mamba_track_interval=self.mamba_track_interval, speculative_algorithm=self.speculative_algorithm,
                    draft_model=self.speculative_draft_model_path, num_steps=self.speculative_num_steps,
                    topk=self.speculative_eagle_topk, num_draft_tokens=self.speculative_num_draft_tokens,
                    accept_threshold_single=self.speculative_accept_threshold_single,
                    accept_threshold_acc=self.speculative_accept_threshold_acc,
                    token_map=self.speculative_token_map, ngram=ngram, revision=self.revision,
                    draft_revision=self.speculative_draft_model_revision, tokenizer=self.tokenizer)


LLM_FLAGS = frozenset(ModelOptions().llm_kwargs())  # LLM's keywords these flags give
REQUEST_FLAGS = frozenset({"max_new_tokens"})  # a command's own flags that a request's refusal names (RequestTooLong)


def refusal_flags(command) -> frozenset[str]:
    """What an engine's refusal names by its flag in `command` (flag_names): LLM's keywords, which the shared flags
    give, and the request flags the command takes of its own (serve takes none)."""
    return LLM_FLAGS | (inspect.signature(command).parameters.keys() & REQUEST_FLAGS)


def model_options(fn):
    """Replace `fn`'s `options: ModelOptions` parameter by one typer option per ModelOptions field."""
    sig = inspect.signature(fn)
    own_hints = typing.get_type_hints(fn, include_extras=True)
    own = [p.replace(annotation=own_hints[name]) for name, p in sig.parameters.items() if name != "options"]
    hints = typing.get_type_hints(ModelOptions, include_extras=True)
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=hints[f.name]) for f in fields(ModelOptions)]
    names = {f.name for f in fields(ModelOptions)}
    refused = refusal_flags(fn)

    @functools.wraps(fn)
    def wrapper(**kwargs):
        options = ModelOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        # the engine's refusals name LLM's keywords and a request's length max_new_tokens: here the flags typed
        with flag_names(refused):
            options.validate()
            if hasattr(fn, "check_flags"):  # the command's own flags, also before torch is imported
                fn.check_flags(**kwargs)
            from fastspec.utils.threads import apply_threads  # torch: only once a command runs

            apply_threads(options.threads)
            return fn(options=options, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper
