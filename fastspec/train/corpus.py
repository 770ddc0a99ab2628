"""The corpus: a target's own answers, kept as they grow, so that every `train-draft` run adds to all the data
before it (and a corpus can be committed: ~2 bytes a token).

A corpus is one directory per target: `corpus.json` (the target's name and a digest of its weights) and
immutable shards `shard-NNNNN.npz`: compressed int32 token ids of the answers a run generated, with what made
them (command, seed, sampling, dtype, date). A shard is written to a temporary file and renamed into place, never
rewritten; a corpus of another target is refused, and a damaged shard is one error naming it. Knows nothing
about generation or training: `data.generate_conversations` decides what to add.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from fastspec.errors import FastspecError
from fastspec.utils.files import read_or_refuse, write_atomic, write_new

FORMAT = 1
MANIFEST = "corpus.json"
MOVE_AWAY = "move it away to continue"


class Corpus:
    """`records()` -> every answer so far; `append(records)` -> one new shard. Records are
    {"prompt": str, "sample": int, "prompt_ids": [int], "output_ids": [int]}."""

    def __init__(self, root: Path, target_dir: Path, provenance: dict):
        self.root, self.provenance = Path(root), provenance
        self.target = {"name": Path(target_dir).name, "weights": weights_digest(target_dir)}
        manifest = self.root / MANIFEST
        if manifest.exists():
            saved = read_or_refuse(manifest, lambda p: json.loads(p.read_text()), MOVE_AWAY)
            if not isinstance(saved, dict) or saved.get("format") != FORMAT:
                raise FastspecError(f"{manifest}: not a fastspec corpus (format {FORMAT})")
            theirs = saved.get("target", {})
            if theirs.get("weights") != self.target["weights"]:  # the names may be alike: the digests tell them apart
                raise FastspecError(f"corpus {self.root} holds answers of another target ({theirs.get('name')}, "
                                    f"weights {theirs.get('weights')}), not of {Path(target_dir).resolve()} "
                                    f"(weights {self.target['weights']})")
        else:
            manifest_text = json.dumps({"format": FORMAT, "target": self.target}, indent=1) + "\n"
            write_atomic(manifest, lambda f: f.write(manifest_text.encode()))

    def shards(self) -> list[Path]:
        return sorted(self.root.glob("shard-*.npz"))

    def records(self) -> list[dict]:
        return [r for shard in self.shards() for r in read_or_refuse(shard, _read_shard, MOVE_AWAY)]

    def append(self, records: list[dict]) -> Path:
        """Write `records` as the next shard (atomically); returns its path."""
        lengths = [(len(r["prompt_ids"]), len(r["output_ids"])) for r in records]
        tokens = np.array([t for r in records for t in (*r["prompt_ids"], *r["output_ids"])], dtype=np.int32)
        meta = {"prompts": [r["prompt"] for r in records], "samples": [r["sample"] for r in records],
                "made_by": self.provenance | {"date": time.strftime("%Y-%m-%d %H:%M:%S")}}
        index = int(self.shards()[-1].stem.split("-")[1]) + 1 if self.shards() else 0
        return write_new(self.root, [f"shard-{index:05d}.npz"], lambda f: np.savez_compressed(  # never overwrite
            f, tokens=tokens, lengths=np.array(lengths, dtype=np.int32).reshape(-1, 2),
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)))


def weights_digest(model_dir: Path) -> str:
    """sha256 over the target's tensors (names, dtypes, shapes, values) and config: the same for the same
    weights however the files are laid out."""
    from fastspec.models.loader import read_state_dict

    h = hashlib.sha256(json.dumps(json.loads((Path(model_dir) / "config.json").read_text()).get("architectures"))
                       .encode())
    for name, t in sorted(read_state_dict(Path(model_dir)).items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def _read_shard(path: Path) -> list[dict]:
    with np.load(path, allow_pickle=False) as z:
        tokens, lengths = z["tokens"].tolist(), z["lengths"].tolist()
        meta = json.loads(z["meta"].tobytes())
    if len(lengths) != len(meta["prompts"]) or sum(a + b for a, b in lengths) != len(tokens):
        raise ValueError("lengths do not match the tokens")
    out, start = [], 0
    for prompt, sample, (n_prompt, n_output) in zip(meta["prompts"], meta["samples"], lengths):
        out.append({"prompt": prompt, "sample": sample, "prompt_ids": tokens[start:start + n_prompt],
                    "output_ids": tokens[start + n_prompt:start + n_prompt + n_output]})
        start += n_prompt + n_output
    return out
