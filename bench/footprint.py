"""What one short answer costs from a cold process: peak resident memory and wall time (process start included) of a
16-token greedy chat answer on the embedded SmolLM2-135M-Instruct, for `fastspec generate` (plain and the default
EAGLE-3, packed as by default and dequantised with `--quantization none`) and for llama.cpp (llama-cpp-python) on
the same Q4_1 GGUF.

    .venv/bin/python bench/footprint.py [--trials 3] [--max-new-tokens 16] [--out PATH]

Each run is its own process, measured with wait4 (ru_maxrss: the peak resident set, shared library pages and
mapped weight files included); trials alternate between the commands and the median is reported. The conversion
and packing caches are warm (a first run fills them). llama.cpp runs with 2 threads and without its AMX / repacked
weight buffers (they crash on some VMs), as bench/peers.py runs it; skipped when llama_cpp is not installed.
Writes bench/results/footprint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Name three colours."
LLAMA_CPP = """
import sys
import llama_cpp.llama_cpp as api
from llama_cpp import Llama
defaults = api.llama_model_default_params
def plain_buffers():  # bench/peers.py's load_llama_cpp: weights in plain buffers (no repacking, no AMX)
    p = defaults()
    p.use_extra_bufts = False
    return p
api.llama_model_default_params = plain_buffers
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=int(sys.argv[3]),
                                 temperature=0.0)
print(out["choices"][0]["message"]["content"])
"""


def commands(max_new_tokens: int) -> dict[str, list[str]]:
    fastspec = [str(Path(sys.executable).with_name("fastspec")), "generate", "--prompt", PROMPT,
                "--max-new-tokens", str(max_new_tokens)]
    plain, dequantised = ["--speculative-algorithm", "NONE"], ["--quantization", "none"]
    runs = {"fastspec plain, dequantised": fastspec + plain + dequantised,
            "fastspec plain, packed (the default)": fastspec + plain,
            "fastspec default (EAGLE-3), dequantised": fastspec + dequantised,
            "fastspec default (EAGLE-3), packed (the default)": fastspec}
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return runs
    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf

    gguf = str(find_embedded_gguf(DEFAULT_MODEL))
    return {"llama.cpp (Q4_1 GGUF)": [sys.executable, "-c", LLAMA_CPP, gguf, PROMPT, str(max_new_tokens)], **runs}


def measure(command: list[str]) -> tuple[float, float]:
    """(peak resident MB, wall seconds) of one run of `command`, which must succeed."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(command[:3])}: failed ({process.stderr.read().decode()[-300:]})")
    return usage.ru_maxrss / 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "footprint.json"))
    args = parser.parse_args()
    runs = commands(args.max_new_tokens)
    for command in runs.values():  # fill the conversion and packing caches
        measure(command)
    samples = {name: [] for name in runs}
    for _ in range(args.trials):
        for name, command in runs.items():
            samples[name].append(measure(command))
    results = [{"run": name, "peak_rss_mb": round(statistics.median(m for m, _ in s)),
                "seconds": round(statistics.median(t for _, t in s), 2)} for name, s in samples.items()]
    for r in results:
        print(f"{r['run']:50s} {r['peak_rss_mb']:6d} MB  {r['seconds']:5.2f} s")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"prompt": PROMPT, "max_new_tokens": args.max_new_tokens,
                                          "trials": args.trials, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
