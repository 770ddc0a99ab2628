"""The worker: owns the target model, its static KV pool, the allocator, the request->slot table, the drafters, the
verify graphs and the measured fallback policy, and runs one `step` at a time on the requests it is given: a
prefill chunk, or a decode round, speculative (draft -> verify -> accept -> commit, then the draft extend) or plain.

A step returns what each request produced, up to a stop token or `max_new_tokens` (the rest of an accepted run
is dropped), as a frozen StepResult; the engine hands it to the caller and `release`s a finished request. The
worker reads and writes only its own fields of a request (row, seq_len, produced, done), so with the overlap
schedule a step can run in a thread one step ahead of the engine, and a speculative round can be launched before
the one in flight is finished (fastspec.overlap, a mixin). The decode rounds live in fastspec.rounds (a mixin);
its `_commit_on_device` / `_finish_round` and `_commit` here are the only places where request lengths, produced
tokens and KV slots advance.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import torch

from fastspec.attention import AttentionContext, extend_metadata, make_backend
from fastspec.config import EngineConfig, SpecConfig, SpecParams
from fastspec.controls import active as controls_active
from fastspec.controls import apply_controls
from fastspec.errors import FastspecError
from fastspec.grammar import mask_logits, verify_paths
from fastspec.graphs import StaticInput
from fastspec.logprobs import TokenLogprob, token_logprobs
from fastspec.memory.setup import build_memory
from fastspec.memory.state_checkpoints import prefill_budget, save_crossed
from fastspec.metrics import PhaseTimes
from fastspec.models.loader import generation_eos_ids, read_config, resolve_model_dir
from fastspec.models.mla import mla_softmax_scale
from fastspec.overlap import OverlapRounds
from fastspec.rounds import DecodeRounds
from fastspec.sampling import SamplingTensors, sample
from fastspec.scheduler import Request
from fastspec.speculative.batch import ExtendBatch
from fastspec.speculative.drafters import build_drafter, draft_kv_shape, load_models, pack_round_rows
from fastspec.speculative.future import FutureMaps, PendingRound
from fastspec.speculative.packing import prefix_specs
from fastspec.speculative.policy import SpecPolicy
from fastspec.speculative.runners import GraphPlan, StepGraphs
from fastspec.speculative.steps import target_verify
from fastspec.speculative.tree import DraftTree
from fastspec.transfer import to_device


@dataclass(frozen=True)
class StepResult:
    reqs: tuple[Request, ...]  # the requests the step ran (those already done are skipped)
    tokens: tuple[tuple[int, ...], ...]  # per request, what it produced, up to a stop
    finish: tuple[str | None, ...]  # per request, "stop" | "length" once this step finished it
    accepted: tuple[int, ...] | None  # speculative rounds: accepted draft tokens per request (before a stop)
    free_kv: int  # free KV slots after the step
    logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()  # per request asking for them, aligned with tokens


class Worker(OverlapRounds, DecodeRounds):
    def __init__(self, config: EngineConfig, spec: SpecConfig | None = None, on_prepare=None):
        """on_prepare(graph_name, bucket) is called before each graph bucket is captured / compiled."""
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        model_config = read_config(self.model_dir)
        self.spec = spec or SpecConfig()
        self.max_context_len = config.max_context_len or model_config.max_position_embeddings
        self.times = PhaseTimes()  # benchmarks set sync_cuda for a phase split on a GPU (a sync per phase costs)
        models = load_models(self.model_dir, self.spec, config)
        self.model, self.feature = models.target, models.feature
        self.eos_ids = generation_eos_ids(self.model_dir, model_config.eos_token_ids)
        self._init_memory(draft_kv_shape(models.draft))
        self.policy = SpecPolicy() if config.speculative_fallback and self.spec.enabled else None
        self._draft_model, self._reserved = models.draft, self.spec.params
        self.futures = FutureMaps(self.table.max_requests, config.device)
        self._pending: PendingRound | None = None  # the round launched ahead, not finished yet (overlap)
        self._release_after: list[Request] = []  # released while in the pending round
        self._finished_at = 0.0  # perf_counter when the last round launched ahead was finished
        self._build_rounds(on_prepare)

    def _build_rounds(self, on_prepare) -> None:
        """One drafter and one verify graph set per tree shape (several with a batch-size schedule)."""
        config = self.config
        # explicit buckets (--cuda-graph-bs) are prepared ahead; otherwise each on the first batch that needs it
        plan = GraphPlan(config.graph_mode, tuple(config.graph_buckets), config.device,
                         ahead=bool(config.cuda_graph_bs), on_prepare=on_prepare)
        self.drafters = build_drafter(self.spec, self._draft_model, self.draft_pool, self.table, self.allocator,
                                      self.feature_width(), plan, self.times)
        self.drafter = next(iter(self.drafters.values()), None)  # any of them extends and releases
        hybrid = self.states is not None
        self.verify_graphs = {p.num_draft_tokens: StepGraphs(
            "verify" if len(self.drafters) < 2 else f"verify N={p.num_draft_tokens}",
            partial(target_verify, self.model, self.pool, self.feature, states=self.states),
            partial(verify_specs, p.num_draft_tokens, hybrid), plan, self.times, "verify") for p in self.drafters}
        # plain decode rounds through the same function as a one-node verify: captured too (not for hybrid targets,
        # whose plain rounds advance their recurrent states in place)
        self.decode_graphs = None if hybrid or plan.mode == "eager" else StepGraphs(
            "decode", partial(target_verify, self.model, self.pool, self.feature),
            partial(verify_specs, 1, False), plan, self.times, "decode")

    def use_schedule(self, schedule, on_prepare=None) -> None:
        """Switch to per-batch-size tree shapes between streams (`fastspec tune` tries candidates this way).
        Each shape must fit the KV headroom reserved at start: no more steps, topk or draft tokens."""
        spec = self.spec.with_schedule(schedule)
        r = self._reserved
        if spec.num_steps > r.num_steps or spec.topk > r.topk or spec.num_draft_tokens > r.num_draft_tokens:
            raise FastspecError(f"schedule needs up to {spec.params}, the engine reserved {r}")
        self.spec = spec
        pack_round_rows(self.model, self._draft_model, spec, self.config)
        self._build_rounds(on_prepare)

    def _init_memory(self, draft_shape) -> None:
        c, cfg = self.model.config, self.config
        m = build_memory(c, draft_shape, cfg, self.spec, self.max_context_len)
        self.pool, self.draft_pool, self.allocator, self.table = m.pool, m.draft_pool, m.allocator, m.table
        self.states, self.cache = m.states, m.cache
        self.track = self.cache is not None and self.states is not None  # save states every interval tokens
        _, heads, dim, _ = c.kv_layout
        mla = {} if c.mla is None else dict(kv_lora_rank=c.mla.kv_lora_rank, sm_scale=mla_softmax_scale(c))
        self.backend = make_backend(cfg.attention_backend, num_qo_heads=c.num_heads, num_kv_heads=heads,
                                    head_dim=dim, dtype=cfg.torch_dtype, device=cfg.device, **mla)

    def check_kv(self, running: list[Request] = ()) -> None:
        """Leak check: free slots + slots held by `running` (past their cached prefix) + slots the prefix cache
        holds == capacity (AssertionError otherwise)."""
        held = [self.table.slots(r.row, r.cached_len, r.seq_len) for r in running]
        if self.cache is not None:
            held.append(self.cache.check(running))
        self.allocator.check(torch.cat(held) if held else torch.zeros(0, dtype=torch.int64))

    def available_kv(self) -> int:
        """Free KV slots, counting what the prefix cache would give back (its unlocked entries)."""
        return self.allocator.num_free() + (self.cache.evictable if self.cache is not None else 0)

    def flush_cache(self) -> None:
        """Hand every unlocked prefix-cache entry back to the allocator."""
        if self.cache is not None:
            self.cache.flush()

    @property
    def reused_tokens(self) -> int:
        return self.cache.reused_tokens if self.cache is not None else 0

    def _make_room(self, num_tokens: int) -> None:
        """Evict from the prefix cache until `num_tokens` slots are free (the engine checked they can be), so
        nothing inside a step (drafting's scratch, verify, commit) ever needs to evict."""
        if self.cache is not None:
            self.cache.make_room(num_tokens)

    def feature_width(self) -> int:
        c = self.model.config
        return c.hidden_size * (len(self.model.capture_layers) if self.feature == "aux" else 1)

    def round_headroom(self) -> int:
        """KV one decode round may add per request: a token (its page), or verify slots plus draft scratch."""
        page = self.config.page_size
        if not self.spec.enabled:
            return page
        scratch = -(-self.spec.topk * self.spec.num_steps // page) * page if self.drafter.uses_scratch else 0
        return self.spec.num_draft_tokens + page + scratch

    def step(self, reqs: list[Request], prefill: bool) -> StepResult | Future:
        """A prefill chunk or a decode round over the requests of `reqs` not already done.

        Under the overlap schedule a decode round that needs nothing from the host is returned as a Future of its
        StepResult: a speculative round is launched before the round in flight is finished, and its Future set
        when a later step (or `flush`) finishes it. Anything else finishes the round in flight first and
        returns its own result."""
        with torch.inference_mode():
            if not prefill and self.config.overlap and self._may_launch_ahead(reqs):
                return self._step_ahead([r for r in reqs if r.done is None])
            self.flush()
            return self._step_now(reqs, prefill)

    def _step_now(self, reqs: list[Request], prefill: bool, params: SpecParams | None | str = "policy") -> StepResult:
        """Run the step to its end; a decode round speculates with `params` (None: plain; "policy": ask it)."""
        reqs = [r for r in reqs if r.done is None]
        self._logprobs = {}  # rid -> the target's logprobs of what it produced (filled by the rounds)
        accepted = None
        if not reqs:
            tokens = []
        elif prefill:
            with self.times("prefill"):
                tokens = self.prefill(reqs)
        else:
            self._make_room(self.round_headroom() * len(reqs))
            tokens, accepted = self._decode(reqs, self._round_params(reqs) if params == "policy" else params)
        return self._result(reqs, tokens, accepted)

    def _result(self, reqs: list[Request], tokens: list[list[int]], accepted: list[int] | None,
                reserved: int = 0) -> StepResult:
        """`reserved`: KV a round launched since took; counted as free (the engine plans from the KV free
        before the round in flight)."""
        return StepResult(tuple(reqs), tuple(map(tuple, tokens)), tuple(r.done for r in reqs),
                          None if accepted is None else tuple(accepted), self.available_kv() + reserved,
                          tuple(self._logprobs.get(r.rid) for r in reqs))

    # ---- prefill ----------------------------------------------------------------------------------------

    def prefill(self, reqs: list[Request]) -> list[list[int]]:
        """One chunked-prefill step: up to chunked_prefill_size prompt tokens, taken request by request.

        A request whose prompt completes here samples its first token; the draft extend of a non-final chunk
        ends with the next prompt token instead (draft position p pairs t_{p+1} with h_p)."""
        chunks, budget = [], self.config.chunked_prefill_size
        for r in reqs:
            if budget <= 0:
                break
            if r.row < 0:
                r.row = self.table.alloc()
                if self.cache is not None:
                    self.cache.reuse(r, shifted=self.drafter is not None and self.drafter.uses_extend)
            take = min(budget, prefill_budget(r.seq_len, self.config.mamba_track_interval)) if self.track else budget
            chunks.append(r.prefill_ids[r.seq_len: r.seq_len + take])
            budget -= len(chunks[-1])
        skipped, reqs = len(reqs) - len(chunks), reqs[: len(chunks)]
        lens = [len(c) for c in chunks]
        page = self.config.page_size
        self._make_room(sum(-(-n // page) * page + page for n in lens))
        complete = [r.seq_len + n == len(r.prefill_ids) for r, n in zip(reqs, lens)]
        ids = to_device([t for c in chunks for t in c], self.config.device)
        rows, prefix, ext, positions = self._extend_slots(reqs, lens)
        if self.states is not None:  # a sequence's first chunk starts from zero states
            self.states.reset(rows[prefix == 0])
        hidden = self._forward(ids, positions, extend_metadata(self.table.table, rows, prefix, ext), rows, lens)
        last = torch.cumsum(ext, 0) - 1
        finals = [b for b, c in enumerate(complete) if c and not reqs[b].produced]  # recomputes know their token
        first_logits = self.model.compute_logits(hidden.final[last[finals]])
        first = self._sample([reqs[b] for b in finals], self._controlled([reqs[b] for b in finals], first_logits))
        tails = [r.history[r.seq_len + n] if r.seq_len + n < len(r.history) else None for r, n in zip(reqs, lens)]
        for b, token in zip(finals, first):
            tails[b] = token
        if self.drafter is not None and self.drafter.uses_extend:
            shifted = torch.roll(ids, -1)  # t_{p+1} at position p; each chunk's tail: see the docstring
            shifted[last] = to_device(tails, ids.device)
            self.drafter.extend(ExtendBatch(tuple(r.rid for r in reqs), rows, prefix, ext, shifted, positions,
                                            self._features(hidden), max(r.seq_len for r in reqs), max(lens)),
                                decode_round=False)
        produced = self._commit(reqs, lens, [[tails[b]] if b in finals else [] for b in range(len(reqs))])
        self._record_logprobs(reqs, first_logits, [[finals.index(b)] if b in finals else [] for b in range(len(reqs))],
                              produced)
        self._save_states(reqs, lens)
        return produced + [[]] * skipped  # the requests this chunk had no budget left for

    def _save_states(self, reqs: list[Request], fed: list[int]) -> None:
        """Prefill chunks and plain rounds end on at most one interval boundary: save the row's state there."""
        if self.track:
            for r, n in zip(reqs, fed):
                save_crossed(self.states, r, r.seq_len - n, None, self.config.mamba_track_interval)

    def _commit(self, reqs: list[Request], fed: list[int], tokens: list[list[int]]) -> list[list[int]]:
        """Plain rounds and prefill: `fed[b]` tokens entered the KV, `tokens[b]` were produced."""
        for r, n in zip(reqs, fed):
            r.seq_len += n
        return [self._produce(r, new) for r, new in zip(reqs, tokens)]

    def _controlled(self, reqs: list[Request], logits: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """The logits after each request's penalties / bias / min_p (fastspec.controls) and grammar mask
        (fastspec.grammar), at every position: a verify node with the draft tokens on its path as output."""
        if any(controls_active(r.params) for r in reqs):
            logits = apply_controls(logits, reqs, *(() if tree is None else (tree.tree_mask, tree.draft_tokens)))
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            logits = mask_logits(logits, grammars, verify_paths(tree) if tree is not None else [[[]]] * len(reqs))
        return logits

    def _record_logprobs(self, reqs: list[Request], logits: torch.Tensor, rows: list[list[int]],
                         produced: list[list[int]]) -> None:
        """The target's logprobs of what each request asking for them produced; rows[b][j]: the logits row that
        produced its j-th token."""
        for b, r in enumerate(reqs):
            if r.params.logprobs is not None and produced[b]:
                picked = logits[to_device(rows[b][: len(produced[b])], logits.device)]
                self._logprobs[r.rid] = token_logprobs(picked, produced[b], r.params.logprobs)

    def _produce(self, r: Request, run: list[int]) -> list[int]:
        """Append tokens until a stop condition (the request is done then); returns what was kept."""
        kept = []
        for token in run:
            r.produced.append(token)
            if r.grammar is not None:
                r.grammar.advance(token)
            kept.append(token)
            r.done = self._finish_reason(r, token)
            if r.done:
                break
        return kept

    def _finish_reason(self, r: Request, token: int) -> str | None:
        if token in r.params.stop_token_ids or (token in self.eos_ids and not r.params.ignore_eos):
            return "stop"
        if len(r.produced) >= r.params.max_new_tokens:
            return "length"
        return None

    def release(self, r: Request) -> None:
        """Hand back a request's KV slots, table row and draft state (nothing if it holds none). With the prefix
        cache, the KV of its tokens goes into the cache instead (whole pages; what the cache already holds
        and what lies past the last token are freed)."""
        if r.row < 0:
            return
        if self._pending is not None and r in self._pending.reqs:
            self._release_after.append(r)  # after the round in flight has finished with its KV
            return
        with torch.inference_mode():
            slots = self.table.slots(r.row, 0, r.seq_len)
            if self.cache is None:
                self.allocator.free(slots)
            else:
                self.cache.take(r, slots)
            self.table.free(r.row)
            if self.drafter is not None:
                self.drafter.release(r.rid)
        r.row, r.seq_len = -1, 0  # it holds no KV now (a preempted request prefills its history again)

    # ---- shared helpers ---------------------------------------------------------------------------------

    def _extend_slots(self, reqs: list[Request], lens: list[int]):
        """Allocate slots for lens[b] new tokens of each request; (rows, prefix, ext, positions)."""
        device = self.config.device
        rows = to_device([r.row for r in reqs], device)
        prefix = to_device([r.seq_len for r in reqs], device)
        ext = to_device(lens, device)
        starts = [r.seq_len for r in reqs]
        self._alloc_slots(rows, prefix, prefix + ext, (starts, [s + n for s, n in zip(starts, lens)]))
        positions = to_device([p for s, n in zip(starts, lens) for p in range(s, s + n)], device)
        return rows, prefix, ext, positions

    def _alloc_slots(self, rows: torch.Tensor, prefix: torch.Tensor, seq_lens: torch.Tensor,
                     host_lens: tuple[list[int], list[int]]) -> None:
        """Slots for positions prefix..seq_lens-1 of each row into the table; `host_lens` = the same two lengths
        on the host (so the allocator reads nothing back from the device)."""
        slots = self.allocator.alloc_extend(prefix, seq_lens, self._last_loc(rows, prefix), host_lens)
        if slots is None:
            raise FastspecError("KV pool exhausted")  # unreachable: a round's headroom is checked before it runs
        self.table.write(rows, prefix, seq_lens - prefix, slots)

    def _last_loc(self, rows: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """int64 [bs]: the slot of each row's position prefix-1 (-1 for an empty prefix)."""
        return torch.where(prefix > 0, self.table.table[rows, (prefix - 1).clamp(min=0)].long(), -1)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta, rows: torch.Tensor, lens: list[int]):
        states = None if self.states is None else self.states.view(rows, lens=tuple(lens))
        return self.model(ids, positions, AttentionContext.build(self.backend, meta, self.pool, states))

    def _features(self, hidden) -> torch.Tensor:
        return hidden.aux if self.feature == "aux" else hidden.final

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        return sample(logits, sampling, [r.generator for r in reqs]).tolist()


def verify_specs(n: int, hybrid: bool, width: int) -> list[StaticInput]:
    """The verify graph's static inputs for trees of n tokens over a committed-KV width (a module function: a
    bound method here would make a reference cycle that keeps a dropped engine's weights alive until gc runs).
    A hybrid target's verify also takes each request's state row (padded rows: the dummy row 0)."""
    return [StaticInput("input_ids", (), torch.int64, n), StaticInput("positions", (), torch.int64, n),
            StaticInput("new_slots", (n,), torch.int64), StaticInput("tree_mask", (n, n), torch.bool),
            *prefix_specs(width), *([StaticInput("state_rows", (), torch.int64)] if hybrid else [])]
