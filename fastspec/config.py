"""Frozen engine configuration values, each resolved once at construction, and the device and dtype checks.

The speculative configuration lives in fastspec.spec_config, a model's own (config.json normalised) in
fastspec.models.model_config. Nothing here touches tensors beyond naming a dtype, and torch is imported only where a
value needs it (a dtype asked for as a torch dtype, `auto` / `cuda` devices): checking flags stays fast.
"""

from __future__ import annotations

import numbers
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastspec.errors import FastspecError, OptionError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# the KV pools' storage (torch dtype names): auto is the model's --dtype; SGLang's and vLLM's names as aliases
KV_CACHE_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                   "float16": "float16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn", "fp8": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}
# "none" is read as None; fp8 / int8 / int4 round a float checkpoint at load (or name an fp8 checkpoint's own); the
# others name a quantised checkpoint's method (models.quant_config)
QUANTIZATIONS = ("auto", None, "gguf", "fp8", "int8", "int4", "awq", "gptq", "compressed-tensors", "fbgemm_fp8",
                 "modelopt")


def kv_cache_dtype_name(kv_cache_dtype: str, dtype: str, device: str, quantization: str | None) -> str:
    """The torch dtype name the KV pools store: --kv-cache-dtype; for auto the model's `dtype`, but bfloat16 for
    quantised weights run on the CPU in float32 (fastspec's packed kernels: the embedded model's default;
    llama.cpp's cache is 16-bit too): half the bytes attention reads per token, 1.14-1.32x decode at 500-6000 tokens
    of context on EPYC-512 (bench/README.md "KV cache dtype"), 702 of 703 tokens teacher-forced as over a float32
    cache. `quantization` as resolved (auto: not yet, the model's dtype)."""
    if kv_cache_dtype == "auto" and device == "cpu" and dtype == "float32" and quantization not in (None, "auto"):
        return "bfloat16"
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


def resolve_device(device: str) -> str:
    """`auto`: cuda when torch sees a GPU, else cpu; anything else as given (check_device judges it)."""
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    return device


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_device(device: str) -> None:
    """`cpu`, or `cuda` / `cuda:N` naming a GPU this process can see; else a one-line FastspecError."""
    index = device[len("cuda:"):] if device.startswith("cuda:") else None
    if device not in ("cpu", "cuda") and not (index and index.isdigit()):
        raise OptionError("{device} must be auto, cpu or cuda[:N], got {device!r}", device=device)
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise OptionError("{device=}: no CUDA device is visible to torch here", device=device)
    if index and int(index) >= torch.cuda.device_count():
        raise OptionError(f"{{device=}}: only {torch.cuda.device_count()} CUDA device(s) here", device=device)


def check_dtype(name: str, auto: bool = False) -> None:
    if name not in DTYPES and not (auto and name == "auto"):
        raise FastspecError(f"unknown dtype {name!r}; choose one of {'auto, ' if auto else ''}{', '.join(DTYPES)}")


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str) -> str:
    """--dtype with `auto` decided by the rule alone: float32 on the CPU (exact; models.weights_fit.resolve_model_dtype
    keeps a 16-bit checkpoint's own dtype where the CPU's bf16 instructions or its memory call for it); on CUDA the
    checkpoint's own 16-bit dtype, bfloat16 for a float32 one (SGLang documents float16 there; bfloat16 keeps
    float32's range, which models trained in it rely on)."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"


def parse_dtype(name: str) -> torch.dtype:
    import torch

    check_dtype(name)
    return getattr(torch, name)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; validated here so the engine never sees a bad value."""

    model: str = "smollm2-135m-instruct"  # embedded name, HF directory or .gguf file
    load_format: str = "auto"  # auto: the model's weights; dummy: random weights from config.json alone (benchmarks)
    # auto: a quantised checkpoint's own method, gguf for a model converted from a .gguf file on CPU, else None
    # (models.sources.resolve_quantization); None ("none"): the weights dequantised to dtype (the exact reference);
    # gguf: a GGUF model on its own blocks; fp8 / int8 / int4: a float checkpoint's projections rounded at load
    quantization: str | None = "auto"
    dtype: str = "auto"  # auto: decided with the checkpoint (models.weights_fit.resolve_model_dtype, by LLM / Worker)
    kv_cache_dtype: str = "auto"  # the KV pools' storage (auto: kv_torch_dtype); attention computes in dtype
    device: str = "auto"  # auto: cuda when torch sees a GPU (resolved here), else cpu
    page_size: int = 1
    max_total_tokens: int | None = None  # static KV pool size in tokens; None: up to kv_mem_fraction (CPU: grows)
    kv_mem_fraction: float = 0.05  # without max_total_tokens, the KV pools' ceiling: this of the memory available
    max_running_requests: int = 48
    max_context_len: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int = 2048  # prompt tokens per prefill step (long prompts take several steps)
    speculative_fallback: bool = False  # per batch size and context length, decode plainly where that measures faster
    graphs: str = "auto"  # auto | cuda | compile | eager: how the draft loop, draft extend and verify run
    cuda_graph_max_bs: int | None = None  # largest graph bucket (None: max_running_requests); larger: eager
    cuda_graph_bs: tuple[int, ...] | None = None  # explicit bucket list
    attention_backend: str = "torch"  # torch | flashinfer
    overlap_schedule: str = "auto"  # auto | on | off: launch the next decode round before handing out the last
    radix_cache: bool = True  # keep finished requests' KV in a radix tree of token prefixes for reuse
    mamba_track_interval: int = 256  # hybrid targets with the prefix cache: save the recurrent state every N tokens

    def __post_init__(self):
        _check_types(self)
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.load_format not in LOAD_FORMATS:
            raise OptionError(f"{{load_format}} must be {' or '.join(LOAD_FORMATS)}, got {{load_format!r}}",
                              load_format=self.load_format)
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join("none" if q is None else q for q in QUANTIZATIONS)
            raise OptionError(f"{{quantization}} must be one of {names}, got {{quantization!r}}",
                              quantization=self.quantization)
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise OptionError("{overlap_schedule} must be auto, on or off, got {overlap_schedule!r}",
                              overlap_schedule=self.overlap_schedule)
        if self.graphs not in GRAPH_MODES:
            raise OptionError(f"{{graphs}} must be one of {', '.join(GRAPH_MODES)}, got {{graphs!r}}",
                              graphs=self.graphs)
        if self.attention_backend not in ("torch", "flashinfer"):
            raise OptionError("{attention_backend} must be torch or flashinfer, got {attention_backend!r}",
                              attention_backend=self.attention_backend)
        if not 0 < self.kv_mem_fraction <= 1:
            raise OptionError("{kv_mem_fraction} must be a number in (0, 1], got {kv_mem_fraction!s}",
                              kv_mem_fraction=self.kv_mem_fraction)
        if self.cuda_graph_bs is not None and not (self.cuda_graph_bs and all(
                isinstance(bs, int) and not isinstance(bs, bool) and bs >= 1 for bs in self.cuda_graph_bs)):
            raise OptionError("{cuda_graph_bs} must be None or a non-empty tuple of integers >= 1",
                              cuda_graph_bs=self.cuda_graph_bs)
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise OptionError("{cuda_graph_max_bs} must be >= 1, got {cuda_graph_max_bs!s}",
                              cuda_graph_max_bs=self.cuda_graph_max_bs)
        check_dtype(self.dtype, auto=True)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise OptionError(f"{{kv_cache_dtype}} must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              "{kv_cache_dtype!r}", kv_cache_dtype=self.kv_cache_dtype)
        kv = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if (self.attention_backend == "flashinfer" and self.dtype != "auto" and kv not in (None, self.dtype)
                and not kv.startswith("float8")):
            raise OptionError("{attention_backend=} reads a KV cache in the model's {dtype=} or in fp8; "
                              "{kv_cache_dtype=} needs {attention_backend=torch}", attention_backend="flashinfer",
                              dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise OptionError("{page_size} must be a power of two >= 1, got {page_size!s}",
                              page_size=self.page_size)
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise OptionError("{max_total_tokens} must be >= {page_size=}, got {max_total_tokens!s}",
                              max_total_tokens=self.max_total_tokens, page_size=self.page_size)
        if self.mamba_track_interval < 1:
            raise OptionError("{mamba_track_interval} must be >= 1, got {mamba_track_interval!s}",
                              mamba_track_interval=self.mamba_track_interval)
        if self.chunked_prefill_size < 1:
            raise OptionError("{chunked_prefill_size} must be >= 1, got {chunked_prefill_size!s}"
                              + (" (SGLang's -1, no chunking: pass a size at least the longest prompt's)"
                                 if self.chunked_prefill_size == -1 else ""),
                              chunked_prefill_size=self.chunked_prefill_size)
        if self.max_context_len is not None and self.max_context_len < 1:
            raise OptionError("{max_context_len} must be >= 1, got {max_context_len!s}",
                              max_context_len=self.max_context_len)
        if self.max_running_requests < 1:
            raise OptionError("{max_running_requests} must be >= 1, got {max_running_requests!s}",
                              max_running_requests=self.max_running_requests)
        check_device(self.device)
        if self.quantization == "gguf" and self.device != "cpu":
            raise OptionError("{quantization=} runs on the CPU (fastspec's block kernels); use {device=cpu}",
                              quantization="gguf", device=self.device)
        if self.graphs == "cuda" and self.device == "cpu":
            raise OptionError("{graphs=} needs a CUDA device, got {device=}"
                              + ("" if _cuda_available() else " (torch sees no GPU here)")
                              + "; {graphs=compile} is the CPU form", graphs="cuda", device="cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_cache_torch_name(self) -> str:
        """The KV pools' dtype name (kv_cache_dtype_name); read once the quantization is resolved (Worker)."""
        return kv_cache_dtype_name(self.kv_cache_dtype, self.dtype, self.device, self.quantization)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.kv_cache_torch_name)

    @property
    def graph_mode(self) -> str:
        """`auto`: CUDA graphs on a GPU; on CPU eager. bench/bench_graphs.py measures compiled rounds within a few
        percent of eager on CPU (either way, by the machine), which does not repay a cold compile of minutes."""
        if self.graphs != "auto":
            return self.graphs
        return "cuda" if self.device.startswith("cuda") else "eager"

    @property
    def overlap(self) -> bool:
        """`auto`: on for CUDA, off on CPU, where the device is the host: nothing would overlap but the hand-out
        of a step (bench/bench_overlap.py measures both)."""
        if self.overlap_schedule == "auto":
            return self.device.startswith("cuda")
        return self.overlap_schedule == "on"

    @property
    def graph_buckets(self) -> list[int]:
        from fastspec.graphs import default_buckets

        if self.cuda_graph_bs:
            return sorted(set(self.cuda_graph_bs))
        return default_buckets(min(self.cuda_graph_max_bs or self.max_running_requests, self.max_running_requests))


def _check_types(config: EngineConfig) -> None:
    """Each option of the type `_TYPES` names, before any is read (an API caller's page_size="16", device=0 or
    attention_backend=["torch"] is one line, not a TypeError from inside or a truthy "false" taken); a torch.device,
    a path and a list of buckets are taken as their str or tuple."""
    torch = sys.modules.get("torch")  # (a torch.device given means torch is imported)
    if torch is not None and isinstance(config.device, torch.device):
        object.__setattr__(config, "device", str(config.device))
    for name, (kinds, words) in _TYPES.items():
        value = getattr(config, name)
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise OptionError(f"{{{name}}} must be {words}, got {type(value).__name__}", **{name: value})
    if isinstance(config.model, os.PathLike):
        object.__setattr__(config, "model", os.fspath(config.model))
    if isinstance(config.cuda_graph_bs, list):  # (a frozen config is hashable)
        object.__setattr__(config, "cuda_graph_bs", tuple(config.cuda_graph_bs))
    object.__setattr__(config, "kv_mem_fraction", float(config.kv_mem_fraction))


_STR, _INT, _BOOL = ((str,), "a str"), ((int,), "an integer"), ((bool,), "True or False")
_INT_OR_NONE = ((int, type(None)), "an integer or None")
_TYPES = {"model": ((str, os.PathLike), "a directory, a hub id, a .gguf file or an embedded model's name"),
          "load_format": _STR, "quantization": ((str, type(None)), "a str or None"), "dtype": _STR,
          "kv_cache_dtype": _STR, "device": ((str,), "a str such as 'cpu' or 'cuda:0' (or a torch.device)"),
          "page_size": _INT, "max_total_tokens": _INT_OR_NONE,
          "kv_mem_fraction": ((numbers.Real,), "a number in (0, 1]"), "max_running_requests": _INT,
          "max_context_len": _INT_OR_NONE, "chunked_prefill_size": _INT,
          "speculative_fallback": _BOOL, "graphs": _STR, "cuda_graph_max_bs": _INT_OR_NONE,
          "cuda_graph_bs": ((tuple, list, type(None)), "None or a non-empty tuple of integers >= 1"),
          "attention_backend": _STR, "overlap_schedule": _STR, "radix_cache": _BOOL, "mamba_track_interval": _INT}
GRAPH_MODES = ("auto", "cuda", "compile", "eager")
LOAD_FORMATS = ("auto", "dummy")
