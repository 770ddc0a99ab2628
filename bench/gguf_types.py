"""GGUF types on CPU: the embedded SmolLM2-135M-Instruct requantised by llama.cpp into its common mixes, each run by
fastspec on its own blocks (`--quantization gguf`, this machine's fastest kernels) and by llama.cpp on the same file,
plain greedy decoding at batch 1, alternating in one process; and fastspec's teacher-forced top-1 agreement with the
same file dequantised exactly (`--quantization none`).

    .venv/bin/python bench/gguf_types.py [--types Q4_1,Q4_K_M,Q5_K_M,Q3_K_M,Q6_K,IQ4_XS] [--max-new-tokens 64]
        [--trials 2] [--out PATH]

Needs llama-cpp-python: its quantiser makes each file from the Q4_1 original (requantised, so the mixes' layouts and
speed, not their quality; `Q4_1` is the original itself); llama.cpp runs without its extra (AMX) weight buffers where
they crash, as in peers.py. Both engines decode from the same prompt ids (fastspec's
chat template), exactly --max-new-tokens each; tok/s is generated tokens over wall time with prefill, the median over
trials x prompts. Writes bench/results/gguf_types.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from peers import load_llama_cpp, probe_llama_cpp
from quantised_formats import DECODE, agreement

def requantise(source: Path, out: Path, kind: str) -> Path:
    """`source` requantised by llama.cpp to the mix `kind` (a LLAMA_FTYPE_MOSTLY_* name: Q4_K_M, IQ4_XS, ...)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize, params.nthread = True, 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params):
        raise RuntimeError(f"llama.cpp could not quantise to {kind}")
    return out


def matrix_types(path: Path) -> dict[str, int]:
    """{GGML type: how many matrices} of a GGUF file."""
    import gguf

    return dict(collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2))


def rates(path: Path, new: int, trials: int) -> tuple[float, float]:
    """(fastspec tok/s, llama.cpp tok/s) on the GGUF at `path`, alternating prompt by prompt."""
    import fastspec
    from fastspec.sampling import SamplingParams

    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="gguf")
    llama = load_llama_cpp(path, extra_bufts=probe_llama_cpp(path, True) is None)  # its AMX buffers may crash
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def fast(prompt: str) -> tuple[list[int], int]:
        out = llm.generate([prompt], params, chat=True)[0]
        return out.prompt_ids, len(out.output_ids)

    def peer(ids: list[int]) -> int:
        llama.reset()  # no prompt-prefix reuse: every engine pays its prefill
        for count, _ in enumerate(llama.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0), 1):
            if count == new:
                return count

    prompts = {p: fast(p)[0] for p in DECODE}  # warm-up, and the prompt ids both engines decode from
    peer(prompts[DECODE[0]])
    ours, theirs = [], []
    for _ in range(trials):
        for prompt, ids in prompts.items():
            start = time.perf_counter()
            ours.append(fast(prompt)[1] / (time.perf_counter() - start))
            start = time.perf_counter()
            theirs.append(peer(ids) / (time.perf_counter() - start))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    import llama_cpp

    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf
    from fastspec.models.packed_layers import fast_activation

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_1,Q4_K_M,Q5_K_M,Q3_K_M,Q6_K,IQ4_XS")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_types.json"))
    args = parser.parse_args()
    original = find_embedded_gguf(DEFAULT_MODEL)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastspec-gguf-types-") as tmp:
        for kind in args.types.split(","):
            path = original if kind == "Q4_1" else requantise(original, Path(tmp) / f"{kind}.gguf", kind)
            ours, theirs = rates(path, args.max_new_tokens, args.trials)
            same, total = agreement(path, "gguf", args.max_new_tokens)
            row = {"file": kind, "matrices": matrix_types(path), "MB": round(path.stat().st_size / 1e6, 1),
                   "fastspec_tok_s": round(ours, 1), "llama_cpp_tok_s": round(theirs, 1),
                   "vs_llama_cpp": round(ours / theirs, 2), "agree": same, "positions": total,
                   "agreement": round(same / total, 4)}
            rows.append(row)
    for row in rows:  # after llama.cpp's own logging
        print(f"{row['file']:8s} {row['MB']:6.1f} MB  fastspec {row['fastspec_tok_s']:6.1f}  llama.cpp "
              f"{row['llama_cpp_tok_s']:6.1f} tok/s  {row['vs_llama_cpp']:4.2f}x  agreement "
              f"{row['agree']}/{row['positions']}  {row['matrices']}")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"activation": str(fast_activation()), "torch": torch.__version__,
                                          "llama_cpp": llama_cpp.__version__, "command": " ".join(sys.argv),
                                          "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
