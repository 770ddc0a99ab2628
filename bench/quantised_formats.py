"""Quantised checkpoints on CPU: the embedded SmolLM2-135M written as each method's checkpoint (AWQ, GPTQ int4 with
desc_act, GPTQ int8, compressed-tensors int4 / fp8, block fp8, fbgemm fp8; the writers of tests/quant_writers.py)
and rounded at load (--quantization int4 / int8 / fp8), each run as fastspec runs it by default on this machine:
plain decoding tok/s beside the float32 model in the same run, and teacher-forced top-1 agreement with the same
checkpoint dequantised exactly (`--quantization none`, the reference) over twelve chat answers.

    .venv/bin/python bench/quantised_formats.py [--max-new-tokens 64] [--trials 2] [--out PATH]

Writes bench/results/quantised_formats.json. CPU only (the GPU figures: bench/gpu_decode.py's 8b_fp8 / 8b_int4).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from packed_agreement import PROMPTS, teacher_forced_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CHECKPOINTS = ["awq", "gptq", "gptq8", "ct_int4", "fp8_block", "ct_fp8", "fbgemm_fp8"]
ONLINE = ["int4", "int8", "fp8"]
DECODE = ["Explain recursion to a ten-year-old.", "Write a haiku about autumn leaves.",
          "Give me three tips for learning a new language.", "Why do cats purr?"]


def tok_s(llm, new: int, trials: int) -> float:
    from fastspec.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    llm.generate(DECODE[:1], SamplingParams(max_new_tokens=8), chat=True)  # warm-up
    rates = []
    for _ in range(trials):
        for prompt in DECODE:
            start = time.perf_counter()
            out = llm.generate([prompt], params, chat=True)[0]
            rates.append(len(out.output_ids) / (time.perf_counter() - start))
    return statistics.median(rates)


def agreement(model_dir: Path, quantization: str, new: int) -> tuple[int, int]:
    """Positions where the default-run model's argmax equals the exact (dequantised) model's, teacher-forced over
    the exact model's own greedy answers."""
    import fastspec
    from fastspec.sampling import SamplingParams

    exact = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", quantization=None, max_total_tokens=4096)
    outs = exact.generate(PROMPTS, SamplingParams(max_new_tokens=new), chat=True)
    sequences = [(o.prompt_ids, o.output_ids) for o in outs]
    reference = exact.engine.worker.model
    expected = [teacher_forced_logits(reference, p, a).argmax(-1) for p, a in sequences]
    del exact
    run = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", quantization=quantization, max_total_tokens=4096)
    model = run.engine.worker.model
    same = sum(int((teacher_forced_logits(model, p, a, True).argmax(-1) == e).sum())
               for (p, a), e in zip(sequences, expected))
    return same, sum(len(a) for _, a in sequences)


def main() -> None:
    from quant_writers import write_quantised

    import fastspec
    from fastspec.models.activation_choice import fast_activation
    from fastspec.models.reference import transformers_model
    from fastspec.models.sources import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quantised_formats.json"))
    args = parser.parse_args()
    source = resolve_model_dir("smollm2-135m-instruct")
    hf = transformers_model(source)
    root = Path(tempfile.mkdtemp(prefix="fastspec-quantised-"))
    rows = []
    float_rate = tok_s(fastspec.LLM(str(source), speculative_algorithm="NONE", quantization=None), args.max_new_tokens,
                       args.trials)
    rows.append({"weights": "float32 (none)", "tok_s": round(float_rate, 1)})
    print(f"{'float32 (none)':24s} {float_rate:7.1f} tok/s", flush=True)
    runs = [(m, m, None) for m in CHECKPOINTS] + [(f"online {m}", None, m) for m in ONLINE]
    for name, method, online in runs:
        model_dir = source if method is None else root / method
        if method is not None:
            write_quantised(hf, model_dir, method)
            for f in source.iterdir():  # the tokenizer and chat template
                if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                    shutil.copy(f, model_dir / f.name)
        quantization = online or "auto"
        llm = fastspec.LLM(str(model_dir), speculative_algorithm="NONE", quantization=quantization)
        rate = tok_s(llm, args.max_new_tokens, args.trials)
        resolved = llm.engine.worker.config.quantization
        del llm
        same, total = agreement(model_dir, quantization, args.max_new_tokens) if method else (None, None)
        row = {"weights": name, "quantization": resolved, "tok_s": round(rate, 1),
               "vs_float32": round(rate / float_rate, 2)}
        if same is not None:
            row |= {"agree": same, "positions": total, "agreement": round(same / total, 4)}
        rows.append(row)
        print(f"{name:24s} {rate:7.1f} tok/s  {rate / float_rate:5.2f}x float32"
              + (f"  agreement {same}/{total}" if same is not None else ""), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"activation": str(fast_activation()), "torch": torch.__version__,
                                          "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
