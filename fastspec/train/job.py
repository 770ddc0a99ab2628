"""What a `fastspec train-draft` job is asked to do (TrainConfig, checked at construction) and what it reports as it
goes (Progress). Imports nothing heavy at module level, so the CLI builds its flags from these defaults without
torch; fastspec.train.trainer runs the job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastspec.errors import FastspecError

INITS = ("random", "target")
DRAFT_VOCAB_SIZE = 4096  # the draft vocabulary when --draft-vocab-size is left out, or the target's if smaller


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    model: str = "smollm2-135m-instruct"
    prompts: Path | None = None  # JSONL; None: the train split of every built-in prompt set
    max_prompts: int | None = None  # only the first N prompts
    samples_per_prompt: int = 1  # the first answer is greedy, the others sampled
    max_new_tokens: int = 256
    corpus: Path | None = None  # a growing, committable store of the target's answers (train/corpus.py)
    generate_only: bool = False  # stop once every answer is in the store (grow a corpus)
    draft_vocab_size: int | None = None  # None: DRAFT_VOCAB_SIZE, or the target's whole vocabulary if smaller
    soft_topk: int = 0  # > 0: train against the target's top-k next-token probabilities (soft labels), not argmax
    init: str = "random"  # random | target: the midlayer and fc warm-started from the target (checkpoint.warm_start)
    ttt_steps: int = 5
    epochs: int = 6
    lr: float = 6e-4
    batch_tokens: int = 2048
    val_fraction: float = 0.05
    checkpoint_every: int = 50
    seed: int = 0
    bf16: bool | None = None  # autocast, master weights stay float32; None: on a GPU, or a CPU measured faster in bf16
    device: str = "auto"  # auto | cpu | cuda[:N]: where the target answers, features are computed and the head trains
    resume: bool = False
    overwrite: bool = False
    generate_batch: int = 64

    def __post_init__(self):
        for name in ("samples_per_prompt", "max_new_tokens", "ttt_steps", "epochs", "batch_tokens",
                     "checkpoint_every", "generate_batch"):
            if getattr(self, name) < 1:
                raise FastspecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise FastspecError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise FastspecError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if not 0 < self.lr < float("inf"):
            raise FastspecError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise FastspecError(f"--draft-vocab-size must be >= 1, got {self.draft_vocab_size}")
        if self.soft_topk < 0:
            raise FastspecError(f"--soft-labels must be >= 0, got {self.soft_topk}")
        if self.draft_vocab_size is not None:  # (left out: checked against the target's vocabulary)
            self.draft_vocab(self.draft_vocab_size)
        if self.init not in INITS:
            raise FastspecError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.resume and self.overwrite:
            raise FastspecError("--resume and --overwrite exclude each other")
        from fastspec.config import check_device, resolve_device  # torch: only once a job is configured
        from fastspec.kernels.cpu_linear import bf16_matmul_is_faster

        object.__setattr__(self, "device", resolve_device(self.device))
        check_device(self.device)
        if self.bf16 is None:  # resolved once, recorded in report.json
            object.__setattr__(self, "bf16", self.device != "cpu" or bf16_matmul_is_faster())

    def draft_vocab(self, vocab_size: int) -> int:
        """The draft vocabulary's size for a target of `vocab_size` tokens. A --draft-vocab-size typed above it is
        refused (a head smaller than asked), as --soft-labels above the draft vocabulary is; left out, it is
        DRAFT_VOCAB_SIZE or the whole vocabulary if smaller."""
        size = min(DRAFT_VOCAB_SIZE, vocab_size) if self.draft_vocab_size is None else self.draft_vocab_size
        if size > vocab_size:
            raise FastspecError(f"--draft-vocab-size {size} is above the target's vocabulary of {vocab_size} "
                                f"tokens: give at most {vocab_size}, or leave it out (the whole vocabulary then)")
        if self.soft_topk > size:
            raise FastspecError(f"--soft-labels must be in [0, --draft-vocab-size {size}], got {self.soft_topk}")
        return size


@dataclass(frozen=True)
class Progress:
    phase: str  # generate | features | train | done
    done: int
    total: int
    info: dict = field(default_factory=dict)  # train: loss, lr; evaluations: acceptance per depth, chain tau
