"""GraphRunner's lazy buckets and sizes: each bucket prepared on first use only; one graph serves every pool size
(a size that varies by closure) and, in the engine, every context length (no KV width in any graph)."""

import torch
from test_graphs import SLOTS, D

from fastspec.graphs import GraphRunner, StaticInput


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
    return [StaticInput("x", (D,), torch.float32), StaticInput("slots", (width,), torch.int64)]


def test_lazy_runner_prepares_each_bucket_on_first_use_only():
    from torch._dynamo.utils import counters

    pool, calls = torch.randn(SLOTS, D), []
    runner = GraphRunner("lazy", make_gather(pool), gather_inputs(8), [1, 2, 4], "compile",
                         on_bucket=lambda name, bs: calls.append(bs))
    before = counters["stats"]["unique_graphs"]
    for bs, seed in [(3, 0), (4, 1), (1, 2), (3, 3)]:  # 3 and 4 share bucket 4; bucket 2 is never needed
        gen = torch.Generator().manual_seed(seed)
        x = {"x": torch.randn(bs, D, generator=gen), "slots": torch.randint(1, SLOTS, (bs, 8), generator=gen)}
        runner.prepare(buckets=[bs])  # as StepGraphs does before each run: a no-op once prepared
        torch.testing.assert_close(runner.run(bs, x)["y"], make_gather(pool)(x)["y"])
    assert calls == [4, 1]
    assert counters["stats"]["unique_graphs"] - before == 2
    assert [runner.prepared(bs) for bs in (1, 2, 3, 4)] == [True, False, True, True]


def test_a_closure_pool_of_another_capacity_reuses_the_graph():
    """A KV pool read by closure and marked `size_varies` (an engine's pool, sized from free memory) may change
    capacity without a recompile: the size is symbolic in the compiled graph (so the on-disk cache serves the
    next process's pool too)."""
    from torch._dynamo.utils import counters

    from fastspec.graphs import size_varies

    holder = {}
    runner = GraphRunner("pool", make_gather(holder), gather_inputs(8), [2], "compile")
    before = counters["stats"]["unique_graphs"]
    for slots in (SLOTS, 2 * SLOTS, 3 * SLOTS):
        holder["pool"] = torch.randn(slots, D)
        size_varies(holder["pool"], 0)
        runner.prepare()
        x = {"x": torch.randn(2, D), "slots": torch.randint(1, slots, (2, 8))}
        torch.testing.assert_close(runner.run(2, x)["y"], make_gather(holder["pool"])(x)["y"])
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_generation_past_several_former_kv_widths_compiles_nothing_new(tmp_path, draft_dirs):
    """Attention reads each request's KV through its table row and length inside the graph (no KV width): after
    the first rounds, a generation growing past 256, 512 and 768 tokens of context (each once a new set of graphs)
    prepares and compiles nothing, and stays equal to target-only decoding."""
    from tiny_models import make_hf_model
    from torch._dynamo.utils import counters

    import fastspec
    from fastspec.config import EngineConfig
    from fastspec.engine.engine import Engine
    from fastspec.sampling import SamplingParams
    from fastspec.spec_config import SpecConfig

    make_hf_model("llama", max_position_embeddings=1024).save_pretrained(tmp_path)
    prepared = []
    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model=str(draft_dirs["llama"]["eagle3"]),
                              num_steps=3, topk=2, num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tmp_path), max_total_tokens=2048, graphs="compile", cuda_graph_bs=(1,),
                                 max_running_requests=1), spec, on_prepare=lambda name, bs: prepared.append(name))
    prompt = [3, 14, 15, 92, 65]
    engine.generate([prompt], [SamplingParams(max_new_tokens=4, ignore_eos=True)])  # every graph of bucket 1
    names, graphs = list(prepared), counters["stats"]["unique_graphs"]
    params = SamplingParams(max_new_tokens=820, ignore_eos=True)
    out = engine.generate([prompt], [params])[0]
    assert prepared == names and counters["stats"]["unique_graphs"] == graphs
    assert out.metrics.verify_rounds > 0
    plain = fastspec.LLM(str(tmp_path), max_total_tokens=2048)
    assert out.output_ids == plain.engine.generate([prompt], [params])[0].output_ids
