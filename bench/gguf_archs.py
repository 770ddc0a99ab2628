"""GGUF architectures at real sizes on CPU: random-weight files shaped like Qwen2.5-0.5B (qwen2), Qwen3-0.6B (qwen3)
and Llama-3.2-1B (llama, with its rope_freqs), requantised by llama.cpp into a common mix, each run by fastspec on its
own blocks (`--quantization gguf`) and by llama.cpp on the same file: plain greedy decoding at batch 1 from the same
prompt ids, alternating in one process. Also fastspec's first load of each file (its one-time conversion included)
and what an EAGLE-3 round costs on it against a plain step (a random head of a real head's shape, every round
speculating): the tau from which speculation pays on this CPU.

    .venv/bin/python bench/gguf_archs.py [--models qwen2.5-0.5b,qwen3-0.6b,llama-3.2-1b] [--type Q4_K_M]
        [--max-new-tokens 64] [--trials 2] [--out PATH]

The weights are random (normal, std 0.02, in F16 before requantising; norms 1), so the text is noise: speed only.
Needs llama-cpp-python (its quantiser makes each mix; it runs without its extra (AMX) weight buffers where they
crash, as in peers.py). tok/s is generated tokens over wall time with prefill (a 32-token prompt), the median over
trials x 4 prompts. Writes bench/results/gguf_archs.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf_types import matrix_types, rates, requantise, write_results

SHAPES = {  # the published configs' sizes; vocabularies padded as the published embeddings are
    "qwen2.5-0.5b": dict(arch="qwen2", hidden=896, layers=24, heads=14, kv=2, head_dim=64, ffn=4864, vocab=151936,
                         theta=1e6, pre="qwen2"),
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, layers=28, heads=16, kv=8, head_dim=128, ffn=3072, vocab=151936,
                       theta=1e6, pre="qwen2"),
    "llama-3.2-1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv=8, head_dim=64, ffn=8192, vocab=128256,
                         theta=5e5, pre="llama-bpe", llama3_factor=32.0),
}


def write_random_f16(path: Path, s: dict, seed: int = 0) -> Path:
    """A GGUF of shape `s` with random F16 matrices, F32 norms (1) and biases (qwen2), a byte-level vocabulary of
    the right size (the byte alphabet, then filler tokens) and, for llama, Llama 3's rope factors."""
    import gguf
    from tokenizers import pre_tokenizers

    from fastspec.models.model_config import RopeScaling
    from fastspec.models.rope import rope_inv_freq

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, s["arch"])
    w.add_block_count(s["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(s["theta"])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<|endoftext|>", "to", "tok"] + [f"tok{i}" for i in range(s["vocab"] - len(alphabet) - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(s["pre"])
    w.add_token_list(tokens)
    w.add_token_types([1] * len(alphabet) + [3] + [1] * (len(tokens) - len(alphabet) - 1))
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(len(alphabet))
    w.add_eos_token_id(len(alphabet))
    w.add_add_bos_token(False)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    h, q, kv, ffn = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["ffn"]
    w.add_tensor("token_embd.weight", matrix(s["vocab"], h))
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        for name, shape in (("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, q)),
                            ("ffn_gate", (ffn, h)), ("ffn_up", (ffn, h)), ("ffn_down", (h, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(h, dtype=np.float32))
        if s["arch"] == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"blk.{i}.{name}.bias", (rng.standard_normal(n, dtype=np.float32) * 0.02))
        if s["arch"] == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", np.ones(s["head_dim"], dtype=np.float32))
    if "llama3_factor" in s:
        scaling = RopeScaling("llama3", s["llama3_factor"], 1.0, 4.0, 8192)
        d, theta = s["head_dim"], s["theta"]
        w.add_tensor("rope_freqs.weight", (rope_inv_freq(d, theta, None) / rope_inv_freq(d, theta, scaling)).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def round_cost(path: Path, s: dict, prompts: list[list[int]], new: int, head_dir: Path) -> dict:
    """What an EAGLE-3 round costs against a plain step on this file: a random head shaped like a real one for the
    target (its attention and MLP sizes, a 32000-token draft vocabulary), every round speculating; the ms per round
    over the ms per plain token is the tau from which speculation pays (acceptance itself is noise here)."""
    import fastspec
    from fastspec.models.heads import write_random_head
    from fastspec.sampling import SamplingParams

    head = write_random_head(head_dir, s["hidden"], s["vocab"], "eagle3", draft_vocab=32000, heads=s["heads"],
                             kv_heads=s["kv"], head_dim=s["head_dim"], inter=s["ffn"])
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    times = {}
    for algorithm in ("NONE", "EAGLE3"):
        llm = fastspec.LLM(str(path), speculative_algorithm=algorithm, quantization="gguf", tuned=False,
                           **({"draft_model": str(head)} if algorithm == "EAGLE3" else {}))
        llm.engine.policy = None  # every round speculates
        llm.generate(prompts[:1], params)
        start = time.perf_counter()
        outs = [llm.generate([ids], params)[0] for ids in prompts]
        units = sum(o.metrics.verify_rounds if algorithm == "EAGLE3" else len(o.output_ids) for o in outs)
        times[algorithm] = 1000 * (time.perf_counter() - start) / units
        spec = llm.planned_spec
    return {"tree": f"{spec.num_steps}/{spec.topk}/{spec.num_draft_tokens}", "plain_ms": round(times["NONE"], 2),
            "round_ms": round(times["EAGLE3"], 2), "pays_from_tau": round(times["EAGLE3"] / times["NONE"], 2)}


def main() -> None:


    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gguf_archs.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastspec-gguf-archs-") as tmp:
        os.environ["FASTSPEC_MODEL_CACHE"] = tmp  # the conversions of these random files go with them
        for name in args.models.split(","):
            s = SHAPES[name]
            f16 = write_random_f16(Path(tmp) / f"{name}-F16.gguf", s)
            path = requantise(f16, Path(tmp) / f"{name}-{args.type}.gguf", args.type)
            f16.unlink()
            rng = np.random.default_rng(1)
            prompts = [rng.integers(300, s["vocab"], 32).tolist() for _ in range(4)]
            row = {"model": name, "arch": s["arch"], "type": args.type, "MB": round(path.stat().st_size / 1e6, 1),
                   "matrices": matrix_types(path), **rates(path, args.max_new_tokens, args.trials, prompts)}
            row["vs_llama_cpp"] = round(row["fastspec_tok_s"] / row["llama_cpp_tok_s"], 2)
            row |= round_cost(path, s, prompts, args.max_new_tokens, Path(tmp) / f"{name}-head")
            rows.append(row)
            path.unlink()
    for row in rows:  # after llama.cpp's own logging
        print(f"{row['model']:13s} {row['arch']:6s} {row['type']} {row['MB']:7.1f} MB  fastspec "
              f"{row['fastspec_tok_s']:6.1f}  llama.cpp {row['llama_cpp_tok_s']:6.1f} tok/s  "
              f"{row['vs_llama_cpp']:4.2f}x  (first load, conversion included, {row['load_s']} s)  {row['matrices']}")
        print(f"{'':13s} EAGLE-3 {row['tree']}: a round {row['round_ms']} ms, a plain token {row['plain_ms']} ms: "
              f"speculation pays from tau {row['pays_from_tau']}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
