"""On a CUDA device (skipped elsewhere): the lossless matrix decodes on cuda exactly as on the CPU reference, every
target family runs plain and NGRAM rounds on cuda, rounds capture as CUDA graphs, and no round function reads a
host tensor while it runs on the device (each such read is a host->device copy that breaks graph capture: the
first CUDA run found three, in RoPE, YaRN and the commit plan)."""

import traceback

import pytest
import torch
from conftest import FAMILIES
from test_speculative import CASES, PROMPTS, reference, spec_llm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fastspec
from fastspec.graphs.step_graphs import StepGraphs
from fastspec.sampling import SamplingParams

pytestmark = pytest.mark.gpu
COPIES = {"aten._to_copy.default", "aten.copy_.default"}


class HostReads(TorchDispatchMode):
    """Records each op that mixes a host tensor into device work (op name + the fastspec lines that called it)."""

    def __init__(self):
        super().__init__()
        self.found: set[tuple[str, tuple[str, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(t.is_cuda for t in tensors) or str(kwargs.get("device", "")).startswith("cuda")
        host = [t for t in tensors if t.device.type == "cpu" and (t.dim() > 0 or str(func) in COPIES)]
        if on_device and host:
            lines = tuple(f"{f.filename.split('/fastspec/')[-1]}:{f.lineno}" for f in traceback.extract_stack()
                          if "/fastspec/" in f.filename)
            self.found.add((str(func), lines[-3:]))
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch):
    """Watches every round function (draft loop, draft extend, verify) while it runs eagerly on the device."""
    mode, real = HostReads(), StepGraphs.__call__

    def watched(self, bs, inputs):
        with mode:
            return real(self, bs, inputs)

    monkeypatch.setattr(StepGraphs, "__call__", watched)
    yield mode
    assert not mode.found, f"round functions read host tensors: {sorted(mode.found)}"


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}/{c[4]}/{c[5]}-p{c[6]}" for c in CASES])
def test_cuda_rounds_are_lossless_and_read_no_host_tensor(tiny_dirs, draft_dirs, host_reads, case):
    family, algorithm, draft, steps, topk, n, page, bs = case
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, family, algorithm, draft, steps, topk, n, page, device="cuda",
                   dtype="float32", graphs="eager")
    got = [o.output_ids for o in llm.engine.generate(PROMPTS[:bs], [params] * bs)]
    cpu = fastspec.LLM(str(tiny_dirs[family][0]), max_total_tokens=4096, page_size=page, device="cpu")
    assert got == [o.output_ids for o in cpu.engine.generate(PROMPTS[:bs], [params] * bs)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("algorithm", ["NONE", "NGRAM"])
def test_every_family_decodes_on_cuda(tiny_dirs, host_reads, family, algorithm):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm = fastspec.LLM(str(tiny_dirs[family][0]), speculative_algorithm=algorithm, max_total_tokens=4096,
                       device="cuda", dtype="float32", graphs="eager")
    got = [o.output_ids for o in llm.engine.generate(PROMPTS[:4], [params] * 4)]
    cpu = fastspec.LLM(str(tiny_dirs[family][0]), max_total_tokens=4096, device="cpu")
    assert got == [o.output_ids for o in cpu.engine.generate(PROMPTS[:4], [params] * 4)]


@pytest.mark.parametrize("algorithm, shape", [("EAGLE3", (3, 2, 5)), ("NGRAM", (None, None, 8)),
                                              ("NONE", (None, None, None))])
def test_rounds_capture_as_cuda_graphs_and_stay_lossless(tiny_dirs, draft_dirs, algorithm, shape):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, "eagle3" if algorithm == "EAGLE3" else None, *shape,
                   1, device="cuda", dtype="float32", graphs="cuda", cuda_graph_bs=(1, 2, 4),
                   max_running_requests=4)
    got = [o.output_ids for o in llm.engine.generate(PROMPTS[:3], [params] * 3)]
    assert got == reference(tiny_dirs, "llama", 1, PROMPTS[:3], params)


@pytest.mark.parametrize("algorithm, draft, shape, page", [("EAGLE3", "eagle3", (3, 2, 5), 1),
                                                           ("STANDALONE", "self", (3, 1, 4), 16)])
def test_launching_a_round_never_waits_for_the_device(tiny_dirs, draft_dirs, algorithm, draft, shape, page):
    """Under overlap, launching a speculative round (draft, verify, accept, commit, draft extend, the start of its
    readback) makes no stream synchronisation: CUDA's sync debug mode raises on one. Rounds launched ahead
    happen, captured as CUDA graphs, and the output equals the reference."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm = spec_llm(tiny_dirs, draft_dirs, "llama", algorithm, draft, *shape, page, device="cuda", dtype="float32",
                   graphs="cuda", cuda_graph_bs=(1, 2, 4), max_running_requests=4, overlap_schedule="on",
                   speculative_fallback=False)
    rounds, ahead = llm.engine.worker.spec_rounds, []
    real = rounds.launch

    def launch(reqs, spec_params, before):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(reqs, spec_params, before)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            ahead.append(before is not None)

    rounds.launch = launch
    got = [o.output_ids for o in llm.engine.generate(PROMPTS[:3], [params] * 3)]
    assert got == reference(tiny_dirs, "llama", page, PROMPTS[:3], params)
    assert sum(ahead) > len(ahead) // 2
