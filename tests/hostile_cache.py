"""A fastspec cache as a user's machine can leave it: tuned files of another dtype, of another machine, naming
trees that cannot exist, cut short mid-write, in an old layout; compiled graphs from other runs, some damaged;
chat histories and converted models that are not what their names say.

`fill(cache, target, draft)` writes such entries for one target and draft into `cache` (the directory that
$FASTSPEC_CACHE names) and `damage_compiled` cuts a compiled-graph cache in half; test_hermetic.py runs the CLI
over both. As a script it prepares the whole-suite check of
.ci/run: `python tests/hostile_cache.py DIR` trains a head for the tiny chat target, runs the real
`fastspec tune` on it with $XDG_CACHE_HOME=DIR, then adds the damaged entries for the embedded model. Knows nothing about what the tests expect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRUNCATED_TUNED = '{"version": 1, "fingerprint": {"hardware": "x'


def fill(cache: Path, target: Path, draft: Path, label: str = "float32") -> None:
    """Damaged and foreign entries for (target, draft) in every place fastspec reads under `cache`; `label`: the
    weights label (speculative.tuned.weights_label) the target's commands run under by default on the CPU."""
    from fastspec.speculative.tuned import VERSION, fingerprint, tuned_path

    real = fingerprint(target, draft, label, "cpu")
    tuned = cache / "tuned" / tuned_path(target, draft, label, "cpu").name
    tuned.parent.mkdir(parents=True, exist_ok=True)
    tuned.write_text(TRUNCATED_TUNED)  # cut short mid-write
    other_dtype = tuned.parent / tuned_path(target, draft, "bfloat16", "cpu").name  # float32's print, impossible
    other_dtype.write_text(json.dumps({"version": VERSION, "fingerprint": real,
                                       "tiers": [{"max_batch_size": 1, "params": [1, 4, 8]}]}))
    (tuned.parent / f"{target.name}--{draft.name}.json").write_text(json.dumps(  # the old layout, another machine
        {"version": VERSION, "fingerprint": real | {"hardware": "another machine"},
         "tiers": [{"max_batch_size": 64, "params": [2, 1, 3]}]}))
    (tuned.parent / f"{target.name}--{draft.name}--float16-cuda.json").write_bytes(b"\x00\xff" * 64)
    chats = cache / "chats"
    chats.mkdir(exist_ok=True)
    (chats / "chat-20260101-000000.json").write_text('{"messages": [')
    damage_compiled(cache / "inductor")
    converted = cache / "smollm2-135m-instruct"
    converted.mkdir(exist_ok=True)
    (converted / "fastspec_source.json").write_text("[not a marker")
    (converted / "config.json").write_text("{}")


def damage_compiled(inductor: Path) -> None:
    """Cut every file of Inductor's on-disk cache in half (the real keys of the run that wrote them), and add
    FX-graph and AOTAutograd entries of keys no run of this code writes."""
    for f in [f for f in inductor.rglob("*") if f.is_file()]:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    for kind in ("fxgraph", "aotautograd"):
        entry = inductor / kind / "zz" / f"{kind[0]}zz{'0' * 48}"
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "stale").write_bytes(b"\x80\x04stale pickle from another torch")


def main(root: Path) -> None:
    """A cache that `fastspec tune` has really written, then damaged; $XDG_CACHE_HOME=root uses it."""
    from tiny_models import write_chat_target, write_prompt_file

    from fastspec.models.embedded import DEFAULT_MODEL, embedded_head, embedded_model_dir
    from fastspec.train.trainer import TrainConfig, train_draft

    cache = root / "fastspec"
    env = {**os.environ, "XDG_CACHE_HOME": str(root), "FASTSPEC_CACHE": str(cache)}
    os.environ.update(env)
    work = root / "work"
    target = write_chat_target(work / "target")
    prompts = write_prompt_file(work / "prompts.jsonl")
    head = work / "head"
    if not (head / "model.safetensors").exists():
        train_draft(TrainConfig(out=head, model=str(target), prompts=prompts, max_new_tokens=24, draft_vocab_size=40,
                                ttt_steps=3, epochs=4, lr=3e-3, batch_tokens=128, val_fraction=0.2, bf16=False))
    subprocess.run([sys.executable, "-m", "fastspec.cli", "tune", "--model", str(target), "--draft", str(head),
                    "--speculative-algorithm", "EAGLE3", "--batch-sizes", "1,2", "--budget", "300",
                    "--num-prompts", "4", "--max-new-tokens", "16", "--prompts", str(prompts)], env=env, check=True)
    # the tiny target keeps the file tune wrote; the embedded model (converted into `cache` here) gets the damage
    fill(cache, embedded_model_dir(), embedded_head(DEFAULT_MODEL), embedded_label())


def embedded_label() -> str:
    """The label the embedded model's commands key their tuned file by on the CPU (its Q4_1 blocks, the KV cache's
    default dtype for them)."""
    from fastspec.config import kv_cache_dtype_name
    from fastspec.speculative.tuned import weights_label

    return weights_label("float32", "gguf", kv_cache_dtype_name("auto", "float32", "cpu", "gguf"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/hostile_cache.py DIR")
    main(Path(sys.argv[1]).resolve())
