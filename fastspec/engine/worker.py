"""The worker: owns the target model, its KV pool (grown when the engine asks, between steps), the allocator, the
request->slot table, the drafters, the verify graphs and the measured fallback policy, and runs one `step` at a time
on the requests it is given: a prefill chunk, or a decode round, speculative (draft -> verify -> accept -> commit,
then the draft extend) or plain.

It is composed of objects that are handed what they read and return what they produce: Prefill, PlainRounds and
SpecRounds (each returns a RoundOutput) over a Target, BatchSlots and a Producer, and the OverlapSchedule, which
launches a speculative round before the one in flight is finished. A step returns what each request produced, up
to a stop token or `max_new_tokens` (the rest of an accepted run is dropped), as a frozen StepResult; the engine
hands it to the caller and `release`s a finished request. The worker reads and writes only its own fields of a
request (row, seq_len, produced, done), so with the overlap schedule a step can run in a thread one step ahead of
the engine.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

import torch

from fastspec.config import EngineConfig
from fastspec.engine.overlap import OverlapSchedule
from fastspec.engine.plain_rounds import PlainRounds
from fastspec.engine.pools import build_memory
from fastspec.engine.prefill import Prefill
from fastspec.engine.produce import Producer, RoundOutput, StepResult
from fastspec.engine.round_graphs import decode_graphs, graph_plan, verify_graphs
from fastspec.engine.scheduler import Request
from fastspec.engine.slots import BatchSlots
from fastspec.engine.spec_rounds import SpecRounds
from fastspec.engine.target import Target, make_target_backend
from fastspec.errors import FastspecError
from fastspec.graphs.step_graphs import GraphPlan
from fastspec.models.assemble import load_models, pack_round_rows
from fastspec.models.sources import ModelSources, resolve_sources
from fastspec.models.weights_fit import check_weights_fit, resolve_model_dtype
from fastspec.spec_config import SpecConfig, SpecParams
from fastspec.speculative.backlog import DraftBacklog
from fastspec.speculative.drafter import Drafter, build_drafters
from fastspec.speculative.future import FutureMaps
from fastspec.speculative.policy import SpecPolicy, mean_length, record_round
from fastspec.utils.metrics import PhaseTimes


class Worker:
    def __init__(self, config: EngineConfig, spec: SpecConfig | None = None, on_prepare=None,
                 sources: ModelSources | None = None):
        """on_prepare(graph_name, bucket) is called before each graph bucket is captured / compiled. `sources`:
        the models as start-up resolved them (default: resolved here from config.model and spec.draft_model)."""
        self.spec = spec = spec or SpecConfig()
        self.sources = sources = sources or resolve_sources(
            config.model, spec.algorithm, spec.draft_model, quantization=config.quantization, device=config.device,
            load_format=config.load_format)
        self.model_dir, self.eos_ids = sources.model_dir, sources.eos_ids
        self.config = config = dataclasses.replace(config, quantization=sources.quantization, dtype=resolve_model_dtype(
            config.dtype, config.device, sources))
        self.max_context_len = sources.config.context_len(config.max_context_len)
        if config.load_format != "dummy":
            check_weights_fit(sources, config.dtype, config.device)
        self.times = PhaseTimes()  # benchmarks set sync_cuda for a phase split on a GPU (a sync per phase costs)
        models = load_models(sources, spec, config)
        self.model, self.feature = models.target, models.feature
        m = build_memory(self.model.config, models.draft_kv_shape, config, spec, self.max_context_len,
                         models.kv_scales)
        self.memory = m
        self.pool, self.draft_pool, self.allocator, self.table = m.pool, m.draft_pool, m.allocator, m.table
        self.states, self.cache = m.states, m.cache
        self.target = Target(self.model, self.pool, make_target_backend(self.model.config, config), self.states,
                             self.feature)
        self.slots = BatchSlots(self.allocator, self.table, self.cache, config.device)
        track = self.cache is not None and self.states is not None  # save states every interval tokens
        self.producer = Producer(self.eos_ids, self.states, config.mamba_track_interval if track else None,
                                 self.cache.reclaim_state if track else None)
        self.policy = SpecPolicy() if config.speculative_fallback and self.spec.enabled else None
        self.draft_model, self._reserved = models.draft, self.spec.params
        self.futures = FutureMaps(self.table.max_requests, config.device)
        self.backlog = DraftBacklog(config.chunked_prefill_size)  # rows prefill / plain rounds left the draft
        self._release_after: list[Request] = []  # released while in the round in flight (overlap)
        self._plan = graph_plan(self.config, on_prepare)
        self._build_rounds(self._drafters(self._plan))

    def _drafters(self, plan: GraphPlan) -> dict[SpecParams, Drafter]:
        """SpecParams -> drafter: one per tree shape (several with a batch-size schedule)."""
        return build_drafters(self.spec, self.draft_model, self.draft_pool, self.table, self.allocator,
                              self.target.feature_width, plan, self.times)

    def _build_rounds(self, drafters: dict[SpecParams, Drafter]) -> None:
        """The rounds over `drafters`, with one verify graph set per tree shape."""
        self.verify_graphs = verify_graphs(self.target, self.table, list(drafters), self._plan, self.times)
        self.decode_graphs = decode_graphs(self.target, self.table, self._plan, self.times)
        self.use_drafters(drafters)

    def use_drafters(self, drafters: dict[SpecParams, Drafter]) -> None:
        """Draft with `drafters` (SpecParams -> drafter; tests: an oracle) from now on, between streams."""
        self.drafters = drafters
        self.drafter = next(iter(drafters.values()), None)  # any of them extends and releases
        self._compose()

    def use_policy(self, policy: SpecPolicy | None) -> None:
        """Choose plain or speculative rounds by `policy` from now on, between streams (tests: a scripted one)."""
        self.policy = policy
        self._compose()

    def _compose(self) -> None:
        """Prefill, the plain and speculative rounds and the overlap schedule over what the worker holds now."""
        assert self._release_after == [], "composed again while a round was in flight"
        extends = self.drafter is not None and self.drafter.uses_extend
        self.prefill = Prefill(self.target, self.slots, self.producer, self.backlog if extends else None,
                               self.config)
        self.plain_rounds = PlainRounds(self.target, self.slots, self.producer, self.decode_graphs,
                                        self.backlog if extends else None)
        self.spec_rounds = SpecRounds(self.target, self.slots, self.producer, self.drafters, self.verify_graphs,
                                      self.futures, self.spec, self.config.page_size)
        ahead = self.drafter is not None and self.drafter.uses_extend and self.states is None
        self.overlap = OverlapSchedule(self.spec_rounds, ahead, self.policy, self.times, self.slots.available)

    def use_schedule(self, schedule, on_prepare=None) -> None:
        """Switch to per-batch-size tree shapes between streams (`fastspec tune` tries candidates this way).
        Each shape must fit the KV headroom reserved at start: no more steps, topk or draft tokens."""
        spec = self.spec.with_schedule(schedule)
        r = self._reserved
        if spec.num_steps > r.num_steps or spec.topk > r.topk or spec.num_draft_tokens > r.num_draft_tokens:
            raise FastspecError(f"schedule needs up to {spec.params}, the engine reserved {r}")
        self.spec = spec
        pack_round_rows(self.model, self.draft_model, spec, self.config)
        self._plan = graph_plan(self.config, on_prepare)
        self._build_rounds(self._drafters(self._plan))

    def check_kv(self, running: list[Request] = ()) -> None:
        """Leak check: free slots + slots held by `running` (past their cached prefix) + slots the prefix cache
        holds == capacity (AssertionError otherwise), with no round in flight (the one launched ahead is finished)."""
        self.flush()
        held = [self.table.slots(r.row, r.cached_len, r.seq_len) for r in running]
        if self.cache is not None:
            held.append(self.cache.check(running))
        self.allocator.check(torch.cat(held) if held else torch.zeros(0, dtype=torch.int64))

    def available_kv(self) -> int:
        """Free KV slots up to the pool's ceiling (what admission and preemption plan with): free now, what the
        prefix cache would give back (its unlocked entries) and the room the pool may still grow by."""
        return self.slots.available() + self.memory.room_to_grow

    def free_kv(self) -> int:
        """Free KV slots in the pool as it is now, counting what the prefix cache would give back."""
        return self.slots.available()

    def grow_kv(self, num_free: int) -> None:
        """Grow a growing pool until `num_free` slots are free (up to its ceiling); with nothing in flight."""
        assert self.overlap.pending is None, "the KV pool cannot grow under a round in flight"
        self.memory.grow(num_free)

    def flush_cache(self) -> None:
        """Hand every unlocked prefix-cache entry back to the allocator, with no round in flight (the one launched
        ahead is finished first, and hands the KV of the requests released meanwhile to the cache)."""
        self.flush()
        if self.cache is not None:
            self.cache.flush()

    @property
    def reused_tokens(self) -> int:
        return self.cache.reused_tokens if self.cache is not None else 0

    def feature_width(self) -> int:
        return self.target.feature_width

    def round_headroom(self) -> int:
        """KV one decode round may add per request: a token (its page), or verify slots plus draft scratch."""
        page = self.config.page_size
        if not self.spec.enabled:
            return page
        scratch = -(-self.spec.topk * self.spec.num_steps // page) * page if self.drafter.uses_scratch else 0
        return self.spec.num_draft_tokens + page + scratch

    # ---- steps ------------------------------------------------------------------------------------------

    def step(self, reqs: list[Request], prefill: bool) -> StepResult | Future:
        """A prefill chunk or a decode round over the requests of `reqs` not already done.

        Under the overlap schedule a decode round that needs nothing from the host is returned as a Future of its
        StepResult: a speculative round is launched before the round in flight is finished, and its Future set
        when a later step (or `flush`) finishes it. Anything else finishes the round in flight first and
        returns its own result."""
        with torch.inference_mode():
            if not prefill and self.config.overlap and self.overlap.may_launch_ahead(reqs):
                return self._step_ahead(self.overlap.runnable([r for r in reqs if r.done is None]))
            self.flush()
            return self._step_now(reqs, prefill)

    def _step_ahead(self, reqs: list[Request]) -> Future:
        """Launch a speculative round, then finish the one in flight. A plain round (the policy's choice) runs
        after the one in flight is finished, its Future already set."""
        params = self._round_params(reqs) if reqs else None
        if params is None:
            self.flush()
            done = Future()
            done.set_result(self._step_now(reqs, False, plain=True))
            return done
        self.slots.make_room(self.round_headroom() * len(reqs))
        if any(self.backlog.behind(r.rid) for r in reqs):  # after a prefill or plain round: none is in flight
            self.flush()
            with self.times("round", count=False):  # a phase of the round launched next, as in _decode
                self._catch_up(reqs)
        done = self.overlap.launch(reqs, params)
        self._release_finished()
        return done

    def flush(self) -> None:
        """Finish the round launched ahead, if any (its Future gets its StepResult)."""
        self.overlap.flush()
        self._release_finished()

    def _step_now(self, reqs: list[Request], prefill: bool, plain: bool = False) -> StepResult:
        """Run the step to its end; a decode round is plain with `plain`, else speculates as the policy says."""
        reqs = [r for r in reqs if r.done is None]
        if not reqs:
            out = RoundOutput([])
        elif prefill:
            with self.times("prefill"):
                out = self.prefill(reqs)
                self._bound_backlog(reqs)
        else:
            self.slots.make_room(self.round_headroom() * len(reqs))
            out = self._decode(reqs, None if plain else self._round_params(reqs))
        return StepResult.of(reqs, out, self.slots.available())

    def _round_params(self, reqs: list[Request]) -> SpecParams | None:
        """The next round's tree shape, or None for a plain round (no drafter, or the policy says it does not pay)."""
        params = self.spec.params_for(len(reqs)) if self.drafter is not None else None
        if params is None or self.policy is None:
            return params
        return params if self.policy.speculate(len(reqs), mean_length(reqs)) else None

    def _decode(self, reqs: list[Request], params: SpecParams | None) -> RoundOutput:
        """One decode round, launched and finished: speculative with `params`, else plain."""
        with self.times("round" if params is not None else "plain_round"):  # "round" = speculative rounds only
            if params is not None:
                self._catch_up(reqs)
            context = mean_length(reqs) if self.policy is not None else 0  # (before the round advances the lengths)
            start = time.perf_counter()
            out = self.spec_rounds.run(reqs, params) if params is not None else self.plain_rounds(reqs)
            if self.policy is not None:
                record_round(self.policy, params is not None, out.tokens, start, context)
            if params is None:
                self._bound_backlog(reqs)
        return out

    def _catch_up(self, reqs: list[Request]) -> None:
        """Before a speculative round the draft runs over what prefill and plain rounds left it (each token once),
        timed as the round's `catch_up` phase: neither its own draft extend nor host work (metrics.ROUND_PHASES)."""
        if any(self.backlog.behind(r.rid) for r in reqs):
            with self.times("catch_up"):
                self.backlog.catch_up(self.drafter, reqs, self.config.device)

    def _bound_backlog(self, reqs: list[Request]) -> None:
        """Requests whose draft backlog reached its bound catch up now (its memory stays bounded)."""
        if full := self.backlog.full(reqs):
            self.backlog.catch_up(self.drafter, full, self.config.device)

    def release(self, r: Request) -> None:
        """Hand back a request's KV slots, table row and draft state (nothing if it holds none); after the round
        in flight if it is in it. With the prefix cache, the KV of its tokens goes into the cache instead (whole
        pages; what the cache already holds and what lies past the last token are freed)."""
        if r.row < 0:
            return
        if self.overlap.in_flight(r):
            self._release_after.append(r)  # after the round in flight has finished with its KV
            return
        with torch.inference_mode():
            if self.cache is not None and self.backlog.behind(r.rid):  # the cache keeps draft KV: complete it
                self.backlog.catch_up(self.drafter, [r], self.config.device)
            self.backlog.drop(r.rid)
            slots = self.table.slots(r.row, 0, r.seq_len)
            if self.cache is None:
                self.allocator.free(slots)
            else:
                self.cache.take(r, slots)
            self.table.free(r.row)
            if self.drafter is not None:
                self.drafter.release(r.rid)
        r.row, r.seq_len = -1, 0  # it holds no KV now (a preempted request prefills its history again)

    def _release_finished(self) -> None:
        """Release the requests released while in a round that is finished now."""
        for r in [r for r in self._release_after if not self.overlap.in_flight(r)]:
            self._release_after.remove(r)
            self.release(r)

