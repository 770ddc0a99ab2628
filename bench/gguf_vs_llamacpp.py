"""fastspec's GGUF path against llama.cpp itself, on the same files and the same token ids: tiny random models of
each architecture (llama, qwen2, qwen3, phi3) written as F32 GGUF, quantised by llama.cpp's own quantiser into each
type (its per-tensor mixes included), and the embedded SmolLM2-135M-Instruct Q4_1 over a few chat prompts.

    .venv/bin/python bench/gguf_vs_llamacpp.py [--archs llama,qwen2,qwen3,phi3] [--types F32,Q4_0,...]
        [--positions 48] [--new-tokens 32] [--out PATH]

For every file both engines score the same ids teacher-forced (llama.cpp: `eval` with all logits; fastspec: one
causal forward through a float32 KV pool, the engine's kernels) and decode greedily from the same prompt:
- `exact`: fastspec with the file dequantised (`--quantization none`, float32), the reference twin;
- `gguf`: fastspec on its own blocks (`--quantization gguf`, this machine's fast kernels).
Reported per engine pair: the largest |logit difference| over all positions and tokens, as a fraction of the
llama.cpp logits' standard deviation, the teacher-forced top-1 agreement, and the first greedy token that differs
('=' none). llama.cpp rounds activations to 8 bits (Q8_0 / Q8_1 / Q8_K) for its quantised dot products and keeps an
F16 KV cache, so only the F32 file can agree to float32 rounding; a quantised one differs by that rounding (~1 % of
the logit scale), and a model mistake (rope mode, norm eps, a tensor's type or rows mishandled) by far more.
Every file llama.cpp writes must load in fastspec, or be refused in one line naming what it cannot read.
Needs llama-cpp-python (else says so and exits). Writes bench/results/gguf_vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from peers import first_divergence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 64}, "phi3": {}}  # tiny_model's, 256 wide (K-quant rows)
TYPES = ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
         "IQ4_NL", "IQ4_XS"]
SMOLLM_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
                  "Explain recursion to a ten-year-old.", "Why do cats purr?"]


def quantise(source: Path, out: Path, kind: str) -> Path:
    """`source` quantised by llama.cpp to `kind` (a LLAMA_FTYPE_MOSTLY_* name, or F32 / F16)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if kind == "F32" else getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize, params.nthread = True, 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params):
        raise RuntimeError(f"llama.cpp could not quantise to {kind}")
    return out


def llama_cpp_run(path: Path, ids: list[int], prompt: list[int], new: int) -> tuple[torch.Tensor, list[int]]:
    """llama.cpp's logits [len(ids), V] over `ids` and its `new` greedy tokens after `prompt`."""
    from llama_cpp import Llama

    model = Llama(model_path=str(path), logits_all=True, n_ctx=max(len(ids), len(prompt) + new) + 8, n_threads=2,
                  n_threads_batch=2, n_batch=512, verbose=False)
    model.eval(ids)
    logits = torch.from_numpy(np.array(model.scores[:len(ids)], dtype=np.float32))
    model.reset()
    greedy = []
    for token in model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        greedy.append(token)
        if len(greedy) == new:
            break
    model.close()
    return logits, greedy


def fastspec_run(path: Path, quantization: str, ids: list[int], prompt: list[int],
                 new: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """fastspec's logits [len(ids), V] over `ids` (one causal forward through a float32 KV pool, as a prefill runs),
    its `new` greedy tokens after `prompt`, and the logits again with each linear's input rounded as llama.cpp's
    dot products round it (llama_cpp_rounding)."""
    import fastspec
    from fastspec.sampling import SamplingParams
    from packed_agreement import teacher_forced_logits

    llm = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization=quantization, max_total_tokens=1024)
    model = llm.engine.worker.model
    logits = teacher_forced_logits(model, ids[:1], ids[1:] + [0], torch.float32).float()
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))[0].output_ids
    hooks = [model.get_submodule(name).register_forward_pre_hook(lambda m, x, k=kind: (llama_cpp_rounding(*x, k),))
             for name, kind in linear_types(path).items()]
    rounded = teacher_forced_logits(model, ids[:1], ids[1:] + [0], torch.float32).float()
    for hook in hooks:
        hook.remove()
    return logits, list(greedy), rounded


K_BLOCKS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # dot products with Q8_K activations: 256 a scale


def llama_cpp_rounding(x: torch.Tensor, kind: str) -> torch.Tensor:
    """`x` [..., K] as llama.cpp's CPU dot products against a `kind` weight see it: F32 as it is, F16 / BF16 rounded
    to that type, every block type's to int8 with a scale per 32 (Q8_0 / Q8_1) or per 256 (Q8_K): d = max |x| / 127."""
    if kind in ("F32", "F16", "BF16"):
        return x if kind == "F32" else x.to(getattr(torch, kind.lower().replace("f", "float", 1))).to(x.dtype)
    block = x.unflatten(-1, (-1, 256 if kind in K_BLOCKS else 32))
    d = block.abs().amax(-1, keepdim=True) / 127
    return (torch.round(block / d.clamp_min(1e-30)) * d).flatten(-2)


def linear_types(path: Path) -> dict[str, str]:
    """fastspec's linear module -> the GGML type of the (first) GGUF tensor it multiplies by."""
    import gguf

    kinds = {t.name.removesuffix(".weight"): t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    layers = {"self_attn.qkv_proj": ("attn_qkv", "attn_q"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
    out = {"lm_head": kinds.get("output", kinds["token_embd"])}
    for i in range(1 + max(int(n.split(".")[1]) for n in kinds if n.startswith("blk."))):
        for module, names in layers.items():
            out[f"model.layers.{i}.{module}"] = next(kinds[f"blk.{i}.{n}"] for n in names if f"blk.{i}.{n}" in kinds)
    return out


def distance(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The largest |a - b| [positions, V] over all tokens and over a's 4 best per position (those a decode picks
    from; fastspec's packed head rescores only its best exactly), each over a's standard deviation; and where their
    best tokens differ, the largest gap in a between a's best and b's best (a near tie: well under the distance)."""
    diff, scale, best_a, best_b = (a - b).abs(), float(a.std()), a.argmax(-1), b.argmax(-1)
    gap = a.gather(-1, best_a[:, None]) - a.gather(-1, best_b[:, None])  # [positions, 1]
    return {"all": round(float(diff.max()) / scale, 4),
            "top4": round(float(diff.gather(-1, a.topk(4, -1).indices).max()) / scale, 4),
            "top1": f"{int((best_a == best_b).sum())}/{len(a)}", "gap": round(float(gap.max()) / scale, 4)}


def run_file(path: Path, ids: list[int], prompt: list[int], new: int) -> dict:
    """llama.cpp against fastspec exact and packed on `path`, and the size of llama.cpp's activation rounding (fastspec
    exact with and without it); a file fastspec refuses gives its one-line reason."""
    from fastspec.errors import FastspecError

    theirs, their_greedy = llama_cpp_run(path, ids, prompt, new)
    row = {}
    for mode in ("none", "gguf"):
        try:
            ours, greedy, rounded = fastspec_run(path, mode, ids, prompt, new)
        except FastspecError as e:
            row[mode] = {"refused": str(e).splitlines()[0]}
            continue
        row[mode] = {**distance(theirs, ours), "diverge": first_divergence(tuple(their_greedy), tuple(greedy))}
        if mode == "none":
            row["rounding"] = distance(ours, rounded)
    return row


def tiny_rows(archs: list[str], types: list[str], positions: int, new: int, tmp: Path) -> list[dict]:
    """One row per (architecture, type): a tiny random model (tests' writer, 256 wide, untied, a BPE vocabulary)."""
    from gguf_writers import TOKENS, tiny_model, write_gguf

    rng = np.random.default_rng(0)
    ids = rng.integers(3, len(TOKENS), positions).tolist()  # no specials: every token an ordinary one
    prompt = ids[:8]
    rows = []
    for arch in archs:
        model = tame(tiny_model(arch, tied=False, hidden_size=256, intermediate_size=512, **ARCHS[arch]))
        source = write_gguf(tmp / f"{arch}.gguf", model)
        for kind in types:
            path = quantise(source, tmp / f"{arch}-{kind}.gguf", kind)
            rows.append({"model": arch, "type": kind, "matrices": matrices(path), **run_file(path, ids, prompt, new)})
            print_row(rows[-1])
            path.unlink()
    return rows


def tame(model):
    """`model` with a trained model's scales instead of tiny_model's large test weights: each matrix drawn with
    std 1 / sqrt(its inputs), so activations neither grow layer by layer nor saturate attention (where one rounding
    would flip which key wins), the embedding with std 1; norms and biases as they are."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    return model


def matrices(path: Path) -> str:
    """'7 Q4_K, 2 Q6_K': the types of a file's matrices, most common first."""
    import collections

    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def smollm_row(positions: int, new: int) -> list[dict]:
    """The embedded SmolLM2 Q4_1 file on a few chat prompts: fastspec's chat template, the same ids to both."""
    import fastspec
    from fastspec.models.embedded import DEFAULT_MODEL, find_embedded_gguf

    path = find_embedded_gguf(DEFAULT_MODEL)
    tokenizer = fastspec.LLM(str(path), speculative_algorithm="NONE", quantization="none")
    rows = []
    for text in SMOLLM_PROMPTS:
        prompt = tokenizer.encode(text, chat=True)
        ids = (prompt + tokenizer.generate([prompt], fastspec.SamplingParams(max_new_tokens=positions))[0]
               .output_ids)[:len(prompt) + positions]
        rows.append({"model": "smollm2-135m", "type": "Q4_1", "prompt": text, "matrices": matrices(path),
                     **run_file(path, ids, prompt, new)})
        print_row(rows[-1])
    return rows


def print_row(row: dict) -> None:
    cells = [f"rounding {row['rounding']['top4']:.4f}"] if "rounding" in row else []
    for mode in ("none", "gguf"):
        r = row[mode]
        cells.append(f"{mode}: refused ({r['refused']})" if "refused" in r else
                     f"{mode} {r['top4']:.4f} ({r['all']:.4f}) {r['top1']} gap {r['gap']:.4f} "
                     f"{'=' if r['diverge'] is None else r['diverge']}")
    print(f"{row['model']:13s} {row['type']:7s} " + "   ".join(cells) + f"   [{row['matrices']}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--positions", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-smollm", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_vs_llamacpp.json"))
    args = parser.parse_args()
    try:
        import llama_cpp
        import llama_cpp._logger
    except Exception as e:  # ImportError, or a built library that fails to load
        return print(f"skipped: llama-cpp-python is unavailable ({type(e).__name__}: {e})")
    llama_cpp._logger.set_verbose(False)
    import json

    with tempfile.TemporaryDirectory(prefix="fastspec-gguf-vs-llamacpp-") as tmp:
        os.environ["FASTSPEC_MODEL_CACHE"] = tmp  # the conversions of these random files go with them
        rows = tiny_rows(args.archs.split(","), args.types.split(","), args.positions, args.new_tokens, Path(tmp))
    if not args.no_smollm:
        rows += smollm_row(args.positions, args.new_tokens)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"llama_cpp": llama_cpp.__version__, "torch": torch.__version__,
                                          "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
