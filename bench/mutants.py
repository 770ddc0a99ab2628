"""Mutation spot-check: plant plausible bugs one at a time in a scratch copy of the tree and report which ones the
tests that cover them let through (a survivor is a check that cannot see its bug).

    .venv/bin/python bench/mutants.py                 # every mutant (a few minutes each on a 2-core box)
    .venv/bin/python bench/mutants.py --only backlog  # those whose name contains "backlog"
    .venv/bin/python bench/mutants.py --list

Each mutant names one exact edit (the text must occur once: a refactor that moves it makes the script say so
rather than plant nothing) and the test files that should catch it. The scratch copy is every file git tracks or
would track, with PYTHONPATH pointing at it, so the installed package is not touched. Results go to
bench/results/mutants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file to edit, relative to the repository root
    old: str  # exact text, found once
    new: str
    tests: tuple[str, ...]  # pytest arguments (files or node ids) that should fail


STATE = "tests/test_draft_state.py::test_draft_state_equals_a_fresh_prefill_after_every_path"
MUTANTS = [
    Mutant("backlog catch-up one position late", "fastspec/speculative/backlog.py",
           "positions = [start + j for", "positions = [start + j + 1 for",
           (STATE, "tests/test_policy.py")),
    Mutant("backlog catch-up features shifted by a row", "fastspec/speculative/backlog.py",
           "torch.cat([features for *_, features in batch]),",
           "torch.roll(torch.cat([features for *_, features in batch]), 1, 0),",
           (STATE, "tests/test_policy.py")),
    Mutant("backlog bound never reached", "fastspec/speculative/backlog.py",
           "return [r for r in reqs if self.behind(r.rid) >= self.max_rows]", "return []",
           ("tests/test_policy.py",)),
    Mutant("decode-round draft extend one position late", "fastspec/engine/spec_rounds.py",
           "positions = torch.where(kept, batch.seq_lens[:, None] + torch.arange",
           "positions = torch.where(kept, batch.seq_lens[:, None] + 1 + torch.arange",
           (STATE,)),
    Mutant("prefix cache keyed by tokens alone", "fastspec/engine/prefix_cache.py",
           "return list(zip(tokens, tokens[1:]))", "return list(tokens[:-1])",
           ("tests/test_draft_state.py::test_draft_state_from_the_prefix_cache",)),
    Mutant("chat warm-up keeps its cached prefix", "fastspec/text/conversation.py",
           "        engine.flush_cache()\n        engine.policy = policy", "        engine.policy = policy",
           ("tests/test_chat_output.py",)),
    Mutant("wrapper pushes a word that exactly fits", "fastspec/text/wrap.py",
           "self.col + len(self.spaces) + cells(self.word) > self.cols",
           "self.col + len(self.spaces) + cells(self.word) >= self.cols", ("tests/test_chat_output.py",)),
    Mutant("code fence never closes", "fastspec/text/wrap.py",
           "self.code = not self.code", "self.code = True", ("tests/test_chat_output.py",)),
    Mutant("MLP.fuse a no-op", "fastspec/models/layers.py",
           "            self.gate_up_proj = merged\n"
           "            del self.gate_proj, self.up_proj", "            pass", ("tests/test_models.py",)),
    Mutant("a draft layer per step reads zeros before each extend", "fastspec/speculative/eagle_drafter.py",
           "            return state.layers", "            return torch.zeros_like(state.layers)",
           ("tests/test_draft_state.py::test_nextn_draft_state_equals_a_fresh_prefill",)),
    Mutant("drafter keeps a released request's state", "fastspec/speculative/eagle_drafter.py",
           "        self.states.pop(rid, None)", "        pass", (STATE,)),
    Mutant("draft extend rows see the rows after them", "fastspec/speculative/steps.py",
           "new_mask = torch.ones(e, e, dtype=torch.bool, device=device).tril() & valid",
           "new_mask = torch.ones(e, e, dtype=torch.bool, device=device) & valid", (STATE,)),
    Mutant("draft state from the row before the last", "fastspec/speculative/steps.py",
           "last = torch.arange(bs, device=device) * e + (lens - 1).clamp(min=0)",
           "last = torch.arange(bs, device=device) * e + (lens - 2).clamp(min=0)", (STATE,)),
    Mutant("draft loop steps one position late", "fastspec/speculative/steps.py",
           "args = (sel.input_ids, positions + step, sel.hidden, attn)",
           "args = (sel.input_ids, positions + step + 1, sel.hidden, attn)", (STATE, "tests/test_speculative.py")),
    Mutant("draft loop rows see their own branch's slots, not their ancestors'", "fastspec/speculative/steps.py",
           "ancestors = torch.cat([ancestors[sel.parent_rows], scratch[sel.parent_rows, step - 1:step]], 1)",
           "ancestors = torch.cat([ancestors, scratch[:, step - 1:step]], 1)",
           (STATE, "tests/test_speculative.py", "tests/test_tree.py")),
    Mutant("prefix cache evicts the most recently used first", "fastspec/memory/radix.py",
           "heap = [(leaf.last_use, id(leaf), leaf)", "heap = [(-leaf.last_use, id(leaf), leaf)",
           ("tests/test_radix.py", "tests/test_radix_cache.py")),
    Mutant("NGRAM learns from the prompt only", "fastspec/speculative/ngram.py",
           "            self._caches[rid] = NgramCache(self.params)\n        self._caches[rid].insert(tokens)",
           "            self._caches[rid] = NgramCache(self.params)\n            self._caches[rid].insert(tokens)",
           ("tests/test_ngram.py", "tests/test_ngram_oracle.py")),
    Mutant("repetition penalty pushes the wrong way", "fastspec/sampling/controls.py",
           "row / p.repetition_penalty, row * p.repetition_penalty",
           "row * p.repetition_penalty, row / p.repetition_penalty", ("tests/test_controls.py",)),
    Mutant("/metrics counts rounds as accepted tokens", "fastspec/serve/prometheus.py",
           "self.accepted_tokens.inc(spec.accepted_tokens)", "self.accepted_tokens.inc(spec.verify_rounds)",
           ("tests/test_serve_metrics.py",)),
    Mutant("pythonic call sent from its name on", "fastspec/serve/pythonic.py",
           "            return calls or None\n        calls.append((m.group(1), arguments))",
           "            return calls + [(m.group(1), '')] if m is not None and m.group(1) in names else calls or None\n"
           "        calls.append((m.group(1), arguments))", ("tests/test_tool_stream.py",)),
    Mutant("free-text calls read as if a grammar held them", "fastspec/serve/app.py",
           "return replace(tools, held=False), params, keep_special", "return tools, params, keep_special",
           ("tests/test_serve_tools.py",)),
    Mutant("tool_choice none still shows the tools", "fastspec/serve/app.py",
           'offered = parsed.tools is not None and parsed.tools.choice != "none"',
           "offered = parsed.tools is not None", ("tests/test_serve_tools.py",)),
    Mutant("profile's host share inverted", "fastspec/benchmark/profile.py",
           "round(max(0.0, 1 - busy / wall), 3)", "round(max(0.0, busy / wall), 3)",
           ("tests/test_product_bench.py::test_profile_step_is_the_difference_of_two_runs_per_step",)),
    Mutant("FASTSPEC_GRAPH_FALLBACK=0 ignored", "fastspec/graphs/runner.py",
           'os.environ.get("FASTSPEC_GRAPH_FALLBACK", "1") != "0"', "True", ("tests/test_graph_misuse.py",)),
]


def scratch_copy(dest: Path) -> None:
    """Every file git tracks or would track (untracked, not ignored), as in the working tree now."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def plant(tree: Path, m: Mutant) -> None:
    path = tree / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name!r}: {m.path} holds its text {text.count(m.old)} times, not once")
    path.write_text(text.replace(m.old, m.new))


def run(m: Mutant, timeout: int) -> dict:
    """Plant `m` in a fresh scratch copy and run its tests: caught when they fail."""
    with tempfile.TemporaryDirectory(prefix="fastspec-mutant-") as tmp:
        tree = Path(tmp)
        scratch_copy(tree)
        plant(tree, m)
        env = os.environ | {"PYTHONPATH": str(tree)}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            outcome = "caught" if proc.returncode == 1 else "survived" if proc.returncode == 0 else "error"
            tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else proc.stderr.splitlines()[-1:]
        except subprocess.TimeoutExpired:
            outcome, tail = "timeout", []
        return {"mutant": m.name, "outcome": outcome, "seconds": round(time.perf_counter() - start, 1),
                "tests": list(m.tests), "pytest": tail[0] if tail else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    parser.add_argument("--out", default=str(ROOT / "bench/results/mutants.json"))
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if args.only in m.name]
    if args.list or not chosen:
        for m in MUTANTS:
            print(f"{m.name}: {m.path} -> {' '.join(m.tests)}")
        return
    results = []
    for m in chosen:
        results.append(run(m, args.timeout))
        r = results[-1]
        print(f"{r['outcome']:>8}  {r['seconds']:7.1f} s  {m.name}  ({r['pytest']})", flush=True)
    survivors = [r["mutant"] for r in results if r["outcome"] != "caught"]
    caught = f"{len(results) - len(survivors)}/{len(results)} caught"
    print(caught + (f"; not caught: {survivors}" if survivors else ""))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
