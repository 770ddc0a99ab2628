"""A speculative round reads the device once: the accepted nodes and emitted tokens, in one `.tolist()`. Every
other read (`.item()`, `int(t)`, `nonzero`, another `.tolist()`) stalls a GPU's launch queue each round, so adding
one fails here. Counted on CPU: through the dispatcher, and by wrapping the tensor methods that read a value
(boolean-mask indexing does not show on CPU; the commit plan uses none)."""

import traceback

import pytest
import torch
from test_speculative import PROMPTS, spec_llm
from torch.utils._python_dispatch import TorchDispatchMode

from fastspec.attention import paged
from fastspec.kernels import cpu_fused
from fastspec.sampling import SamplingParams

READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default"}
VALUE_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


class DeviceReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func) in READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm, draft, steps, topk, n, page", [("EAGLE", "eagle", 4, 2, 6, 1),
                                                                    ("EAGLE3", "eagle3", 3, 1, 4, 16),
                                                                    ("STANDALONE", "self", 3, 3, 8, 16),
                                                                    ("NGRAM", None, None, None, 6, 1)])
def test_a_speculative_round_reads_the_device_once(tiny_dirs, draft_dirs, monkeypatch, algorithm, draft, steps,
                                                   topk, n, page):
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, steps, topk, n, page)
    worker, reads, tolists = llm.engine.worker, DeviceReads(), []
    real_round = worker.spec_rounds.run

    methods = {name: getattr(torch.Tensor, name) for name in VALUE_READS}
    host_side = {"on": False}  # NGRAM drafts on the host by design (its trie and tensors never leave the CPU)
    # the paged-attention CPU kernels' dense plan reads the longest length (the twin's and the C kernel's; on CUDA
    # Triton reads none)
    for module, name in ((paged, "twin_plan"), (cpu_fused, "paged_dense_plan")):
        def dense(*args, real=getattr(module, name)):
            host_side["on"] = True
            try:
                return real(*args)
            finally:
                host_side["on"] = False
        monkeypatch.setattr(module, name, dense)
    if algorithm == "NGRAM":
        for drafter in worker.drafters.values():
            real_draft = drafter.draft

            def draft(batch, real_draft=real_draft):
                host_side["on"] = True
                try:
                    return real_draft(batch)
                finally:
                    host_side["on"] = False
            monkeypatch.setattr(drafter, "draft", draft)

    def counted(reqs, params):
        for name, real in methods.items():
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, real=real, name=name:
                                (None if host_side["on"] else tolists.append(name)) or real(t, *a))
        try:
            with reads:
                return real_round(reqs, params)
        finally:
            for name, real in methods.items():
                monkeypatch.setattr(torch.Tensor, name, real)

    monkeypatch.setattr(worker.spec_rounds, "run", counted)
    outputs = llm.engine.generate(PROMPTS[:4], [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)
    rounds = max(o.metrics.verify_rounds for o in outputs)
    assert rounds > 2
    assert reads.count == 0 and tolists == ["tolist"] * rounds


@pytest.mark.parametrize("algorithm, draft, topk, page, overlap", [("EAGLE", "eagle", 2, 1, "on"),
                                                                   ("EAGLE3", "eagle3", 1, 16, "off"),
                                                                   ("NGRAM", None, None, 1, "off"),
                                                                   ("NONE", None, None, 16, "off")])
def test_steps_copy_host_values_without_waiting_for_the_device(tiny_dirs, draft_dirs, monkeypatch, algorithm, draft,
                                                               topk, page, overlap):
    """`torch.tensor(values, device=d)` and a blocking `.to(d)` synchronise a CUDA stream (the host waits for every
    queued kernel): a step moves host values with fastspec.utils.transfer.to_device instead. Watched on CPU, where the
    same calls are visible: no step (prefill, plain or speculative round, sampled or greedy, controlled, with
    logprobs, from the prefix cache) makes one."""
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, 3 if draft else None, topk,
                   None if algorithm == "NONE" else 6, page,
                   overlap_schedule=overlap)
    worker, blocking, inside = llm.engine.worker, [], {"on": False}
    real_tensor, real_to, real_step = torch.tensor, torch.Tensor.to, worker.step

    def tensor(*args, **kwargs):
        if inside["on"] and kwargs.get("device") is not None:
            blocking.append(("torch.tensor", kwargs["device"], traceback.format_stack(limit=3)[0].strip()))
        return real_tensor(*args, **kwargs)

    def to(t, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if inside["on"] and device is not None and not kwargs.get("non_blocking", False):
            blocking.append(("Tensor.to", device, traceback.format_stack(limit=3)[0].strip()))
        return real_to(t, *args, **kwargs)

    def step(reqs, prefill):
        inside["on"] = True
        try:
            return real_step(reqs, prefill)
        finally:
            inside["on"] = False

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(worker, "step", step)
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=3)]
    llm.engine.generate(PROMPTS[:2], params)
    # again, from the prefix cache, with penalties, a logit bias, min_p and logprobs
    controlled = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.7, seed=1, repetition_penalty=1.3,
                                frequency_penalty=0.2, presence_penalty=0.1, logit_bias=((5, 2.0),), min_p=0.05,
                                logprobs=2)
    llm.engine.generate(PROMPTS[:2], [params[0], controlled])
    assert blocking == []


@pytest.mark.parametrize("topk, page", [(2, 1), (1, 16)])
def test_a_greedy_round_walks_no_tree_and_writes_no_table_on_the_host(tiny_dirs, draft_dirs, monkeypatch, topk,
                                                                      page):
    """Greedy rounds take the verify graph's own acceptance and its table write (a graph replay on a GPU, where
    each host op is a launch); the host-side walk and the table write stay for other rounds. Lossless still."""
    from test_speculative import reference

    from fastspec.engine import spec_rounds
    from fastspec.memory import ReqToTokenTable

    llm = spec_llm(tiny_dirs, draft_dirs, "llama", "EAGLE3", "eagle3", 3, topk, 4, page)
    worker, calls = llm.engine.worker, []
    real_round = worker.spec_rounds.run

    def counted(reqs, params):
        with monkeypatch.context() as m:
            m.setattr(spec_rounds, "verify_greedy", lambda *a: calls.append("verify_greedy"))
            m.setattr(ReqToTokenTable, "write", lambda *a: calls.append("table.write"))
            return real_round(reqs, params)

    monkeypatch.setattr(worker.spec_rounds, "run", counted)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = llm.engine.generate(PROMPTS[:3], [params] * 3)
    assert all(o.metrics.verify_rounds for o in outputs) and calls == []
    assert [o.output_ids for o in outputs] == reference(tiny_dirs, "llama", page, PROMPTS[:3], params)
