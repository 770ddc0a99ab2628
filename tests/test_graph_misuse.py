"""GraphRunner refusing what cannot be a graph: a function with a host sync or a data-dependent shape fails
`prepare` naming its graph and bucket (or, as a user's run does, falls back to its eager kernels after a warning),
and a malformed runner or run is a one-line FastspecError. (test_graphs.py: the toy function these tests share.)"""

import pytest
import torch
from test_graphs import INPUTS, SLOTS, D, make_inputs, make_toy

from fastspec.errors import FastspecError
from fastspec.graphs import GraphRunner, StaticInput


def branch_on_item(inp):
    if inp["x"].sum().item() > 0:
        return {"y": inp["x"] + 1}
    return {"y": inp["x"] - 1}


def scale_by_tolist(inp):
    first = inp["slots"].tolist()[0]  # int .tolist(): traced by dynamo without a graph break, still a host sync
    return {"y": inp["x"] * first}


def select_nonzero(inp):
    return {"y": inp["x"][inp["x"] > 0]}  # data-dependent output shape


@pytest.mark.parametrize("fn", [branch_on_item, scale_by_tolist, select_nonzero])
def test_host_sync_fails_prepare_naming_graph_and_bucket(fn):
    inputs = [StaticInput("x", (3,), torch.float32, pad_value=1.0), StaticInput("slots", (), torch.int64)]
    runner = GraphRunner(fn.__name__, fn, inputs, [1, 2], "compile")
    with pytest.raises(FastspecError, match=rf"graph '{fn.__name__}' for batch bucket 2: \w+"):
        runner.prepare()
    eager = GraphRunner(fn.__name__, fn, inputs, [1, 2], "eager")  # the same function runs fine eagerly
    assert eager.run(1, {"x": torch.ones(1, 3), "slots": torch.ones(1, dtype=torch.int64)})["y"].numel() >= 1


@pytest.mark.parametrize("setting", ["0", "1", None])
def test_graph_fallback_setting_decides_whether_a_failed_compile_raises(setting, monkeypatch, caplog):
    """FASTSPEC_GRAPH_FALLBACK=0 (the suite's setting): a bucket that cannot compile fails `prepare`; 1 or unset
    (a user's run): it runs its eager kernels after one warning line."""
    if setting is None:
        monkeypatch.delenv("FASTSPEC_GRAPH_FALLBACK", raising=False)
    else:
        monkeypatch.setenv("FASTSPEC_GRAPH_FALLBACK", setting)
    inputs = [StaticInput("x", (3,), torch.float32, pad_value=1.0), StaticInput("slots", (), torch.int64)]
    runner = GraphRunner("branchy", branch_on_item, inputs, [1], "compile")  # a host sync: fullgraph refuses it
    if setting == "0":
        with pytest.raises(FastspecError, match="cannot compile graph 'branchy' for batch bucket 1"):
            runner.prepare()
        return
    with caplog.at_level("WARNING", logger="fastspec.graphs.runner"):
        runner.prepare()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["graph 'branchy', batch bucket 1"]
    x = torch.tensor([[-2.0, 0.5, 0.5]])
    assert torch.equal(runner.run(1, {"x": x, "slots": torch.zeros(1, dtype=torch.int64)})["y"], x - 1)


def test_constructor_and_unprepared_errors():
    with pytest.raises(FastspecError, match="unknown graph backend"):
        GraphRunner("g", make_toy(None), INPUTS, [1], "tensorrt")
    with pytest.raises(FastspecError, match="buckets"):
        GraphRunner("g", make_toy(None), INPUTS, [], "eager")
    with pytest.raises(FastspecError, match="unique"):
        GraphRunner("g", make_toy(None), INPUTS + INPUTS[:1], [1], "eager")
    if not torch.cuda.is_available():
        with pytest.raises(FastspecError, match="needs a CUDA device"):
            GraphRunner("g", make_toy(None), INPUTS, [1], "cuda")
    lazy = GraphRunner("g", make_toy(torch.zeros(SLOTS, D)), INPUTS, [1], "compile")
    with pytest.raises(FastspecError, match="not prepared"):
        lazy.run(1, make_inputs(1, 0))
