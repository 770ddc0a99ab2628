"""Cost by measurement: the real round functions (draft loop, draft extend, verify) and a plain decode step,
timed in-process on synthetic inputs of each shape, per batch size, at the workload's context length.

The functions run as the engine runs them, on its pools; only their inputs are made up (random tokens, every
request seeing `width` committed slots). On CUDA each shape is captured as a CUDA graph and its replays are
timed (the engine replays graphs too; the capture holds the eager kernels, quick to capture for every shape of the
grid, where the engine's are fused: costs keep their order, not their scale), with the device synchronised.
Writes go only to slots the allocator has free (never into KV a request or the prefix cache holds: a greedy
answer reusing a cached prefix would change). With prepacked CPU linears each timing first packs its own row
counts, as the engine would for a tuned tier. Knows nothing about acceptance or choosing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from fastspec.errors import FastspecError
from fastspec.graphs import GraphRunner, StaticInput
from fastspec.kernels.cpu_linear import PackedLinear, prepack_linears
from fastspec.models.assemble import PREPACK_BS
from fastspec.spec_config import SpecParams
from fastspec.speculative.steps import draft_extend, draft_loop, target_forward


@dataclass(frozen=True)
class RoundCost:
    draft: float  # seconds of the draft loop
    verify: float
    extend: float

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.extend


def timed(fn, reps: int = 3, device: torch.device | None = None) -> float:
    """Median wall seconds of fn() after one warm-up call (on CUDA: each call synchronised)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class CostModel:
    """Measured, memoised costs for one engine (built with the largest shape it will be asked about)."""

    def __init__(self, engine, width: int, reps: int = 3):
        self.engine, self.width, self.reps = engine, width, reps
        engine.worker.grow_kv(width)  # a growing pool: slots 1..width, which every timed request reads, exist
        self.drafter = engine.drafter
        self._memo: dict = {}
        self._packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())

    def round(self, p: SpecParams, bs: int) -> RoundCost:
        return RoundCost(self._cost(self._draft, p.num_steps, p.topk, bs),
                         self._cost(self._verify, p.num_draft_tokens, bs), self._cost(self._extend, p.num_steps, bs))

    def plain(self, bs: int) -> float:
        """One plain decode step (bs rows through the target, as a 1-node verify)."""
        return self._cost(self._verify, 1, bs)

    def _cost(self, measure, *key) -> float:
        """Memoised: inputs are built and weights repacked only the first time a shape is asked for."""
        if (measure, *key) not in self._memo:
            self._memo[(measure, *key)] = measure(*key)
        return self._memo[(measure, *key)]

    def _verify(self, n: int, bs: int) -> float:
        e = self.engine
        x = self._prefix(bs) | {
            "input_ids": torch.randint(0, e.model.config.vocab_size, (bs * n,)),
            "positions": (self.width + torch.arange(n)).repeat(bs),
            "new_slots": self._free_slots(bs * n).view(bs, n),
            "tree_mask": torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n).contiguous()}
        if self._packed:
            prepack_linears(e.model, _engine_packs(bs, n))
        return self._time(partial(target_forward, e.model, e.pool, self._table(bs), e.feature), x, bs)

    def _draft(self, steps: int, topk: int, bs: int) -> float:
        d, c = self.drafter, self.drafter.model.config
        probs = torch.softmax(torch.randn(bs, topk), -1).sort(-1, descending=True).values
        x = {"topk_p": probs, "topk_index": torch.randint(0, c.vocab_size, (bs, topk)),
             "hidden": torch.randn(bs, c.hidden_size, dtype=next(d.model.parameters()).dtype),
             "rows": torch.arange(bs), "seq_lens": torch.full((bs,), self.width),
             "verified_id": torch.randint(0, c.vocab_size, (bs,)),
             "scratch": self._free_slots(bs * topk * steps).view(-1, steps)} | self._sink(bs)
        n = min(1 + topk + (steps - 1) * topk * topk, steps + 1 if topk == 1 else 2)
        if self._packed:
            prepack_linears(d.model, _engine_packs(bs, topk))
        return self._time(partial(draft_loop, d.model, d.hot_token_id, d.pool, self._table(bs), topk, steps, n), x, bs)

    def _extend(self, steps: int, bs: int) -> float:
        d, e = self.drafter, self.engine
        rows = steps + 1
        dtype = next(d.model.parameters()).dtype
        x = self._prefix(bs) | {
            "input_ids": torch.randint(0, e.model.config.vocab_size, (bs * rows,)),
            "positions": (self.width + torch.arange(rows)).repeat(bs),
            "features": torch.randn(bs * rows, e.worker.feature_width(), dtype=dtype),
            "extend_lens": torch.full((bs,), rows)} | self._sink(bs)
        table = self._table(bs, rows)  # the new rows' slots follow the prefix's in each request's table row
        return self._time(partial(draft_extend, d.model, d.hot_token_id, d.pool, table, d.extend_topk), x, bs)

    def _sink(self, bs: int) -> dict:
        """A STANDALONE draft's first-token key (the dummy slot: its cost is the same)."""
        return {"sink": torch.zeros(bs, dtype=torch.int64)} if self.drafter.sinks else {}

    def _time(self, fn, x: dict, bs: int) -> float:
        """Seconds per call of fn(x) on the engine's device: eagerly, or on CUDA as a captured graph's replay."""
        device = next(self.engine.model.parameters()).device
        x = {k: v.to(device) for k, v in x.items()}
        call = partial(fn, x)
        if device.type == "cuda":
            specs = [StaticInput(k, tuple(v.shape[1:]), v.dtype, v.shape[0] // bs) for k, v in x.items()]
            runner = GraphRunner("cost", fn, specs, [bs], "cuda", device, fuse=False)
            runner.prepare()
            call = partial(runner.run, bs, x)
        with torch.inference_mode():
            return timed(call, self.reps, device)

    def _prefix(self, bs: int) -> dict:
        return {"rows": torch.arange(bs), "prefix_lens": torch.full((bs,), self.width)}

    def _table(self, bs: int, extra: int = 0) -> torch.Tensor:
        """A request->slot table (int32 [bs, width + extra]): every request reads slots 1..width as its committed
        KV (only read: whatever they hold), then `extra` free slots of its own, where the timed function writes."""
        device = next(self.engine.model.parameters()).device
        prefix = torch.arange(1, self.width + 1, device=device).expand(bs, self.width)
        writes = self._free_slots(bs * extra).to(device).view(bs, extra)
        return torch.cat([prefix, writes], 1).to(torch.int32).contiguous()

    def _free_slots(self, n: int) -> torch.Tensor:
        """n slots the allocator has free (taken and handed straight back, as the drafter's scratch): writing
        their KV disturbs no request and nothing the prefix cache holds."""
        allocator = self.engine.worker.allocator
        whole_pages = -(-n // allocator.page_size) * allocator.page_size
        self.engine.worker.grow_kv(whole_pages)
        state = allocator.backup_state()
        slots = allocator.alloc(whole_pages) if n else torch.zeros(0, dtype=torch.int64)
        allocator.restore_state(state)
        if slots is None:
            raise FastspecError(f"tune: the KV pool has no {n} free slots to time a round in")
        return slots[:n].cpu()


def _engine_packs(bs: int, rows_per_request: int) -> tuple[int, ...]:
    """The row counts the engine packs for this batch size (drafters.pack_round_rows): only PREPACK_BS are
    packed, so a larger batch is timed over plain linears as it will run (timing it packed overrated bs 8 by 1.5x)."""
    return (bs * rows_per_request,) if bs in PREPACK_BS else ()
