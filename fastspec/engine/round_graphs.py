"""The target's step graphs the decode rounds run through: a verify graph set per tree shape and the plain decode
graphs (a one-node verify through the same function), with the plan they and the drafters' graphs share (mode,
buckets, when a bucket is prepared). The worker builds them at start and for each new tree-shape schedule; the
rounds (spec_rounds, plain_rounds) call them. Does not own the drafters' graphs, nor what a round does around them.
"""

from __future__ import annotations

from functools import partial

from fastspec.config import EngineConfig
from fastspec.engine.target import Target
from fastspec.graphs.step_graphs import GraphPlan, StepGraphs
from fastspec.memory.req_table import ReqToTokenTable
from fastspec.spec_config import SpecParams
from fastspec.speculative.packing import verify_specs
from fastspec.speculative.steps import target_forward
from fastspec.utils.metrics import PhaseTimes


def graph_plan(config: EngineConfig, on_prepare) -> GraphPlan:
    """Explicit buckets (--cuda-graph-bs) are prepared ahead; otherwise each on the first batch that needs it."""
    return GraphPlan(config.graph_mode, tuple(config.graph_buckets), config.device, ahead=bool(config.cuda_graph_bs),
                     on_prepare=on_prepare)


def verify_graphs(target: Target, table: ReqToTokenTable, shapes: list[SpecParams], plan: GraphPlan,
                  times: PhaseTimes) -> dict[int, StepGraphs]:
    """num_draft_tokens -> the verify graphs of each tree shape in `shapes` (named by it when there are several).
    Their outputs are read within the round (logits kept for logprobs are copied by the round)."""
    hybrid = target.states is not None
    return {p.num_draft_tokens: StepGraphs(
        "verify" if len(shapes) < 2 else f"verify N={p.num_draft_tokens}",
        partial(target_forward, target.model, target.pool, table.table, target.feature, states=target.states,
                accept=True),
        verify_specs(p.num_draft_tokens, hybrid, table.pad_row, tree=True), plan, times, "verify", persist=())
        for p in shapes}


def decode_graphs(target: Target, table: ReqToTokenTable, plan: GraphPlan, times: PhaseTimes) -> StepGraphs | None:
    """Plain decode rounds through the same function as a one-node verify: captured too (not for hybrid targets,
    whose plain rounds advance their recurrent states in place); on CPU eagerly too (the fused layers' dense plan
    of its paged one is one C call: fewer host ops than a decode's metadata and its plan). None: run eagerly."""
    if target.states is not None or (plan.mode == "eager" and plan.device != "cpu"):
        return None
    return StepGraphs("decode", partial(target_forward, target.model, target.pool, table.table, target.feature),
                      verify_specs(1, False, table.pad_row), plan, times, "decode", persist=())
