"""GGUF types on CPU: the embedded SmolLM2-135M-Instruct requantised by llama.cpp into its common mixes, each run by
fastspec on its own blocks (`--quantization gguf`, this machine's fastest kernels) and by llama.cpp on the same file,
plain greedy decoding at batch 1, alternating in one process; and fastspec's teacher-forced top-1 agreement with the
same file dequantised exactly (`--quantization none`).

    .venv/bin/python bench/gguf_types.py [--types Q4_1,Q4_K_M,Q5_K_M,Q3_K_M,Q6_K,Q8_0,IQ4_XS] [--max-new-tokens 64]
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


def rates(path: Path, new: int, trials: int, prompts: list[list[int]] | None = None) -> dict:
    """fastspec's first load (its conversion included) and both engines' median tok/s on the GGUF at `path`,
    alternating prompt by prompt, from the same prompt ids: `prompts`, else DECODE in fastspec's chat template."""
    import fastspec
    from fastspec.sampling import SamplingParams

    start = time.perf_counter()
    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="gguf")
    load_s = time.perf_counter() - start
    llama = load_llama_cpp(path, extra_bufts=probe_llama_cpp(path, True) is None)  # its AMX buffers may crash
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    prompts = prompts or [llm.encode(p, chat=True) for p in DECODE]

    def ours(ids: list[int]) -> int:
        return len(llm.generate([ids], params)[0].output_ids)

    def theirs(ids: list[int]) -> int:
        llama.reset()  # no prompt-prefix reuse: every engine pays its prefill
        for count, _ in enumerate(llama.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0), 1):
            if count == new:
                return count

    ours(prompts[0]), theirs(prompts[0])  # warm-up
    runs = {"fastspec": [], "llama_cpp": []}
    for _ in range(trials):
        for ids in prompts:
            for name, run in (("fastspec", ours), ("llama_cpp", theirs)):
                start = time.perf_counter()
                runs[name].append(run(ids) / (time.perf_counter() - start))
    return {"load_s": round(load_s, 1), **{f"{k}_tok_s": round(statistics.median(v), 1) for k, v in runs.items()}}


def write_results(out: str, rows: list[dict]) -> None:
    """The rows, with the kernels' activation and the versions, as JSON at `out`."""
    import llama_cpp

    from fastspec.models.activation_choice import fast_activation

    Path(out).parent.mkdir(exist_ok=True)
    Path(out).write_text(json.dumps({"activation": str(fast_activation()), "torch": torch.__version__,
                                     "llama_cpp": llama_cpp.__version__, "command": " ".join(sys.argv),
                                     "rows": rows}, indent=1) + "\n")


def main() -> None:

    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_1,Q4_K_M,Q5_K_M,Q3_K_M,Q6_K,Q8_0,IQ4_XS")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_types.json"))
    args = parser.parse_args()
    original = find_embedded_gguf(DEFAULT_MODEL)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastspec-gguf-types-") as tmp:
        for kind in args.types.split(","):
            path = original if kind == "Q4_1" else requantise(original, Path(tmp) / f"{kind}.gguf", kind)
            row = {"file": kind, "matrices": matrix_types(path), "MB": round(path.stat().st_size / 1e6, 1),
                   **rates(path, args.max_new_tokens, args.trials)}
            same, total = agreement(path, "gguf", args.max_new_tokens)
            row |= {"vs_llama_cpp": round(row["fastspec_tok_s"] / row["llama_cpp_tok_s"], 2), "agree": same,
                    "positions": total, "agreement": round(same / total, 4)}
            rows.append(row)
    for row in rows:  # after llama.cpp's own logging
        print(f"{row['file']:8s} {row['MB']:6.1f} MB  fastspec {row['fastspec_tok_s']:6.1f}  llama.cpp "
              f"{row['llama_cpp_tok_s']:6.1f} tok/s  {row['vs_llama_cpp']:4.2f}x  agreement "
              f"{row['agree']}/{row['positions']}  {row['matrices']}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
