"""Host work per speculative round, counted rather than timed: the torch ops a round dispatches outside its graphs.

On a GPU every op the host dispatches outside a captured graph is at least one kernel launch (~5-20 us of host
time through Python and the dispatcher), so their count per round is what the host's share of a round scales with.
Counted on any machine: a tiny random Llama with a random
EAGLE-3 head (or the embedded model, --embedded), rounds run serially through compiled round functions
(`--graphs compile`, as the CUDA graphs are laid out: the runner's input copies and output clones are host ops),
every op attributed to the innermost fastspec line that dispatched it; what runs inside a compiled round function
(one CUDA graph replay on a GPU) is not counted. Writes JSON (--output) and prints the table.

    .venv/bin/python bench/bench_host_ops.py [--batch-sizes 1,4] [--shape 3,2,4] [--rounds 20] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fastspec  # noqa: E402
from fastspec.sampling import SamplingParams  # noqa: E402
from fastspec.graphs import GraphRunner  # noqa: E402

FREE = {"aten.detach.default", "aten.alias.default", "aten.view.default", "aten._unsafe_view.default",
        "aten.t.default", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
        "aten.slice.Tensor", "aten.select.int", "aten.permute.default", "aten.transpose.int", "aten.split.Tensor",
        "aten.unbind.int", "aten.lift_fresh.default"}  # metadata only: no kernel on any device


class OpCounter(TorchDispatchMode):
    """Counts kernel-launching ops by the innermost fastspec frame."""

    def __init__(self):
        super().__init__()
        self.host = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in FREE:
            self.host[_where()] += 1
        return func(*args, **(kwargs or {}))


def _where() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/fastspec/" in frame.filename and "/bench/" not in frame.filename:
            return f"{frame.filename.split('/fastspec/')[-1]}:{frame.lineno} {frame.line}"
    return "?"


def build(args):
    if args.embedded:
        return fastspec.LLM(quantization=None, speculative_algorithm="EAGLE3", num_steps=args.shape[0],
                            topk=args.shape[1], num_draft_tokens=args.shape[2], graphs="compile", overlap_schedule="off",
                            speculative_fallback=False, tuned=False)
    from tiny_models import make_hf_model

    from fastspec.models.heads import write_random_head

    root = Path(tempfile.mkdtemp())
    model = make_hf_model("llama")
    model.save_pretrained(root / "target")
    head = write_random_head(root / "head", model.config.hidden_size, model.config.vocab_size, "eagle3")
    return fastspec.LLM(str(root / "target"), speculative_algorithm="EAGLE3", draft_model=str(head),
                        num_steps=args.shape[0], topk=args.shape[1], num_draft_tokens=args.shape[2],
                        graphs="compile", overlap_schedule="off", max_total_tokens=4096, speculative_fallback=False)


def count(llm, bs: int, rounds: int) -> dict:
    worker, counter, done = llm.engine.worker, OpCounter(), {"rounds": 0, "graphs": 0}
    real_run, real_call = worker.spec_rounds.run, GraphRunner._call
    prompts = [[3 + i, 14, 15, 92, 65] for i in range(bs)]
    # compile first, every bucket the counted run goes through (compiling one inside the counter fails)
    llm.engine.generate(prompts, [SamplingParams(max_new_tokens=rounds, ignore_eos=True)] * bs)

    def run(reqs, params):
        done["rounds"] += 1
        with counter:
            return real_run(reqs, params)

    def call(runner, bucket):  # one graph replay on a GPU: not counted
        done["graphs"] += 1
        with _disable_current_modes():
            return real_call(runner, bucket)

    worker.spec_rounds.run, GraphRunner._call = run, call
    try:
        llm.engine.generate(prompts, [SamplingParams(max_new_tokens=rounds, ignore_eos=True)] * bs)
    finally:
        worker.spec_rounds.run, GraphRunner._call = real_run, real_call
    n = max(done["rounds"], 1)
    return {"rounds": done["rounds"], "host_ops_per_round": sum(counter.host.values()) / n,
            "graph_replays_per_round": done["graphs"] / n,
            "host_by_line": {k: v / n for k, v in counter.host.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--shape", default="3,2,4", help="num_steps,topk,num_draft_tokens")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--embedded", action="store_true", help="the embedded model and its EAGLE-3 head")
    parser.add_argument("--output", default="bench/results/host_ops.json")
    args = parser.parse_args()
    args.shape = tuple(int(v) for v in args.shape.split(","))
    llm = build(args)
    report = {"shape": args.shape, "embedded": args.embedded, "by_batch_size": {}}
    for bs in (int(v) for v in args.batch_sizes.split(",")):
        result = count(llm, bs, args.rounds)
        report["by_batch_size"][bs] = result
        print(f"batch {bs}: {result['host_ops_per_round']:.1f} host ops per round outside the graphs, "
              f"{result['graph_replays_per_round']:.1f} graph replays ({result['rounds']} rounds)")
        for line, per_round in list(result["host_by_line"].items())[: args.top]:
            print(f"  {per_round:6.1f}  {line}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
