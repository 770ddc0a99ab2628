"""The learning curve of an EAGLE-3 head on the embedded model: held-out acceptance per depth and chain tau
against training tokens and wall-clock, for hard vs soft labels and random vs target init.

Every point trains a head with `fastspec train-draft` on a fraction of the corpus's training prompts; the
held-out prompts (the built-in split `train-draft` keeps out by prompt hash) are the same for every point.
Points already in the results file are skipped, so the curve grows across sessions (`--fractions` adds points).

    .venv/bin/python bench/learning_curve.py [--fractions 0.25,0.5,1] [--variants hard-random,soft-target]
        [--epochs 4] [--samples-per-prompt 1] [--corpus data/corpus/smollm2-135m-instruct] [--work /tmp/fastspec-curve]

Writes bench/results/learning_curve.json and, with matplotlib, learning_curve.png next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import zlib
from pathlib import Path

from fastspec.prompts import load_prompts
from fastspec.train.trainer import TrainConfig, train_draft

VARIANTS = {"hard-random": (0, "random"), "soft-random": (32, "random"), "hard-target": (0, "target"),
            "soft-target": (32, "target")}
RESULTS = Path(__file__).parent / "results" / "learning_curve.json"
DEFAULTS = {"epochs": 4, "lr": 8e-4, "batch_tokens": 2048, "samples_per_prompt": 1}  # what the first points
# (which did not record them) ran with
DATA_SIZE = ("samples_per_prompt",)  # like the fraction, more answers per prompt is more data: one curve


def split_prompts(val_fraction: float) -> tuple[list[str], list[str]]:
    """(held-out, train) built-in train-split prompts, by the hash train-draft uses for its validation split."""
    prompts = load_prompts("all", "train")
    held = [p for p in prompts if zlib.crc32(p.encode()) % 10_000 < val_fraction * 10_000]
    return held, [p for p in prompts if p not in set(held)]


def settings(args) -> dict:
    """What besides variant and fraction makes a point: points that differ in these are different points."""
    return {"epochs": args.epochs, "lr": args.lr, "batch_tokens": args.batch_tokens,
            "samples_per_prompt": args.samples_per_prompt}


def train_point(args, variant: str, fraction: float, held: list[str], train: list[str]) -> dict:
    soft, init = VARIANTS[variant]
    chosen = held + train[: max(1, round(fraction * len(train)))]
    tag = "-".join(f"{k}{v}" for k, v in settings(args).items())
    work = Path(args.work) / f"{variant}-{fraction}-{tag}"
    (work / "head" / "train").mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen))
    _share_features(Path(args.work), work, f"{'soft' if soft else 'hard'}-", fraction)
    cfg = TrainConfig(out=work / "head", prompts=prompts, corpus=Path(args.corpus), soft_topk=soft, init=init,
                      epochs=args.epochs, draft_vocab_size=args.draft_vocab_size, val_fraction=args.val_fraction,
                      lr=args.lr, batch_tokens=args.batch_tokens, samples_per_prompt=args.samples_per_prompt,
                      resume=True)
    history, began = [], time.perf_counter()

    def record(progress) -> None:  # every evaluation: the curve against wall-clock inside one run
        if progress.phase == "train" and "val_chain_tau" in progress.info:
            history.append({"step": progress.done, "seconds": round(time.perf_counter() - began, 1),
                            "val_chain_tau": progress.info["val_chain_tau"],
                            "depth0": progress.info["val_acceptance"][0]})

    report = train_draft(cfg, record)
    return {"variant": variant, "fraction": fraction, **settings(args), "train_tokens": report["train_tokens"],
            "steps": report["steps"], "seconds": report["seconds_this_run"], "bf16": cfg.bf16,
            "val_acceptance": report["val_acceptance"], "val_chain_tau": report["val_chain_tau"], "history": history}


def _share_features(root: Path, work: Path, labels: str, fraction: float) -> None:
    """Link the features, vocabulary and target record of an earlier point on the same data (same labels and
    fraction) into `work`, so a point that changes only training settings skips feature extraction.
    train-draft checks the features' key against the conversations, so a wrong guess only costs the extraction."""
    mine = work / "head" / "train"
    if (mine / "features.pt").exists():
        return
    for other in sorted(root.glob(f"{labels}*-{fraction}*/head/train/features.pt")):
        for name in ("features.pt", "vocab.pt", "target.json"):
            if (other.parent / name).exists() and not (mine / name).exists():
                os.link(other.parent / name, mine / name)
        return


def plot(points: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: pip install matplotlib")
        return
    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(_label(p) for p in points):
        mine = sorted((p for p in points if _label(p) == label), key=lambda p: p["train_tokens"])
        line, = by_tokens.plot([p["train_tokens"] for p in mine], [p["val_chain_tau"] for p in mine], "o-", label=label)
        for p in mine:  # each run's evaluations against its own wall-clock, in its label's colour
            run = p.get("history") or [{"seconds": p["seconds"], "val_chain_tau": p["val_chain_tau"]}]
            by_seconds.plot([h["seconds"] for h in run], [h["val_chain_tau"] for h in run], ".-",
                            color=line.get_color())
    by_tokens.set_xscale("log"), by_tokens.set_xlabel("training tokens"), by_tokens.set_ylabel("held-out chain tau")
    by_seconds.set_xlabel("training seconds (this machine)"), by_tokens.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def slopes(points: list[dict], target_tau: float = 3.0) -> list[str]:
    """Per label with two or more data sizes: least-squares tau = a + b log10(tokens) over all its points and over
    its two largest (the curve bends down, so the last segment is the honest local slope), and what +0.5 tau and
    `target_tau` cost in tokens and (at the largest run's measured seconds per token-epoch) in training time."""
    lines = []
    for label in dict.fromkeys(_label(p) for p in points):
        mine = sorted((p for p in points if _label(p) == label), key=lambda p: p["train_tokens"])
        if len({p["train_tokens"] for p in mine}) < 2:
            continue
        top = mine[-1]
        hours_per_token = top["seconds"] / top["train_tokens"] / 3600  # at the same epochs
        for fit, part in (("all points", mine), ("last two", mine[-2:])):
            b = _slope(part)
            if b <= 0:
                lines.append(f"{label} ({fit}): tau does not rise with data ({b:+.3f} per 10x)")
                continue
            plus, reach = 10 ** (0.5 / b), 10 ** ((target_tau - top["val_chain_tau"]) / b)
            lines.append(f"{label} ({fit}): {b:+.3f} tau per 10x tokens; from {top['train_tokens']} tokens "
                         f"(tau {top['val_chain_tau']:.2f}) +0.5 tau needs {plus:.0f}x the tokens "
                         f"(~{top['train_tokens'] * plus * hours_per_token:.0f} h of training here), tau "
                         f"{target_tau:g} {reach:.0f}x (~{top['train_tokens'] * reach * hours_per_token:.0f} h); "
                         f"answer generation not counted")
    return lines


def _slope(points: list[dict]) -> float:
    xs = [math.log10(p["train_tokens"]) for p in points]
    ys = [p["val_chain_tau"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _label(point: dict) -> str:
    changed = [f"{k} {point.get(k, DEFAULTS[k])}" for k in DEFAULTS
               if k not in DATA_SIZE and point.get(k, DEFAULTS[k]) != DEFAULTS[k]]
    return ", ".join([point["variant"], *changed])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt (the corpus's first "
                    "is greedy, the others sampled; held-out prompts are scored on the greedy one only)")
    ap.add_argument("--draft-vocab-size", type=int, default=6144)
    ap.add_argument("--val-fraction", type=float, default=0.04)
    ap.add_argument("--corpus", default="data/corpus/smollm2-135m-instruct")
    ap.add_argument("--work", default="/tmp/fastspec-curve")
    args = ap.parse_args()
    points = json.loads(RESULTS.read_text())["points"] if RESULTS.exists() else []
    held, train = split_prompts(args.val_fraction)
    for variant in args.variants.split(","):
        for fraction in (float(f) for f in args.fractions.split(",")):
            if any(p["variant"] == variant and p["fraction"] == fraction
                   and all(p.get(k, DEFAULTS[k]) == v for k, v in settings(args).items()) for p in points):
                continue
            point = train_point(args, variant, fraction, held, train)
            print(json.dumps(point))
            points.append(point)
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps({"points": points}, indent=1) + "\n")
    plot(points, RESULTS.with_suffix(".png"))
    print("\n".join(slopes(points)))


if __name__ == "__main__":
    main()
