"""The learning curve of an EAGLE-3 head on the embedded model: held-out acceptance per depth and chain tau
against training tokens and wall-clock, for hard vs soft labels and random vs target init.

Every point trains a head with `fastspec train-draft` on a fraction of the corpus's training prompts; the
held-out prompts (the built-in split `train-draft` keeps out by prompt hash) are the same for every point.
Points already in the results file are skipped, so the curve grows across sessions (`--fractions` adds points).

    .venv/bin/python bench/learning_curve.py [--fractions 0.25,0.5,1] [--variants hard-random,soft-target]
        [--epochs 4] [--corpus data/corpus/smollm2-135m-instruct] [--work /tmp/fastspec-curve]

Writes bench/results/learning_curve.json and, with matplotlib, learning_curve.png next to it.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

from fastspec.prompts import load_prompts
from fastspec.train.trainer import TrainConfig, train_draft

VARIANTS = {"hard-random": (0, "random"), "soft-random": (32, "random"), "hard-target": (0, "target"),
            "soft-target": (32, "target")}
RESULTS = Path(__file__).parent / "results" / "learning_curve.json"


def split_prompts(val_fraction: float) -> tuple[list[str], list[str]]:
    """(held-out, train) built-in train-split prompts, by the hash train-draft uses for its validation split."""
    prompts = load_prompts("all", "train")
    held = [p for p in prompts if zlib.crc32(p.encode()) % 10_000 < val_fraction * 10_000]
    return held, [p for p in prompts if p not in set(held)]


def train_point(args, variant: str, fraction: float, held: list[str], train: list[str]) -> dict:
    soft, init = VARIANTS[variant]
    chosen = held + train[: max(1, round(fraction * len(train)))]
    work = Path(args.work) / f"{variant}-{fraction}"
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen))
    cfg = TrainConfig(out=work / "head", prompts=prompts, corpus=Path(args.corpus), soft_topk=soft, init=init,
                      epochs=args.epochs, draft_vocab_size=args.draft_vocab_size, val_fraction=args.val_fraction,
                      lr=args.lr, resume=(work / "head").exists())
    report = train_draft(cfg, lambda p: None)
    return {"variant": variant, "fraction": fraction, "train_tokens": report["train_tokens"],
            "seconds": report["seconds_this_run"], "val_acceptance": report["val_acceptance"],
            "val_chain_tau": report["val_chain_tau"], "epochs": args.epochs}


def plot(points: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: pip install matplotlib")
        return
    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in VARIANTS:
        mine = sorted((p for p in points if p["variant"] == variant), key=lambda p: p["train_tokens"])
        if mine:
            by_tokens.plot([p["train_tokens"] for p in mine], [p["val_chain_tau"] for p in mine], "o-", label=variant)
            by_seconds.plot([p["seconds"] for p in mine], [p["val_chain_tau"] for p in mine], "o-", label=variant)
    by_tokens.set_xscale("log"), by_tokens.set_xlabel("training tokens"), by_tokens.set_ylabel("held-out chain tau")
    by_seconds.set_xlabel("training seconds (this machine)"), by_tokens.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0.25,0.5,1")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--draft-vocab-size", type=int, default=6144)
    ap.add_argument("--val-fraction", type=float, default=0.04)
    ap.add_argument("--corpus", default="data/corpus/smollm2-135m-instruct")
    ap.add_argument("--work", default="/tmp/fastspec-curve")
    args = ap.parse_args()
    points = json.loads(RESULTS.read_text())["points"] if RESULTS.exists() else []
    held, train = split_prompts(args.val_fraction)
    for variant in args.variants.split(","):
        for fraction in (float(f) for f in args.fractions.split(",")):
            if any(p["variant"] == variant and p["fraction"] == fraction and p["epochs"] == args.epochs
                   for p in points):
                continue
            point = train_point(args, variant, fraction, held, train)
            print(json.dumps(point))
            points.append(point)
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps({"points": points}, indent=1) + "\n")
    plot(points, RESULTS.with_suffix(".png"))


if __name__ == "__main__":
    main()
