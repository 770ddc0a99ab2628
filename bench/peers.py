"""Peer comparison: fastspec configurations against what a user would pick instead, in one process, on the same
model (the embedded SmolLM2-135M-Instruct), the same chat-templated prompts and output length, greedy, batch 1.

    .venv/bin/python bench/peers.py [--fastspec NONE --fastspec NGRAM --fastspec "EAGLE3:/path/to/head,topk=4"]
        [--max-new-tokens 128] [--trials 2] [--num-prompts 4 | --prompts FILE.jsonl] [--output PATH]

Peers: transformers greedy `generate` (the baseline), transformers prompt-lookup decoding, transformers assisted
generation (needs a smaller assistant; none exists offline below 135M, so it is reported as skipped), llama.cpp
via llama-cpp-python on the original Q4_1 GGUF (other weights: its text is shown, its tokens are not compared).
tok/s = generated tokens / wall time incl. prefill, after one full-length warm-up per engine; trials alternate
between engines; the median over trials x prompts is reported. Prints a markdown table, writes JSON.
Owns benchmarking only: it drives fastspec through `fastspec.LLM` and knows nothing of its internals.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import fastspec
from fastspec.config import EngineConfig
from fastspec.errors import FastspecError
from fastspec.models.embedded import find_embedded_gguf
from fastspec.models.sources import resolve_model_dir
from fastspec.sampling import SamplingParams
from fastspec.spec_config import NgramParams
from fastspec.text.tokenizer import Tokenizer

MODEL = "smollm2-135m-instruct"
NGRAM_FIELDS = [f.name for f in dataclasses.fields(NgramParams)]
BASELINE = "transformers greedy"
DEFAULT_PROMPTS = [
    "Explain how a bicycle stays upright while it is moving.",
    "Write a Python function that returns the n-th Fibonacci number, then explain it line by line.",
    "Summarise the water cycle in five short bullet points.",
    "List the eight planets of the solar system with one fact about each.",
]
PROBE_TEXT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"  # a batched prefill
NO_ASSISTANT = ("transformers assisted generation: skipped - SmolLM2-135M is the smallest model available "
                "offline here, so no smaller assistant fits (nothing is downloaded)")


@dataclass(frozen=True)
class Prompt:
    text: str  # the user message
    chat_text: str  # chat-templated text (llama.cpp tokenizes this itself)
    ids: tuple[int, ...]  # chat-templated token ids (fed to every other engine)


@dataclass(frozen=True)
class Output:
    ids: tuple[int, ...]  # generated tokens only
    text: str
    tau: float | None = None  # tokens per verify round (fastspec speculative configurations only)
    prompt_ids: tuple[int, ...] | None = None  # the prompt as tokenized by an engine that tokenizes itself


@dataclass(frozen=True)
class Peer:
    name: str
    weights: str  # what actually runs, e.g. "float32" or "Q4_1 GGUF"
    comparable: bool  # same weights as transformers greedy: its tokens must equal the baseline's
    run: Callable[[Prompt, int], Output]  # (prompt, new tokens) -> exactly that many greedy tokens


@dataclass(frozen=True)
class Run:
    prompt: int  # index into the prompt list
    seconds: float
    output: Output


# ---- prompts -------------------------------------------------------------------------------------------------

def load_prompts(path: str | None, count: int | None, tokenizer: Tokenizer) -> list[Prompt]:
    texts = DEFAULT_PROMPTS if path is None else _read_jsonl(Path(path))
    texts = texts[:count] if count else texts
    if not texts:
        raise FastspecError("no prompts to run")
    prompts = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        prompts.append(Prompt(text, tokenizer.apply_chat_template(messages),
                              tuple(tokenizer.encode_chat(messages))))  # = fastspec.LLM.encode(text, chat=True)
    return prompts


def _read_jsonl(path: Path) -> list[str]:
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [json.loads(line)["prompt"] for line in lines]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FastspecError(f"{path}: expected one JSON object with a \"prompt\" per line ({e!r})") from None


# ---- peers ---------------------------------------------------------------------------------------------------

def parse_fastspec(spec: str) -> dict:
    """"ALGO[:DRAFT_PATH][,key=value...]" -> fastspec.LLM kwargs; e.g. "EAGLE3:/heads/h,num_steps=5,topk=4"
    -> {"speculative_algorithm": "EAGLE3", "draft_model": "/heads/h", "num_steps": 5, "topk": 4};
    NGRAM takes NgramParams fields prefixed "ngram_", e.g. "NGRAM,ngram_max_bfs_breadth=4"."""
    head, *options = spec.split(",")
    algorithm, _, draft = head.partition(":")
    kwargs: dict = {"speculative_algorithm": algorithm.strip().upper() or "NONE"}
    if draft:
        kwargs["draft_model"] = draft
    known = set(inspect.signature(fastspec.LLM).parameters) | {f.name for f in dataclasses.fields(EngineConfig)}
    known = known - {"engine_options", "on_prepare", "model", "ngram"} | {f"ngram_{f}" for f in NGRAM_FIELDS}
    ngram = {}
    for option in options:
        key, sep, value = (s.strip() for s in option.partition("="))
        if not sep or key not in known:
            raise FastspecError(f"--fastspec {spec!r}: {option!r} is not key=value with a fastspec.LLM option")
        if key.startswith("ngram_"):
            ngram[key.removeprefix("ngram_")] = _literal(value)
        else:
            kwargs[key] = _literal(value)
    if ngram:
        kwargs["ngram"] = NgramParams(**ngram)
    return kwargs


def _literal(value: str):
    if value in ("True", "False"):
        return value == "True"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def fastspec_peer(spec: str, kwargs: dict) -> Peer:
    """`kwargs`: fastspec.LLM options, from parse_fastspec (parsed early, so a typo fails before any loading). The
    prefix cache is off unless asked for: every engine pays every prefill (llama.cpp is reset before each run)."""
    llm = fastspec.LLM(model=MODEL, **{"radix_cache": False, **kwargs})

    def run(prompt: Prompt, new_tokens: int) -> Output:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        c = llm.generate([list(prompt.ids)], params)[0]
        return Output(tuple(c.output_ids), c.text, c.metrics.tau if c.metrics.verify_rounds else None)

    if llm.engine.config.quantization == "gguf":  # the file's Q4_1 projections (the default): other weights
        return Peer(f"fastspec {spec}", f"Q4_1 GGUF projections packed, {kwargs['dtype']} rest", False, run)
    return Peer(f"fastspec {spec}", kwargs["dtype"], kwargs["dtype"] == "float32", run)


def transformers_peers(model_dir: Path, tokenizer: Tokenizer) -> list[Peer]:
    from fastspec.models.reference import transformers_model

    hf = transformers_model(model_dir)

    def runner(**extra) -> Callable[[Prompt, int], Output]:
        def run(prompt: Prompt, new_tokens: int) -> Output:
            ids = torch.tensor([prompt.ids])  # [1, prompt_len]
            with torch.inference_mode():  # min_new_tokens masks EOS: exactly new_tokens, like ignore_eos
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=hf.config.eos_token_id, **extra)
            new = tuple(out[0, ids.shape[1]:].tolist())
            return Output(new, tokenizer.decode(list(new)))
        return run

    return [Peer(BASELINE, "float32", True, runner()),
            Peer("transformers prompt lookup (10)", "float32", True, runner(prompt_lookup_num_tokens=10))]


def llama_cpp_peer(gguf: Path) -> tuple[Peer | None, list[str]]:
    """A llama.cpp peer (or None) and notes on how it runs or why it cannot. Each configuration is first tried in
    a child process, since a crash in llama.cpp (e.g. its AMX matmul on a VM) must not end the benchmark."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or a built library that fails to load
        return None, [f"llama-cpp-python unavailable: {type(e).__name__}: {e}"]
    notes = [f"llama.cpp {llama_cpp.__version__} runs the Q4_1 GGUF weights (not float32), n_threads=2, "
             "n_ctx=4096, greedy; its tokens are not compared with transformers greedy, its text is shown"]
    extra_bufts = True
    failure = probe_llama_cpp(gguf, extra_bufts)
    if failure:
        extra_bufts = False
        retry = probe_llama_cpp(gguf, extra_bufts)
        if retry:
            return None, [f"llama-cpp-python unavailable: it crashes ({failure}; without extra buffers: {retry})"]
        notes.append(f"llama.cpp crashes with its default extra (repacked / AMX) weight buffers ({failure}): "
                     "run with use_extra_bufts=False")
    model = load_llama_cpp(gguf, extra_bufts)

    def run(prompt: Prompt, new_tokens: int) -> Output:
        tokens, out = generate_llama_cpp(model, prompt.chat_text, new_tokens)
        text = model.detokenize(list(out)).decode("utf-8", errors="replace")
        return Output(out, text, prompt_ids=tokens)

    return Peer("llama.cpp (llama-cpp-python)", f"Q4_1 GGUF ({gguf.name})", False, run), notes


def load_llama_cpp(gguf: Path, extra_bufts: bool, n_ctx: int = 4096):
    """`extra_bufts=False` keeps weights in plain buffers (no repacking; here: no AMX), through the model
    parameters `Llama` reads from `llama_model_default_params` (its constructor has no such option). `n_ctx`: the
    tokens its KV cache holds."""
    import llama_cpp.llama_cpp as api
    from llama_cpp import Llama

    defaults = api.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = extra_bufts
        return p

    api.llama_model_default_params = params
    try:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, verbose=False)
    finally:
        api.llama_model_default_params = defaults


def generate_llama_cpp(model, chat_text: str, new_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt tokens as llama.cpp tokenizes `chat_text`, exactly `new_tokens` greedy tokens)."""
    bos = model.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    tokens = model.tokenize(chat_text.encode("utf-8"), add_bos=bos, special=True)
    model.reset()  # no prompt-prefix reuse from the previous call: every engine pays its prefill
    out = []
    for token in model.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(token)  # generate() never stops by itself: EOS is ignored like everywhere else
        if len(out) == new_tokens:
            break
    return tuple(tokens), tuple(out)


def probe_llama_cpp(gguf: Path, extra_bufts: bool) -> str | None:
    """Load and generate in a child process: None if it works, else what went wrong."""
    command = [sys.executable, __file__, "--llama-cpp-probe", str(gguf), "--llama-cpp-extra-bufts", str(extra_bufts)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "the probe run timed out"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]


# ---- measuring -----------------------------------------------------------------------------------------------

def measure(peers: list[Peer], prompts: list[Prompt], new_tokens: int, trials: int) -> dict[str, list[Run]]:
    """Warm up each engine once, then trials x prompts runs, alternating engines so noise hits all alike."""
    for peer in peers:
        peer.run(prompts[0], new_tokens)
    runs: dict[str, list[Run]] = {peer.name: [] for peer in peers}
    for _ in range(trials):
        for i, prompt in enumerate(prompts):
            for peer in peers:
                start = time.perf_counter()
                output = peer.run(prompt, new_tokens)
                runs[peer.name].append(Run(i, time.perf_counter() - start, output))
    return runs


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (None: equal)."""
    tail = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), tail)


def summarise(peer: Peer, runs: list[Run], prompts: list[Prompt], reference: dict[int, tuple[int, ...]],
              baseline_tok_s: float) -> dict:
    tok_s = statistics.median(len(r.output.ids) / r.seconds for r in runs)
    taus = [r.output.tau for r in runs if r.output.tau is not None]
    row = {"engine": peer.name, "weights": peer.weights, "tok_s": round(tok_s, 2),
           "speedup": round(tok_s / baseline_tok_s, 3), "tau": round(statistics.median(taus), 3) if taus else None,
           "generated_tokens": sorted({len(r.output.ids) for r in runs}), "runs": len(runs)}
    if peer.comparable:
        diverge = [first_divergence(r.output.ids, reference[r.prompt]) for r in runs]
        row["equal_to_greedy"] = f"{diverge.count(None)}/{len(runs)}"
        row["first_divergence"] = diverge
    else:
        row["equal_to_greedy"] = "n/a (other weights)"
    if runs[0].output.prompt_ids is not None:
        same = sum(r.output.prompt_ids == prompts[r.prompt].ids for r in runs)
        row["prompt_tokens_equal_to_fastspec"] = f"{same}/{len(runs)}"
    row["texts"] = [r.output.text for r in runs[:len(prompts)]]  # the first trial, in prompt order
    return row


# ---- reporting -----------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Model {MODEL}, {report['max_new_tokens']} new tokens, greedy, batch 1, {report['runs_per_engine']} "
             f"runs per engine (trials x prompts), median tok/s incl. prefill; "
             f"torch threads {report['torch_threads']}.",
             "", "| engine | weights | tok/s | speedup vs transformers greedy | tau | tokens = transformers greedy |",
             "|---|---|---:|---:|---:|---|"]
    for r in report["results"]:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        lines.append(f"| {r['engine']} | {r['weights']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {tau} "
                     f"| {r['equal_to_greedy']} |")
    lines += [""] + [f"- {note}" for note in report["notes"]]
    for r in report["results"]:
        if "prompt_tokens_equal_to_fastspec" in r:
            lines.append(f"- {r['engine']}: its prompt tokens = fastspec's in {r['prompt_tokens_equal_to_fastspec']}")
        if not r["equal_to_greedy"][0].isdigit():
            lines += [f"- {r['engine']} text, prompt {i}: {text[:160]!r}" for i, text in enumerate(r["texts"], 1)]
    return "\n".join(lines)


def build_peers(args, model_dir: Path, tokenizer: Tokenizer) -> tuple[list[Peer], list[str]]:
    notes = [NO_ASSISTANT]
    configs = {spec: {"dtype": "float32", "max_total_tokens": args.max_total_tokens, **parse_fastspec(spec)}
               for spec in args.fastspec or ["NONE", "NGRAM"]}
    peers = transformers_peers(model_dir, tokenizer)
    llama, llama_notes = llama_cpp_peer(find_embedded_gguf(MODEL))
    peers += [llama] if llama else []
    notes += llama_notes
    peers += [fastspec_peer(spec, kwargs) for spec, kwargs in configs.items()]
    return peers, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fastspec", action="append", help='"ALGO[:DRAFT_PATH][,key=value...]"; repeatable '
                        "(default: NONE and NGRAM); keys are fastspec.LLM options, e.g. num_steps, topk, graphs")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": ...} per line')
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="fastspec KV pool size")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "peers.json"))
    parser.add_argument("--llama-cpp-probe", help=argparse.SUPPRESS)  # GGUF path: the child of probe_llama_cpp
    parser.add_argument("--llama-cpp-extra-bufts", default="True", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_cpp_probe:
        model = load_llama_cpp(Path(args.llama_cpp_probe), args.llama_cpp_extra_bufts == "True")
        return print(generate_llama_cpp(model, PROBE_TEXT, 4))
    command = shlex.join([sys.executable, *sys.argv])
    try:
        report = run_benchmark(args, command)
    except FastspecError as e:
        sys.exit(f"error: {e}")
    print(markdown(report))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def run_benchmark(args, command: str) -> dict:
    if args.max_new_tokens < 1 or args.trials < 1:
        raise FastspecError("--max-new-tokens and --trials must be >= 1")
    model_dir = resolve_model_dir(MODEL)
    tokenizer = Tokenizer(model_dir)
    prompts = load_prompts(args.prompts, args.num_prompts, tokenizer)
    peers, notes = build_peers(args, model_dir, tokenizer)
    runs = measure(peers, prompts, args.max_new_tokens, args.trials)
    reference = {r.prompt: r.output.ids for r in runs[BASELINE][:len(prompts)]}
    baseline = statistics.median(len(r.output.ids) / r.seconds for r in runs[BASELINE])
    return {"command": command, "model": MODEL, "max_new_tokens": args.max_new_tokens, "trials": args.trials,
            "prompts": [p.text for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts],
            "runs_per_engine": args.trials * len(prompts), "torch_threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {platform.processor()}".strip(),
            "versions": versions(), "notes": notes,
            "results": [summarise(p, runs[p.name], prompts, reference, baseline) for p in peers]}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def get(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {package: get(package) for package in ("torch", "transformers", "llama-cpp-python")}


if __name__ == "__main__":
    main()
