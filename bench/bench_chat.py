"""Scripted chat: `fastspec chat` driven through a pseudo-terminal as a user drives it (an 80-column terminal,
questions typed at its `you>` prompt), default against `--speculative-algorithm NONE`, and transformers' greedy
`generate` on the same questions.

    .venv/bin/python bench/bench_chat.py [--variant "" --variant "--speculative-algorithm NONE"] [--turns 4]
        [--trials 3] [--max-new-tokens 96] [--tuned-plain-at-1] [--output bench/results/chat.json]

Each variant is a fresh `fastspec chat` (the embedded model, the user's cache and tuned file as `make chat` uses
them; with `--tuned-plain-at-1` a scratch cache whose tuned file for this machine decodes plainly at batch 1 and
speculates from batch 2, as `fastspec tune` chose on an AMD machine). Its tok/s per answer is what the chat
itself reports under the answer (tokens over the answer's wall time, prefill included); its banner line is kept
(what decodes at batch 1). transformers: float32, greedy, the same questions with its own answers as history,
exactly as many new tokens as fastspec's default answer had, timed the same way (prefill included), loaded once
in this process. The variants and transformers run one after another, never at once, alternating over
`--trials`; per answer the median. Prints a markdown table per answer (ratios within the run), writes JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import shlex
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

QUESTIONS = ["Write a short story about a dragon who learns to bake bread.", "Explain how a bicycle works.",
             "Describe the water cycle step by step.", "List five fruits and say one thing about each.",
             "What is the capital of France?", "Give me three tips for learning a new language."]
STATUS = re.compile(r"(\d+) tokens · ([\d.]+) tok/s(?: · tau ([\d.]+))? · (\w+)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Terminal:
    """A command in a pseudo-terminal of `columns` x 40; `expect` reads until a pattern shows up."""

    def __init__(self, command: list[str], columns: int = 80, env: dict | None = None):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        self.proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     env=os.environ | (env or {}) | {"COLUMNS": str(columns), "TERM": "xterm"})
        os.close(slave)
        self.master, self.seen, self.closed = master, "", False

    def expect(self, pattern: re.Pattern | str, timeout: float) -> re.Match:
        pattern = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while (found := pattern.search(self.seen)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                raise TimeoutError(f"no {pattern.pattern!r} in: {self.seen[-400:]!r}")
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # the command closed its terminal
                    data = b""
                self.closed = not data
                self.seen += ANSI.sub("", data.decode(errors="replace"))
        self.seen = self.seen[found.end():]
        return found

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def close(self) -> None:
        os.write(self.master, b"\x04")  # Ctrl-D at the prompt: the chat ends (and saves the conversation)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.master)


def run_chat(extra: str, questions: list[str], max_new_tokens: int, env: dict) -> dict:
    command = [str(Path(sys.executable).parent / "fastspec"), "chat", "--max-new-tokens", str(max_new_tokens), *shlex.split(extra)]
    term = Terminal(command, env=env)
    try:
        banner = " ".join(term.expect(re.compile(r"fastspec chat · (.*?)\n/reset", re.S), 600).group(1).split())
        answers = []
        for question in questions:
            term.expect("you>", 600)
            term.type(question)
            m = term.expect(STATUS, 600)
            answers.append({"tokens": int(m.group(1)), "tok_s": float(m.group(2)),
                            "tau": float(m.group(3)) if m.group(3) else None, "finish": m.group(4)})
        term.expect("you>", 60)
    finally:
        term.close()
    return {"command": shlex.join(["fastspec", *command[1:]]), "banner": banner, "answers": answers}


def median_run(runs: list[dict]) -> dict:
    """One variant's trials as one: per answer the median tok/s (tokens and tau are the same in every trial: greedy,
    the same conversation), every trial's tok/s kept."""
    out = dict(runs[0], answers=[])
    for i, first in enumerate(runs[0]["answers"]):
        rates = [r["answers"][i]["tok_s"] for r in runs]
        out["answers"].append(dict(first, tok_s=statistics.median(rates), trials=rates))
    return out


class Transformers:
    """transformers' greedy chat on the embedded model, loaded once; `run` answers the questions anew."""

    def __init__(self):
        import torch
        from transformers import AutoTokenizer

        from fastspec.models.embedded import embedded_model_dir
        from fastspec.models.reference import transformers_model

        directory = embedded_model_dir()
        self.torch, self.tok = torch, AutoTokenizer.from_pretrained(directory)
        self.model = transformers_model(directory)
        self._generate([{"role": "user", "content": "Hi"}], 8)  # warm-up, as the chat warms up

    def _generate(self, messages: list[dict], n: int) -> tuple[str, int, float]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
        with self.torch.inference_mode():
            start = time.perf_counter()
            generated = self.model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            seconds = time.perf_counter() - start
        answer = generated[0, ids["input_ids"].shape[1]:]
        return self.tok.decode(answer, skip_special_tokens=True), len(answer), seconds

    def run(self, questions: list[str], lengths: list[int]) -> dict:
        messages, answers = [], []
        for question, n in zip(questions, lengths):
            messages.append({"role": "user", "content": question})
            text, tokens, seconds = self._generate(messages, n)
            messages.append({"role": "assistant", "content": text})
            answers.append({"tokens": tokens, "tok_s": tokens / seconds})
        return {"answers": answers}


def tuned_plain_at_1(scratch: Path) -> dict:
    """A scratch cache whose tuned file (for this machine, the embedded model and its head) decodes plainly at
    batch 1 and speculates from batch 2; the converted model is shared with the user's cache. -> env for chats."""
    from fastspec.models.embedded import DEFAULT_MODEL, embedded_head, embedded_model_dir, models_root
    from fastspec.speculative.tuned import fingerprint, save_tuned, tuned_path

    env = {"FASTSPEC_CACHE": str(scratch), "FASTSPEC_MODEL_CACHE": str(models_root())}
    os.environ.update(env)  # tuned_path and the fingerprint read the cache root, as the chat will
    target, head = embedded_model_dir(), embedded_head(DEFAULT_MODEL)
    save_tuned(tuned_path(target, head, "float32", "cpu"), fingerprint(target, head, "float32", "cpu"),
               [{"max_batch_size": 1, "params": None}, {"max_batch_size": 48, "params": [5, 4, 8]}])
    return env


def markdown(report: dict) -> str:
    variants = report["variants"]
    names = [" ".join(v["command"].split()[4:]) or "default" for v in variants]
    head = ["answer", "tokens"] + [f"`{n}` tok/s" for n in names] + [f"{names[0]} / {n}" for n in names[1:]]
    head += ["transformers tok/s", f"{names[0]} / transformers"] if report.get("transformers") else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, first in enumerate(variants[0]["answers"]):
        row = [str(i + 1), str(first["tokens"])]
        row += [f"{v['answers'][i]['tok_s']:.1f}" + (f" (tau {v['answers'][i]['tau']:.2f})" if v["answers"][i]["tau"]
                                                     else "") for v in variants]
        row += [f"{first['tok_s'] / v['answers'][i]['tok_s']:.2f}x" for v in variants[1:]]
        if report.get("transformers"):
            peer = report["transformers"][i]["tok_s"]
            row += [f"{peer:.1f}", f"{first['tok_s'] / peer:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + [""] + [f"- `{n}`: banner `{v['banner']}`" for n, v in zip(names, variants)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", help='extra `fastspec chat` flags ("" = the default)')
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3, help="runs of each variant, alternating; per answer the "
                                                               "median tok/s")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--tuned-plain-at-1", action="store_true", help="chats read a tuned file that decodes "
                                                                        "plainly at batch 1 (a scratch cache)")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "chat.json")
    args = parser.parse_args()
    questions = (QUESTIONS * (args.turns // len(QUESTIONS) + 1))[: args.turns]
    flags = args.variant or ["", "--speculative-algorithm NONE"]
    env = tuned_plain_at_1(Path(tempfile.mkdtemp(prefix="fastspec-bench-"))) if args.tuned_plain_at_1 else {}
    peer = None if args.no_transformers else Transformers()
    trials = []
    for _ in range(args.trials):
        chats = [run_chat(v, questions, args.max_new_tokens, env) for v in flags]
        lengths = [a["tokens"] for a in chats[0]["answers"]]
        trials.append(chats + ([] if peer is None else [peer.run(questions, lengths)]))
    variants = [median_run([t[i] for t in trials]) for i in range(len(flags))]
    report = {"questions": questions, "variants": variants, "cpu": _cpu(), "tuned_plain_at_1": args.tuned_plain_at_1}
    if peer is not None:
        report["transformers"] = median_run([t[-1] for t in trials])["answers"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    print(markdown(report))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
