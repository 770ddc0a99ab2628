"""How close `--quantization gguf` (the embedded model on its own blocks, this machine's fast activation dtype) is to
the exact reference (the same GGUF dequantised to float32): teacher-forced top-1 agreement over held-out chat answers.

    .venv/bin/python bench/packed_agreement.py [--max-new-tokens 64] [--out PATH]

The reference decodes twelve prompts greedily (none of them used by the tests); then both models score every
prefix of prompt + answer in one causal forward, and a position agrees when their argmax is the same token. Also
reported with the lm_head swapped for alternatives, to show where the disagreements come from: the exact float32
head, a bfloat16 head, and the 4-bit head without its exact rescoring; and through a bfloat16 / float16 KV cache
(--kv-cache-dtype), and a float8 e4m3 / e5m2 one; and an e4m3 one with per-layer KV scales (as a checkpoint's
k_scale / v_scale) calibrated here on the first half of the answers: each layer's largest |K| and |V| / 448.
Writes bench/results/packed_agreement.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = [
    "What is the capital of France, and why is it famous?", "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.", "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?", "Describe how a refrigerator works.",
    "Write a short story opening about a lighthouse keeper.", "How do vaccines train the immune system?",
    "Compare Python lists and tuples.", "What is photosynthesis?",
    "Suggest a name for a bakery and explain it.", "Why do cats purr?",
]


def teacher_forced_logits(model, prompt: list[int], answer: list[int], pool: torch.dtype | None = None,
                          scales=None, into: list | None = None) -> torch.Tensor:  # [len(answer), V]
    """One causal forward over prompt + answer; `pool`: through a KV pool of that dtype (with KV `scales`) and the
    torch backend's plan, as the engine runs a prefill (a packed model then runs its fused CPU kernels), else without
    a KV cache. `into`: the pool is appended to it."""
    from fastspec.attention import AttentionContext, TorchAttnBackend, extend_metadata
    from fastspec.memory.kv_pool import KVPool
    from fastspec.train.data import PackedCausalAttention

    x = torch.tensor(prompt + answer)
    attn = PackedCausalAttention(torch.zeros(len(x), dtype=torch.long))
    if pool:
        c = model.config
        kv = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, len(x), dtype=pool, scales=scales)
        if into is not None:
            into.append(kv)
        table = torch.arange(1, len(x) + 1, dtype=torch.int32)[None]
        meta = extend_metadata(table, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                               torch.tensor([len(x)]))
        attn = AttentionContext.build(TorchAttnBackend(), meta, kv)
    with torch.inference_mode():
        hidden = model(x, torch.arange(len(x)), attn).final
        return model.compute_logits(hidden)[len(prompt) - 1:-1]


def calibrated_scales(model, sequences) -> tuple[tuple[float, float], ...]:
    """Per layer (largest |K| / 448, largest |V| / 448) over `sequences` through a float32 cache."""
    pools = []
    for p, a in sequences:
        teacher_forced_logits(model, p, a, torch.float32, into=pools)
    k = torch.stack([kv.k.abs().amax((1, 2, 3)) for kv in pools]).amax(0)  # [L]
    v = torch.stack([kv.v.abs().amax((1, 2, 3)) for kv in pools]).amax(0)
    return tuple(zip((k / 448).tolist(), (v / 448).tolist()))


def main() -> None:
    import fastspec
    from fastspec.models.layers import fuse_projections
    from fastspec.models.loader import load_target
    from fastspec.models.activation_choice import fast_activation
    from fastspec.models.packed_layers import CastLinear, RefinedHead
    from fastspec.models.sources import resolve_model_dir
    from fastspec.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "packed_agreement.json"))
    args = parser.parse_args()
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    llm = fastspec.LLM(speculative_algorithm="NONE", quantization=None, max_total_tokens=4096)  # the reference
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=args.max_new_tokens), chat=True)
    sequences = [(o.prompt_ids, o.output_ids) for o in outs]
    del llm
    reference = fuse_projections(load_target(model_dir, torch.float32))
    expected = [teacher_forced_logits(reference, p, a).argmax(-1) for p, a in sequences]
    packed = load_target(model_dir, torch.float32, quantization="gguf")
    exact_head = reference.lm_head.weight.detach()
    heads = {"as run": packed.lm_head, "float32 lm_head": CastLinear(exact_head),
             "bfloat16 lm_head": CastLinear(exact_head.bfloat16())}
    if isinstance(packed.lm_head, RefinedHead):
        heads["4-bit lm_head, not rescored"] = packed.lm_head.approx
    results = []
    runs = [(name, head, None, None) for name, head in heads.items()]
    runs.append(("as run, fused CPU kernels", heads["as run"], torch.float32, None))  # through a KV pool, as the engine
    runs += [(f"as run, fused, {dtype} KV", heads["as run"], getattr(torch, dtype), None)
             for dtype in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")]
    scales = calibrated_scales(packed, sequences[:len(sequences) // 2])
    runs.append(("as run, fused, float8_e4m3fn KV, scaled", heads["as run"], torch.float8_e4m3fn, scales))
    for name, head, pool, kv_scales in runs:
        packed.lm_head = head
        same = sum(int((teacher_forced_logits(packed, p, a, pool, kv_scales).argmax(-1) == e).sum())
                   for (p, a), e in zip(sequences, expected))
        total = sum(len(a) for _, a in sequences)
        results.append({"lm_head": name, "agree": same, "positions": total, "agreement": round(same / total, 4)})
        print(f"{name:41s} {same:4d} / {total} = {same / total:.2%}", flush=True)
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"activation": str(fast_activation()), "torch": torch.__version__,
                                          "prompts": len(PROMPTS), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
