"""GraphRunner's lazy buckets and widths: each bucket prepared on first use only, and runners sharing one compile
serve every committed-KV width and pool size with one graph (sizes that vary by closure)."""


import pytest
import torch

from test_graphs import D, SLOTS

from fastspec.errors import FastspecError
from fastspec.graphs import (GraphRunner, StaticInput)


def make_gather(pool):
    """Reads `slots` [bs, width] from the pool by closure: width is the dynamic dim (a committed-KV width).
    `pool` is a tensor or a dict holding one under "pool" (an engine's pool, replaced between runs)."""
    def gather(inp):
        pool_ = pool["pool"] if isinstance(pool, dict) else pool
        slots = inp["slots"]
        ctx = pool_.index_select(0, slots.flatten()).view(slots.shape[0], -1, D)  # [bs, width, D]
        return {"y": torch.tanh(ctx.mean(1) + inp["x"] + pool_.shape[0] * 0.0)}
    return gather


def gather_inputs(width: int) -> list[StaticInput]:
    return [StaticInput("x", (D,), torch.float32), StaticInput("slots", (width,), torch.int64, dynamic=True)]


def test_lazy_runner_prepares_each_bucket_on_first_use_only():
    from torch._dynamo.utils import counters

    pool, calls = torch.randn(SLOTS, D), []
    runner = GraphRunner("lazy", make_gather(pool), gather_inputs(8), [1, 2, 4], "compile", lazy=True,
                         on_bucket=lambda name, bs: calls.append(bs))
    before = counters["stats"]["unique_graphs"]
    for bs, seed in [(3, 0), (4, 1), (1, 2), (3, 3)]:  # 3 and 4 share bucket 4; bucket 2 is never needed
        gen = torch.Generator().manual_seed(seed)
        x = {"x": torch.randn(bs, D, generator=gen), "slots": torch.randint(1, SLOTS, (bs, 8), generator=gen)}
        torch.testing.assert_close(runner.run(bs, x)["y"], make_gather(pool)(x)["y"])
    assert calls == [4, 1]
    assert counters["stats"]["unique_graphs"] - before == 2
    assert [runner.prepared(bs) for bs in (1, 2, 3, 4)] == [True, False, True, True]


def test_runners_sharing_a_compile_serve_every_width_and_pool_size_with_one_graph():
    """Three KV widths and two pool capacities (a closure tensor marked `size_varies`) reuse one compiled graph."""
    from torch._dynamo.utils import counters

    from fastspec.graphs import size_varies

    holder, shared, calls = {}, {}, []
    fn, before = make_gather(holder), counters["stats"]["unique_graphs"]
    for width, slots in [(8, SLOTS), (16, SLOTS), (24, 2 * SLOTS)]:
        holder["pool"] = torch.randn(slots, D)
        size_varies(holder["pool"], 0)
        runner = GraphRunner(f"w{width}", fn, gather_inputs(width), [2], "compile", compiled=shared,
                             on_bucket=lambda name, bs: calls.append(name))
        runner.prepare()
        x = {"x": torch.randn(2, D), "slots": torch.randint(1, slots, (2, width))}
        torch.testing.assert_close(runner.run(2, x)["y"], make_gather(holder["pool"])(x)["y"])
    assert calls == ["w8"]  # the later runners found bucket 2 compiled: nothing to report
    assert counters["stats"]["unique_graphs"] - before == 1
    with pytest.raises(FastspecError, match="same function"):
        GraphRunner("other", make_gather(holder), gather_inputs(8), [2], "compile", compiled=shared)
