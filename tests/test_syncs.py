"""A speculative round reads the device once (twice with pages): the accepted nodes and emitted tokens, in one
`.tolist()` (and the paged allocator's input check). Every other read (an `.item()`, `nonzero`, a `.tolist()`)
stalls a GPU's launch queue each round, so adding one fails here.
Counted on CPU through the dispatcher (boolean-mask indexing does not show there; the commit plan uses none)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastspec.sampling import SamplingParams
from test_speculative import PROMPTS, spec_llm

READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default"}


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
    real_round, real_tolist = worker.spec_round, torch.Tensor.tolist

    def counted(reqs, params):
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(1) or real_tolist(t))
        try:
            with reads:
                return real_round(reqs, params)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)

    monkeypatch.setattr(worker, "spec_round", counted)
    outputs = llm.engine.generate(PROMPTS[:4], [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4)
    rounds = max(o.metrics.verify_rounds for o in outputs)
    assert rounds > 2
    # paged pools read once more: the paged allocator's alloc_extend checks its inputs in one read (a next step)
    assert reads.count == 0 and len(tolists) == rounds * (1 if page == 1 else 2)
