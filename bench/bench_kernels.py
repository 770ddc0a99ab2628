"""Kernels, extern calls and copies per layer of the compiled round functions, read from Inductor's generated code.

Builds an engine with `--graphs compile` (CPU: Inductor's C++ backend; the fusion structure, what lands in one
kernel and what stays an extern call, is the one Triton gets on a GPU), compiles the plain-decode, verify, draft
loop and draft extend graphs for batch bucket 1 and reads the wrapper code Inductor wrote for each: every call in
its `call` function, a nested compile region's code counted each time it is called. Prints, per graph and per step:

- kernels: fused generated kernels (`cpp_fused_*` here, `triton_*` on a GPU);
- gemms: extern matrix products (`extern_kernels.mm / addmm / bmm`, fastspec's packed linear);
- attention: the paged-attention op (opaque to the compiler; on a GPU its Triton kernels: split + combine,
  or one kernel where the context is short);
- other extern: any other op the compiler left as a call (a fallback);
- copies: copies and fills Inductor kept as calls (`.copy_`, `.fill_`, `.zero_`, `aten.copy_`);

and each divided by the layers the graph runs (the target's for decode / verify, draft steps x draft layers for the
draft loop). Usage (repository root, CPU is enough):

    .venv/bin/python bench/bench_kernels.py [--graphs decode,verify,draft_loop,draft_extend] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

os.environ["FASTSPEC_GRAPH_FALLBACK"] = "0"  # a graph that does not compile is an error here, not eager kernels
RESULTS = Path(__file__).parent / "results" / "kernels.json"
GRAPHS = ("decode", "verify", "draft_loop", "draft_extend")
CATEGORIES = ("kernels", "gemms", "attention", "other_extern", "copies")

_SUBGRAPH_DEF = re.compile(r"^def (repeated_subgraph\d+)\(args\):", re.M)
_CALL_DEF = re.compile(r"^\s*def call\((?:self, )?args\):", re.M)
_SUBGRAPH_CALL = re.compile(r"=\s*(repeated_subgraph\d+)\(")
_KERNEL = re.compile(r"^\s*(cpp_fused_\w+|triton_\w+(?:\.run)?)\(")
_EXTERN = re.compile(r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+)")
_COPY = re.compile(r"\.(copy_|fill_|zero_)\(|aten\.(copy_|fill_|zero_)")


def function_bodies(code: str) -> dict[str, list[str]]:
    """Name -> lines of each top-level subgraph function and of `call` (the graph's entry)."""
    starts = [(m.start(), m.group(1)) for m in _SUBGRAPH_DEF.finditer(code)]
    starts += [(m.start(), "call") for m in _CALL_DEF.finditer(code)]
    starts.sort()
    bodies = {}
    for (start, name), end in zip(starts, [s for s, _ in starts[1:]] + [len(code)]):
        lines = code[start:end].splitlines()[1:]
        indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
        body = []
        for line in lines:  # the function ends at the first non-blank line indented less than its body
            if line.strip() and len(line) - len(line.lstrip()) < indent:
                break
            body.append(line)
        bodies.setdefault(name, body)
    return bodies


def classify(line: str) -> str | None:
    """Which category one wrapper-code line launches, or None (allocations, views, comments, asserts)."""
    stripped = line.strip()
    if not stripped or stripped.startswith(("#", "assert_", "del ")):
        return None
    if _KERNEL.match(line):
        return "kernels"
    if _COPY.search(stripped):
        return "copies"
    match = _EXTERN.search(stripped)
    if match is None:
        return None
    name = match.group(1)
    if "paged_attention" in name:
        return "attention"
    if name.startswith("extern_kernels.") and name.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm") or \
            "packed_linear" in name or "_mkl_linear" in name:
        return "gemms"
    return "other_extern"


def count_calls(code: str) -> Counter:
    """Launches per run of the graph's `call`, each subgraph's launches counted at every call of it."""
    bodies = function_bodies(code)
    memo: dict[str, Counter] = {}

    def count(name: str) -> Counter:
        if name not in memo:
            total = Counter()
            for line in bodies.get(name, []):
                sub = _SUBGRAPH_CALL.search(line)
                if sub is not None:
                    total += count(sub.group(1))
                elif (category := classify(line)) is not None:
                    total[category] += 1
            memo[name] = total
        return memo[name]

    return count("call")


def graph_codes(llm, names: tuple[str, ...]) -> dict[str, list[str]]:
    """Graph name -> the wrapper code Inductor generated while compiling it for bucket 1."""
    from torch._inductor.utils import run_and_get_code

    w = llm.engine.worker
    runners = {"decode": w.decode_graphs, "verify": next(iter(w.verify_graphs.values())),
               "draft_loop": w.drafter.loop_graphs, "draft_extend": w.drafter.extend_graphs}
    codes = {}
    for name in names:
        start = time.perf_counter()
        _, codes[name] = run_and_get_code(runners[name].runner.prepare, buckets=[1])
        print(f"{name}: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return codes


def layers_per_run(llm, name: str) -> int:
    """Decoder layers one run of the graph goes through."""
    w = llm.engine.worker
    if name in ("decode", "verify"):
        return w.model.config.num_layers
    draft_layers = w.drafter.model.config.num_layers
    return draft_layers * (w.drafter.num_steps if name == "draft_loop" else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--graphs", default=",".join(GRAPHS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from fastspec import LLM

    names = tuple(n for n in args.graphs.split(",") if n)
    unknown = set(names) - set(GRAPHS)
    if unknown:
        sys.exit(f"unknown graphs {sorted(unknown)} (known: {', '.join(GRAPHS)})")
    llm = LLM(model=args.model, quantization=None, graphs="compile", max_running_requests=1, max_total_tokens=2048,
              speculative_fallback=False)
    results = {}
    for name, codes in graph_codes(llm, names).items():
        counts = sum((count_calls(code) for code in codes), Counter())
        layers = layers_per_run(llm, name)
        results[name] = {"layers": layers, "per_step": {c: counts[c] for c in CATEGORIES},
                         "per_layer": {c: round(counts[c] / layers, 2) for c in CATEGORIES},
                         "launches_per_layer": round(sum(counts[c] for c in CATEGORIES) / layers, 2)}
    _print(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"model": args.model, "graphs": results}, indent=2) + "\n")


def _print(results: dict) -> None:
    print(f"{'graph':<13}{'layers':>7}" + "".join(f"{c:>14}" for c in CATEGORIES) + f"{'launches':>10}")
    for name, r in results.items():
        cells = "".join(f"{r['per_step'][c]:>6} ({r['per_layer'][c]:>4.1f})" for c in CATEGORIES)
        print(f"{name:<13}{r['layers']:>7}{cells}{r['launches_per_layer']:>10.1f}")
    print("each cell: per step (per layer); launches: all categories per layer")


if __name__ == "__main__":
    main()
