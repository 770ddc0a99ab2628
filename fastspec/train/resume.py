"""What a `fastspec train-draft` run shares with the run it continues: --out is a run's (or new), and a resumed run
has the same target, draft vocabulary, plan of steps and answers as its checkpoint, each refused in one line
before it is trained on otherwise. Owns the small records in `train/` that say so (target.json, plan.json,
answers.json); knows nothing about training itself (trainer.py).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch

from fastspec.errors import FastspecError
from fastspec.speculative.tuned import dir_digest
from fastspec.train.checkpoint import atomic_json, load_artifact
from fastspec.train.job import TrainConfig

EXPORTED = ("config.json", "model.safetensors")


def check_out(cfg: TrainConfig) -> None:
    """--out is absent, empty or a train-draft run (its train/ state): any other directory is the user's and is
    neither overwritten nor resumed into."""
    out, work = Path(cfg.out), Path(cfg.out) / "train"
    for flag, path in (("--out", out), ("--corpus", cfg.corpus)):
        if path is not None and path.exists() and not path.is_dir():
            raise FastspecError(f"{flag} {path} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not (cfg.resume or cfg.overwrite):
            raise FastspecError(f"--out {out} exists; pass --resume to continue it or --overwrite to start over")
        if not work.is_dir():
            action = "resume into" if cfg.resume else "overwrite"
            raise FastspecError(f"--out {out} is not a train-draft directory; refusing to {action} it")
    elif cfg.resume:  # (a mistyped --out would start the long run over, silently; transformers' Trainer refuses too)
        raise FastspecError(f"--resume: no train-draft run in {out} to continue; drop --resume to start one")


def prepare_out(cfg: TrainConfig) -> Path:
    """--out ready for this run (checked by check_out): emptied with --overwrite, created if new."""
    out, work = Path(cfg.out), Path(cfg.out) / "train"
    if out.exists() and any(out.iterdir()) and not cfg.resume:
        shutil.rmtree(work)
        for name in EXPORTED:
            (out / name).unlink(missing_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    return work


def check_same_target(work: Path, model_dir: Path) -> None:
    """A run's data, features and head belong to one target: resuming with another is refused, also one with the
    same config.json and other weights (a fine-tune, another seed): its config alone would not tell them apart."""
    config = json.loads((model_dir / "config.json").read_text())
    record = {"model": str(model_dir), "config_crc": zlib.crc32(json.dumps(config, sort_keys=True).encode()),
              "weights": dir_digest(model_dir)}
    path = work / "target.json"
    if path.exists():
        before = load_artifact(path, lambda p: json.loads(p.read_text()))
        if not isinstance(before, dict) or "config_crc" not in before:
            raise FastspecError(f"{path}: not a train-draft target record; use --overwrite to start over")
        same_weights = before.get("weights", record["weights"]) == record["weights"]  # an older record: its config
        if before["config_crc"] != record["config_crc"] or not same_weights:
            raise FastspecError(f"this run was made for the target {before['model']}, not {model_dir} as it is now "
                                "(another config or other weights): its data, features and head are that target's "
                                "(use --overwrite or another --out)")
    atomic_json(record, path)


def read_vocab(path: Path) -> torch.Tensor:
    """[Vd] the run's draft vocabulary as kept in train/vocab.pt, checked."""
    vocab = load_artifact(path, lambda p: torch.load(p, weights_only=True, map_location="cpu"))
    if not isinstance(vocab, torch.Tensor) or vocab.ndim != 1 or vocab.dtype != torch.int64 or not len(vocab):
        raise FastspecError(f"{path}: not a draft vocabulary; use --overwrite to start over")
    return vocab


def check_same_draft_vocab(work: Path, draft_vocab_size: int) -> None:
    """The draft vocabulary shapes the head: a resumed run with another --draft-vocab-size is refused, not
    trained on with the old one while report.json records the new."""
    path = work / "vocab.pt"
    if not path.exists():
        return
    kept = len(read_vocab(path))
    if kept != draft_vocab_size:
        raise FastspecError(f"this run's draft vocabulary has {kept} tokens, not --draft-vocab-size "
                            f"{draft_vocab_size}; pass --draft-vocab-size {kept} to resume it or --overwrite")


# what fixes a run's optimiser steps and their order: a resumed run must be asked for the same (flag: field)
PLAN = {"--prompts / --max-prompts": "prompts", "--samples-per-prompt": "samples_per_prompt",
        "--val-fraction": "val_fraction", "--epochs": "epochs", "--batch-tokens": "batch_tokens", "--seed": "seed",
        "--lr": "lr", "--ttt-steps": "ttt_steps", "--soft-labels": "soft_topk", "--init": "init"}


def check_same_plan(work: Path, cfg: TrainConfig, prompts: list[str]) -> None:
    """A checkpoint is a step of one plan (the shuffles, the batches, the lr schedule): resuming it with other
    flags is refused, not continued on a plan it was not part of. Before a first checkpoint nothing is bound."""
    plan = {field: getattr(cfg, field) for field in PLAN.values() if field != "prompts"}
    plan["prompts"] = zlib.crc32(json.dumps(prompts).encode())
    path = work / "plan.json"
    if path.exists() and (work / "checkpoint.pt").exists():
        before = load_artifact(path, lambda p: json.loads(p.read_text()))
        if not isinstance(before, dict):
            raise FastspecError(f"{path}: not a train-draft plan; use --overwrite to start over")
        for flag, field in PLAN.items():
            if field in before and before[field] != plan[field]:
                was = (f"on other prompts ({flag})" if field == "prompts" else
                       f"with {flag} {before[field]}, not {getattr(cfg, field)}")
                raise FastspecError(f"this run was trained {was}; pass the same flags to resume it, or --overwrite "
                                    "to start over")
    atomic_json(plan, path)


def check_same_answers(work: Path, conversations) -> None:
    """The plan's batches are made of these answers: a checkpoint is not continued on others (answers taken from
    another --corpus, or made again with another --max-new-tokens), which the plan flags do not fix."""
    crc = zlib.crc32(json.dumps([c.ids for c in conversations]).encode())
    path = work / "answers.json"
    if path.exists() and (work / "checkpoint.pt").exists():
        before = load_artifact(path, lambda p: json.loads(p.read_text()))
        if not isinstance(before, dict) or before.get("crc") != crc:
            raise FastspecError("this run was trained on other answers to its prompts (another --corpus or "
                                "--max-new-tokens?); pass the same flags to resume it, or --overwrite to start over")
    atomic_json({"crc": crc}, path)
