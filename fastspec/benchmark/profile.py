"""`fastspec bench --profile`: where a plain decode step's and a speculative round's time goes on this device (a
tuned schedule's plain tier: its plain step).

torch's profiler records two generations of the same prompts that differ only in length; their difference, divided
by the extra steps (plain) or verify rounds (speculative), is one step without the prefill and start-up. Each
recorded kernel (CUDA) or operator (CPU: self time, so nothing counts twice) falls into a category by its name:
GEMM, attention, norm / elementwise (Inductor's fused kernels), copies, sampling, other. The host's share is the
part of the wall time the device spends on nothing (CUDA: no kernel running; CPU: no operator running, i.e. Python).
Each linear of the target and the draft is named by the GEMM kernel it runs (quant_layers.gemm_kernel).
No printing here: fastspec.cli.bench renders the returned values.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

from fastspec.errors import FastspecError
from fastspec.models.quant_layers import gemm_kernels
from fastspec.sampling.params import SamplingParams

CATEGORIES = ("gemm", "attention", "norm/elementwise", "copies", "sampling", "other")
_RULES = (  # first match wins; CUDA kernel names and CPU operator names alike
    ("attention", re.compile(r"attention|flash|fmha|attn|^cpu_fused::attend", re.I)),
    ("sampling", re.compile(r"argmax|softmax|topk|top_k|sort|multinomial|sampl|exponential|cumsum", re.I)),
    ("gemm", re.compile(r"gemm|gemv|row_dots|addmm|\bmm\b|bmm|matmul|linear|int[48]pack|scaled_mm|cutlass|cublas|"
                        r"nvjet|xmma|triton_tem", re.I)),
    ("norm/elementwise", re.compile(r"^(triton_|cpp_fused|cpu_fused::)")),  # fused kernels (a KV write fused in too)
    ("copies", re.compile(r"memcpy|memset|copy_|fill_|zero_|\bclone\b|index_put|scatter|gather|::cat\b", re.I)),
    ("norm/elementwise", re.compile(r"compiled|elementwise|vectorized|reduce|norm|rsqrt|silu|"
                                    r"aten::(mul|add|sub|div|pow|mean|neg|cos|sin|exp|where|sum|rsqrt)", re.I)),
)


def category(name: str) -> str:
    return next((c for c, rule in _RULES if rule.search(name)), "other")


@dataclass(frozen=True)
class StepProfile:
    name: str                 # "plain step" or "speculative round"
    device: str               # "cuda" or "cpu"
    steps: float              # steps (or rounds) the difference covers
    ms_per_step: float        # wall time
    ms_by_category: dict      # device (CUDA kernel / CPU operator) time per step, by category
    launches_per_step: float  # CUDA kernels, or CPU operators, per step
    host_share: float         # fraction of the wall time with nothing running on the device
    gemm_kernels: dict        # {"target" / "draft": {the GEMM kernel a linear runs: how many linears run it}}

    def as_dict(self) -> dict:
        return asdict(self)


def profile_step(llm, prompt: list[int], bs: int, steps: int = 16, repeats: int = 3) -> StepProfile:
    """A plain decode step (an LLM without speculation, or one whose tuned schedule decodes plainly at `bs`: named
    so) or a speculative round at batch size `bs`, from profiled generations `steps` tokens apart (after a warm-up
    that prepares every graph they use), each length the fastest of `repeats` alternating runs: one run each let a
    busy machine's stall in the short one make the difference negative."""
    spec = llm.engine.spec
    speculative = spec.enabled and spec.params_for(bs) is not None
    name = "speculative round" if speculative else "plain step of the tuned schedule" if spec.enabled else "plain step"
    short, long = 4, 4 + steps
    _generate(llm, prompt, bs, long)  # warm-up: graphs prepared, caches filled
    runs = [[_recorded(llm, prompt, bs, n) for n in (short, long)] for _ in range(repeats)]
    (wall_a, busy_a, cats_a, n_a, rounds_a), (wall_b, busy_b, cats_b, n_b, rounds_b) = (
        min((r[i] for r in runs), key=lambda run: run[0]) for i in (0, 1))
    per = (rounds_b - rounds_a) / bs if speculative else steps
    if per <= 0:
        raise FastspecError(f"--profile: no speculative rounds ran at batch size {bs} (the measured fallback decoded "
                            "plainly; an LLM for profiling has speculative_fallback off, as `bench --profile` runs)")
    wall, busy = (wall_b - wall_a) / per, (busy_b - busy_a) / per
    # a noisy machine can make a small category's difference negative: it reads as nothing
    by = {c: round(max(cats_b[c] - cats_a[c], 0.0) / per * 1e3, 3) for c in CATEGORIES}
    return StepProfile(name, _device_kind(llm), round(per, 2), round(wall * 1e3, 3), by,
                       round((n_b - n_a) / per, 1), round(max(0.0, 1 - busy / wall), 3) if wall > 0 else 0.0,
                       linear_kernels(llm, speculative))


def linear_kernels(llm, speculative: bool) -> dict[str, dict[str, int]]:
    """The GEMM kernel each of the target's linears (and the draft's, where it drafts) runs, counted."""
    worker = llm.engine.worker
    models = {"target": worker.model, "draft": worker.draft_model if speculative else None}
    return {name: gemm_kernels(model) for name, model in models.items() if model is not None}


def _generate(llm, prompt: list[int], bs: int, tokens: int):
    llm.engine.flush_cache()  # every run prefills the same way
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    return llm.engine.generate([prompt] * bs, [params] * bs)


def _recorded(llm, prompt: list[int], bs: int, tokens: int):
    """(wall s, device-busy s, seconds by category, launches, verify rounds) of one profiled generation."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = _device_kind(llm) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    with _quiet_stderr():  # kineto prints a line as it starts and stops
        prof.start()
    try:
        start = time.perf_counter()
        outputs = _generate(llm, prompt, bs, tokens)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        with _quiet_stderr():
            prof.stop()
    events = [e for e in prof.events() if _on_device(e) == cuda]
    if cuda and not events:
        raise FastspecError("--profile: the profiler recorded no CUDA kernels (no device profiler: CUPTI missing?)")
    seconds = Counter()
    for e in events:
        seconds[category(e.name) if cuda else _cpu_category(e)] += _self_us(e, cuda) / 1e6
    rounds = sum(o.metrics.verify_rounds for o in outputs)
    return wall, sum(seconds.values()), seconds, len(events), rounds


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null (C++ code writes there directly, past sys.stderr)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _cpu_category(event) -> str:
    """An operator inside the attention op (the torch twin's matmuls and softmax) counts as attention."""
    parent = event.cpu_parent
    while parent is not None:
        if category(parent.name) == "attention":
            return "attention"
        parent = parent.cpu_parent
    return category(event.name)


def _device_kind(llm) -> str:
    return "cuda" if str(llm.engine.config.device).startswith("cuda") else "cpu"


def _on_device(event) -> bool:
    """A kernel (or memcpy / memset) the device ran, as opposed to a host-side operator."""
    return "CUDA" in str(getattr(event, "device_type", ""))


def _self_us(event, cuda: bool) -> float:
    if cuda:  # kernels have no children: their own time
        return float(getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0) or 0)
    return float(event.self_cpu_time_total)
