"""The `fastspec train-draft` job: data -> features -> draft vocabulary -> TTT training -> exported head.

Everything lives in the output directory: `train/` holds the conversations, cached features, the vocabulary and
the resumable checkpoint (written atomically every `checkpoint_every` steps); the exported head is
`config.json` + `model.safetensors` in the SGLang / SpecForge EAGLE-3 format (bf16; the embedding is the
target's and is not stored, as SGLang shares it too). Reports progress through a callback; rendering is cli's.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from fastspec.errors import FastspecError
from fastspec.models.causal_lm import eagle3_capture_layers
from fastspec.models.loader import load_target, read_config
from fastspec.models.model_config import ModelConfig
from fastspec.models.sources import resolve_model_dir
from fastspec.prompts import load_prompts, read_jsonl_prompts
from fastspec.train.checkpoint import (
    atomic_json,
    atomic_save,
    check_warm_start,
    export_head,
    head_config,
    init_head,
    load_checkpoint,
    save_checkpoint,
    warm_start,
)
from fastspec.train.corpus import Corpus
from fastspec.train.data import (
    SAMPLED,
    Features,
    JsonlStore,
    check_prompts,
    choose_draft_vocab,
    extract_features,
    generate_conversations,
    pack,
    response_labels,
)
from fastspec.train.job import Progress, TrainConfig
from fastspec.train.resume import (
    check_out,
    check_same_answers,
    check_same_draft_vocab,
    check_same_plan,
    check_same_target,
    prepare_out,
    read_vocab,
)
from fastspec.train.ttt import make_batch, ttt_loss


def train_draft(cfg: TrainConfig, on_progress: Callable[[Progress], None] = lambda p: None) -> dict:
    """Run (or resume) the whole job; returns the final held-out evaluation."""
    check_out(cfg)  # every input before anything is read, converted or deleted
    model_dir = resolve_model_dir(cfg.model)
    if cfg.init == "target":
        check_warm_start(read_config(model_dir))
    draft_vocab = cfg.draft_vocab(read_config(model_dir).vocab_size)
    prompts = (read_jsonl_prompts(cfg.prompts) if cfg.prompts else load_prompts("all", "train"))[:cfg.max_prompts]
    corpus = Corpus(cfg.corpus, model_dir, _provenance(cfg)) if cfg.corpus else None  # refuses another target's
    store = corpus or JsonlStore(Path(cfg.out) / "train" / "conversations.jsonl")
    made = store.records() if corpus or cfg.resume else []  # read once (a new run's --out holds none of its own)
    check_prompts(model_dir, prompts, cfg.max_new_tokens, str(cfg.prompts or "the built-in train prompts"),
                  _answered(made, cfg.samples_per_prompt))
    work = prepare_out(cfg)
    check_same_target(work, model_dir)
    check_same_draft_vocab(work, draft_vocab)
    check_same_plan(work, cfg, prompts)
    conversations = _conversations(cfg, model_dir, prompts, store, made, on_progress)
    check_same_answers(work, conversations)
    if cfg.generate_only:
        return {"conversations": len(conversations), "tokens": sum(len(c.ids) for c in conversations)}
    target_cfg = read_config(model_dir)
    target = load_target(model_dir, torch.float32, cfg.device,
                         capture_layers=eagle3_capture_layers(target_cfg.num_layers, None))
    features = _features(target, conversations, work, cfg, on_progress)
    vocab = _vocab(features, target_cfg.vocab_size, draft_vocab, work)
    if int(vocab.max()) >= target_cfg.vocab_size:
        raise FastspecError(f"{work / 'vocab.pt'} was chosen for a different target; use --overwrite to start over")
    head_json = head_config(json.loads((model_dir / "config.json").read_text()), len(vocab), target_cfg.num_layers)
    head = init_head(ModelConfig.from_hf(head_json), target, vocab, cfg.seed)
    if cfg.init == "target":
        warm_start(head, target, eagle3_capture_layers(target_cfg.num_layers, None))
    head.to(cfg.device)
    is_val = [_is_val(prompts, c, cfg) for c in range(len(conversations))]
    train_ids = [c for c, v in enumerate(is_val) if not v]
    val_ids = [c for c, v in enumerate(is_val) if v and conversations[c].greedy]
    if not train_ids:
        raise FastspecError("no training conversations (every prompt fell in the validation split)")
    t2d = torch.full((target_cfg.vocab_size,), -1, dtype=torch.int64).index_put_((vocab,), torch.arange(len(vocab)))
    del target  # the head keeps the embedding and nothing else of it
    report = _fit(head, features, train_ids, val_ids, t2d, cfg, work, on_progress)
    export_head(head, head_json, vocab, cfg.out)
    config = asdict(cfg) | {"draft_vocab_size": len(vocab)}  # (the size used, also where left out)
    atomic_json(report | {"config": _jsonable(config)}, work / "report.json")
    on_progress(Progress("done", 1, 1, report))
    return report


def _answered(made: list[dict], samples: int) -> frozenset[str]:
    """The prompts whose every answer is already `made` (records of the corpus, or of the run --resume continues)."""
    keys = {(r["prompt"], r["sample"]) for r in made}
    return frozenset(p for p, s in keys if all((p, k) in keys for k in range(samples)))


def _provenance(cfg: TrainConfig) -> dict:
    """What made a corpus shard: enough to make it again."""
    return {"command": "fastspec train-draft", "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
            "first_sample": "greedy", "other_samples": SAMPLED, "dtype": "float32", "batch": cfg.generate_batch}


def _conversations(cfg, model_dir, prompts, store, made, on_progress):
    from fastspec.llm import LLM

    llm = LLM(model=str(model_dir), speculative_algorithm="NONE", max_running_requests=cfg.generate_batch,
              max_total_tokens=cfg.generate_batch * (cfg.max_new_tokens + 512), device=cfg.device,
              dtype="float32", threads=None)  # the provenance's dtype (auto is 16-bit on CUDA); threads as set
    report = lambda done, total: on_progress(Progress("generate", done, total))  # noqa: E731
    return generate_conversations(llm, prompts, store, made, cfg.samples_per_prompt,
                                  cfg.max_new_tokens, cfg.seed, cfg.generate_batch, report)


def _features(target, conversations, work: Path, cfg: TrainConfig, on_progress) -> Features:
    """Cached in train/features.pt, keyed by a checksum of the conversations' token ids."""
    tc = target.config
    shape = [tc.hidden_size, tc.num_layers, tc.vocab_size] + ([cfg.soft_topk] if cfg.soft_topk else [])
    key = zlib.crc32(json.dumps([shape] + [conv.ids for conv in conversations]).encode())
    path = work / "features.pt"
    if path.exists():
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")
            if int(saved.pop("key")) == key:
                return Features(**saved)
        except Exception:  # a damaged cache: computed again below
            pass
    report = lambda done, total: on_progress(Progress("features", done, total))  # noqa: E731
    features = extract_features(target, conversations, cfg.batch_tokens, cfg.bf16, report, cfg.soft_topk)
    atomic_save(asdict(features) | {"key": torch.tensor(key)}, path)
    return features


def _vocab(features: Features, vocab_size: int, draft_vocab_size: int, work: Path) -> torch.Tensor:
    """[Vd] ascending target ids, chosen once and kept (a resumed run must keep its head's vocabulary)."""
    path = work / "vocab.pt"
    if path.exists():
        return read_vocab(path)
    vocab = choose_draft_vocab(response_labels(features), vocab_size, draft_vocab_size)
    atomic_save(vocab, path)
    return vocab


def _is_val(prompts: list[str], conversation: int, cfg: TrainConfig) -> bool:
    prompt = prompts[conversation // cfg.samples_per_prompt]
    return zlib.crc32(prompt.encode()) % 10_000 < cfg.val_fraction * 10_000


def _fit(head, features, train_ids, val_ids, t2d, cfg: TrainConfig, work: Path, on_progress) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = schedule(features, train_ids, cfg)
    total = len(plan)
    start = load_checkpoint(work / "checkpoint.pt", head, opt)
    info, began = {}, time.perf_counter()
    for step in range(start, total):
        epoch, group = plan[step]
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, cfg.lr)
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16):
            stats = ttt_loss(head, make_batch(features, group, t2d, cfg.ttt_steps).to(cfg.device))
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        info = {"loss": round(stats.loss.item(), 4), "lr": opt.param_groups[0]["lr"], "epoch": epoch + 1}
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total:
            save_checkpoint(work / "checkpoint.pt", head, opt, step + 1)
            info |= evaluate(head, features, val_ids, t2d, cfg)
        on_progress(Progress("train", step + 1, total, info))
    return evaluate(head, features, val_ids, t2d, cfg) | {
        "steps": total, "train_conversations": len(train_ids), "train_tokens": _tokens(features, train_ids),
        "val_conversations": len(val_ids), "seconds_this_run": round(time.perf_counter() - began, 1)}


def schedule(features: Features, ids: list[int], cfg: TrainConfig) -> list[tuple[int, list[int]]]:
    """Every optimiser step's (epoch, conversations): each epoch a fresh shuffle of `ids` packed into batches.
    Fixed by the seed, so a resumed run continues the same plan; epochs may pack into different numbers of
    batches (a shuffle decides how well sequences fill `batch_tokens`)."""
    lengths = (features.offsets[1:] - features.offsets[:-1]).tolist()
    plan = []
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch)).tolist()
        shuffled = [ids[i] for i in order]
        plan += [(epoch, [shuffled[i] for i in g]) for g in pack([lengths[c] for c in shuffled], cfg.batch_tokens)]
    return plan


def _lr(step: int, total: int, peak: float) -> float:
    """Linear warm-up over 3% of the steps, then cosine down to 10% of the peak."""
    warm = max(1, int(0.03 * total))
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(head, features: Features, val_ids: list[int], t2d: torch.Tensor, cfg: TrainConfig) -> dict:
    """Held-out top-1 acceptance per depth: `acceptance[k]` = P(drafts 1..k+1 of a chain all right), so a
    chain of n steps accepts 1 + sum(acceptance[:n]) tokens per round on these conversations."""
    if not val_ids:
        return {}
    lengths = (features.offsets[1:] - features.offsets[:-1]).tolist()
    sums = torch.zeros(3, cfg.ttt_steps, dtype=torch.int64)
    for group in pack([lengths[c] for c in val_ids], cfg.batch_tokens):
        with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16):
            batch = make_batch(features, [val_ids[i] for i in group], t2d, cfg.ttt_steps).to(cfg.device)
            stats = ttt_loss(head, batch)
        sums += torch.stack([stats.correct, stats.chain_correct, stats.count]).cpu()
    acceptance = (sums[1] / sums[2].clamp(min=1)).tolist()
    return {"val_top1": [round(x, 4) for x in (sums[0] / sums[2].clamp(min=1)).tolist()],
            "val_acceptance": [round(x, 4) for x in acceptance], "val_chain_tau": round(1 + sum(acceptance), 3)}


def _tokens(features: Features, ids: list[int]) -> int:
    return int(sum(int(features.offsets[c + 1] - features.offsets[c]) for c in ids))


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}
