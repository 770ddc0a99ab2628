"""Frozen engine and speculative configuration values, each resolved once at construction.

A model's own configuration (config.json normalised) lives in fastspec.models.model_config. Nothing here touches
tensors beyond naming a dtype, and torch is imported only where a value needs it (a dtype asked for as a torch
dtype, `auto` / `cuda` devices): checking flags stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastspec.errors import FastspecError

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
# "none" is read as None; fp8 / int8 / int4 round a float checkpoint at load (or name an fp8 checkpoint's own); the
# others name a quantised checkpoint's method (models.quant_config)
QUANTIZATIONS = ("auto", None, "gguf", "fp8", "int8", "int4", "awq", "gptq", "compressed-tensors", "fbgemm_fp8")


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
        raise FastspecError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise FastspecError(f"--device {device}: no CUDA device is visible to torch here")
    if index and int(index) >= torch.cuda.device_count():
        raise FastspecError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")


def check_dtype(name: str) -> None:
    if name not in DTYPES:
        raise FastspecError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")


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
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when torch sees a GPU (resolved here), else cpu
    page_size: int = 1
    max_total_tokens: int | None = None  # static KV pool size in tokens; None: up to kv_mem_fraction (CPU: grows)
    kv_mem_fraction: float = 0.05  # without max_total_tokens, the KV pools' ceiling: this of the memory available
    max_running_requests: int = 48
    max_context_len: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int = 2048  # prompt tokens per prefill step (long prompts take several steps)
    speculative_fallback: bool = False  # per batch size, decode plainly while that is measured faster
    graphs: str = "auto"  # auto | cuda | compile | eager: how the draft loop, draft extend and verify run
    cuda_graph_max_bs: int | None = None  # largest graph bucket (None: max_running_requests); larger: eager
    cuda_graph_bs: tuple[int, ...] | None = None  # explicit bucket list
    attention_backend: str = "torch"  # torch | flashinfer
    overlap_schedule: str = "auto"  # auto | on | off: launch the next decode round before handing out the last
    radix_cache: bool = True  # keep finished requests' KV in a radix tree of token prefixes for reuse
    mamba_track_interval: int = 256  # hybrid targets with the prefix cache: save the recurrent state every N tokens

    def __post_init__(self):
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.load_format not in LOAD_FORMATS:
            raise FastspecError(f"--load-format must be {' or '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join("none" if q is None else q for q in QUANTIZATIONS)
            raise FastspecError(f"--quantization must be one of {names}, got {self.quantization!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise FastspecError(f"--overlap-schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.graphs not in GRAPH_MODES:
            raise FastspecError(f"--graphs must be one of {', '.join(GRAPH_MODES)}, got {self.graphs!r}")
        if self.attention_backend not in ("torch", "flashinfer"):
            raise FastspecError(f"--attention-backend must be torch or flashinfer, got {self.attention_backend!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise FastspecError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        check_dtype(self.dtype)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise FastspecError(f"page size must be a power of two >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise FastspecError(f"max-total-tokens must be >= the page size, got {self.max_total_tokens}")
        if self.mamba_track_interval < 1:
            raise FastspecError(f"--mamba-track-interval must be >= 1, got {self.mamba_track_interval}")
        if self.chunked_prefill_size < 1:
            raise FastspecError(f"--chunked-prefill-size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise FastspecError(f"max-running-requests must be >= 1, got {self.max_running_requests}")
        check_device(self.device)
        if self.quantization == "gguf" and self.device != "cpu":
            raise FastspecError("--quantization gguf runs on the CPU (fastspec's block kernels); use --device cpu")
        if self.graphs == "cuda" and self.device == "cpu":
            raise FastspecError("--graphs cuda needs a CUDA device, got --device cpu"
                                + ("" if _cuda_available() else " (torch sees no GPU here)")
                                + "; --graphs compile is the CPU form")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

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


GRAPH_MODES = ("auto", "cuda", "compile", "eager")
LOAD_FORMATS = ("auto", "dummy")
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
            raise FastspecError(f"{algo} needs a draft model (--speculative-draft-model-path / --draft)")
        if algo != "EAGLE" and token_map is not None:
            token_map = None  # SGLang ignores --speculative-token-map except for EAGLE (EAGLE-3 has d2t)
        steps, k, n = _auto_spec_params(algo, target_arch, num_steps, topk, num_draft_tokens, device == "cpu")
        return cls(draft_model=draft_model, num_steps=steps, topk=k, num_draft_tokens=n, token_map=token_map,
                   **common)

    @classmethod
    def _resolve_ngram(cls, common, ngram, num_steps, topk, num_draft_tokens) -> SpecConfig:
        ngram = ngram or NgramParams()
        n = num_draft_tokens or ngram.max_match_window_size
        if n < 2:
            raise FastspecError(f"--speculative-num-draft-tokens must be >= 2 for NGRAM, got {n}")
        return cls(num_steps=n - 1, topk=ngram.max_bfs_breadth, num_draft_tokens=n, ngram=ngram, **common)


def check_spec_flags(algorithm: str | None, num_steps: int | None = None, topk: int | None = None,
                     num_draft_tokens: int | None = None, accept_threshold_single: float = 1.0,
                     accept_threshold_acc: float = 1.0) -> str:
    """The canonical algorithm name, after every check that needs no model: the name, the thresholds, and the
    tree flags as far as they are given (whether a partial shape is feasible depends on the target's defaults,
    which `resolve` checks)."""
    algo = (algorithm or "NONE").upper()
    algo = "EAGLE" if algo == "NEXTN" else algo
    if algo not in SPEC_ALGORITHMS:
        raise FastspecError(f"unknown speculative algorithm {algorithm!r}; choose one of "
                            f"{', '.join(SPEC_ALGORITHMS)} (NEXTN = EAGLE)")
    for name, value in (("accept-threshold-single", accept_threshold_single),
                        ("accept-threshold-acc", accept_threshold_acc)):
        if not 0 <= value <= 1:
            raise FastspecError(f"--speculative-{name} must be in [0, 1], got {value}")
    for name, value, least in (("num-steps", num_steps, 1), ("eagle-topk", topk, 1),
                               ("num-draft-tokens", num_draft_tokens, 2)):
        if value is not None and value < least:
            raise FastspecError(f"--speculative-{name} must be >= {least}, got {value}")
    if algo in ("EAGLE", "EAGLE3", "STANDALONE") and None not in (num_steps, topk, num_draft_tokens):
        check_tree(num_steps, topk, num_steps + 1 if topk == 1 else num_draft_tokens)
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
        raise FastspecError(f"--speculative-num-steps and --speculative-eagle-topk must be >= 1, got {steps}, {k}")
    capacity = 1 + k + (steps - 1) * k * k  # root + every candidate the top-k expansion produces
    if not 2 <= n <= capacity or (k == 1 and n != steps + 1):
        raise FastspecError(f"--speculative-num-draft-tokens={n} is infeasible with num_steps={steps}, topk={k}: "
                            f"it must be in [2, {capacity}]" + (" and = num_steps + 1 for topk 1" if k == 1 else ""))
