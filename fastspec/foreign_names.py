"""Other projects' names for what fastspec.LLM takes: SGLang's Engine and vLLM's LLM keywords, the keywords of their
generate / chat, and their methods, each answered with fastspec's own in one line (a FastspecError, never a
TypeError or an AttributeError from inside). Holds the names and the checks; LLM calls them."""

from __future__ import annotations

import dataclasses
import inspect

from fastspec.config import EngineConfig
from fastspec.errors import FastspecError, name_hint
from fastspec.spec_config import CLI_FLAGS

_ONE_DEVICE = "fastspec runs on one device (device='cuda:N' picks the GPU)"
_KV_SIZE = "the KV pool's size is max_total_tokens (in tokens) or kv_mem_fraction (of the memory available)"
_SEED = "seeds are per request: SamplingParams(seed=...)"
# keywords of SGLang's Engine and vLLM's LLM that fastspec.LLM spells otherwise or does not take (SGLang's
# speculative_* names are its CLI flags: CLI_FLAGS, read backwards)
FOREIGN_OPTIONS = {
    "model_path": "use model", "tokenizer_path": "use tokenizer", "tp_size": _ONE_DEVICE,
    "tensor_parallel_size": _ONE_DEVICE, "dp_size": _ONE_DEVICE, "data_parallel_size": _ONE_DEVICE,
    "pp_size": _ONE_DEVICE, "pipeline_parallel_size": _ONE_DEVICE, "mem_fraction_static": _KV_SIZE,
    "gpu_memory_utilization": _KV_SIZE, "context_length": "use max_context_len", "max_model_len": "use max_context_len",
    "max_num_seqs": "use max_running_requests", "max_num_batched_tokens": "use chunked_prefill_size",
    "enable_prefix_caching": "use radix_cache (on by default)", "disable_radix_cache": "use radix_cache=False",
    "enforce_eager": "use graphs='eager'", "disable_cuda_graph": "use graphs='eager'",
    "enable_torch_compile": "use graphs='compile'", "disable_overlap_schedule": "use overlap_schedule='off'",
    "trust_remote_code": "not needed: fastspec runs its own code for each architecture, never a checkpoint's",
    "seed": _SEED, "random_seed": _SEED, "log_level": "fastspec has no log levels",
    "speculative_config": "use speculative_algorithm, draft_model, num_steps, topk and num_draft_tokens",
    **{flag[2:].replace("-", "_"): f"use {key}" for key, flag in CLI_FLAGS.items() if key != "ngram"},
}


def check_options(llm: type, options: dict) -> None:
    """The engine keywords `llm` (fastspec.LLM) was given are its own or EngineConfig's fields; another is a one-line
    FastspecError naming fastspec's own (vLLM's `max_model_len`: max_context_len), not a TypeError from inside."""
    names = [n for n in inspect.signature(llm).parameters if n != "engine_options"]
    names += [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    for key in options:
        if key in names:
            continue
        hint = (FOREIGN_OPTIONS.get(key) or (f"use ngram={{{key[len('speculative_ngram_'):]!r}: ...}}"
                                             if key.startswith("speculative_ngram_") else None)
                or name_hint(key, names, {}, "its options are"))
        raise FastspecError(f"LLM has no option {key!r}; {hint}")


# keywords of vLLM's LLM.generate / chat and SGLang's Engine.generate that fastspec's take otherwise or not at all
FOREIGN_KEYWORDS = {
    "use_tqdm": "fastspec shows no progress bar: leave it out", "lora_request": "fastspec serves no LoRA adapters",
    "prompt": "use prompts (a string or a list of them)", "input_ids": "pass token-id lists as the prompts",
    "prompt_token_ids": "pass token-id lists as the prompts", "stream": "use LLM.stream",
    "return_logprob": "use SamplingParams(logprobs=...)",
    "chat_template": "fastspec uses the model's own chat template"}
# methods of vLLM's LLM and SGLang's Engine that fastspec.LLM spells otherwise or does not have
FOREIGN_METHODS = {
    "get_tokenizer": "use llm.tokenizer (or llm.encode / llm.decode)", "llm_engine": "the engine is llm.engine",
    "shutdown": "nothing to shut down: an LLM's threads and memory go with it (del llm)",
    "reset_prefix_cache": "use llm.engine.flush_cache()", "flush_cache": "use llm.engine.flush_cache()",
    "async_generate": "LLM.stream yields as it goes; `fastspec serve` answers many clients at once"}


def check_call_keywords(method, foreign: dict) -> None:
    """A keyword generate / chat / stream do not take: one FastspecError naming fastspec's own, not a TypeError."""
    names = [n for n in inspect.signature(method).parameters if n != "foreign"]
    for key in foreign:
        hint = name_hint(key, names, FOREIGN_KEYWORDS, "it takes")
        raise FastspecError(f"LLM.{method.__name__} has no keyword {key!r}; {hint}")
