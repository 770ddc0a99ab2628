"""KV lifecycle under long accepted runs: an oracle drafter that knows the target's greedy continuation hides it
among decoy siblings (so accepted nodes are NOT a prefix of the verify slots), driving remap / compaction /
page-aligned eviction and stops inside accepted runs. Greedy output must still equal target-only output."""

import random

import pytest
import torch
from conftest import all_slots_free
from draft_reference import accept_len
from test_speculative import PROMPTS, reference

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.speculative.kv import plan_round_kv, plan_round_kv_on_device
from fastspec.speculative.tree import tree_from_parents


class OracleDrafter:
    """Proposes the true continuation as a path with a decoy before each true node (worst case for compaction)."""

    uses_extend = False
    uses_scratch = False

    def __init__(self, continuations: dict[int, list[int]], prompt_lens: dict[int, int], num_steps: int, n: int):
        self.continuations, self.prompt_lens = continuations, prompt_lens
        self.num_steps, self.n = num_steps, n
        self.rng = random.Random(0)
        self.drafted = []  # (rid, row b, tree) per request and round

    def draft(self, batch):
        tokens, parents = [], []
        for rid, history in zip(batch.rids, batch.histories):
            done = len(history) - self.prompt_lens[rid]
            truth = self.continuations[rid][done: done + self.num_steps]
            tok, par, parent = [], [], 0
            for t in truth:
                if len(tok) + 2 > self.n - 1:
                    break
                tok += [(t + 1 + self.rng.randrange(90)) % 97, t]  # decoy first, then the true child
                par += [parent, parent]
                parent = len(tok)  # position of the true node (positions are 1-based; root is 0)
            while len(tok) < self.n - 1:  # fill with random nodes under random earlier nodes
                par.append(self.rng.randrange(len(tok) + 1))
                tok.append(self.rng.randrange(97))
            tokens.append(tok), parents.append(par)
        tree = tree_from_parents(batch.verified_id, torch.tensor(tokens), torch.tensor(parents), batch.seq_lens,
                                 self.num_steps)
        self.drafted += [(rid, b, tree) for b, rid in enumerate(batch.rids)]
        return tree

    def release(self, rid):
        pass


def use_drafter(engine, drafter) -> None:
    engine.worker.use_drafters({engine.spec.params: drafter})


@pytest.mark.parametrize("page_size, steps, n, bs", [(1, 6, 14, 8), (16, 5, 12, 5), (4, 3, 9, 8)])
def test_oracle_drafts_accept_long_runs_and_stay_lossless(tiny_dirs, page_size, steps, n, bs):
    prompts = PROMPTS[:bs]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = reference(tiny_dirs, "llama", page_size, prompts, params)
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="NGRAM", num_draft_tokens=n,
                       page_size=page_size, max_total_tokens=4096)
    engine = llm.engine
    drafter = OracleDrafter({i: out for i, out in enumerate(plain)}, {i: len(p) for i, p in enumerate(prompts)},
                            steps, n)
    use_drafter(engine, drafter)
    outputs = engine.generate(prompts, [params] * bs)
    assert [o.output_ids for o in outputs] == plain
    # each round accepts what its tree accepts against the target's greedy continuation (decoded past the 30: a
    # random node may match the 31st token), which is at least the true path: num_steps, or what is left of the 30
    longer = reference(tiny_dirs, "llama", page_size, prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
    for rid, (prompt, out) in enumerate(zip(prompts, outputs)):
        rounds = [(tree, b) for r, b, tree in drafter.drafted if r == rid]
        accepts = [accept_len(tree, b, prompt + longer[rid]) for tree, b in rounds]
        produced = [int(tree.positions.view(tree.batch_size, -1)[b, 0]) - len(prompt) + 1 for tree, b in rounds]
        assert all(a >= min(steps, 30 - done) for a, done in zip(accepts, produced))
        assert (out.metrics.verify_rounds, out.metrics.accepted_tokens) == (len(accepts), sum(accepts))
        # rounds reaching each depth an NGRAM tree of n nodes can hold, depths never reached included
        assert out.metrics.depth_counts == tuple(sum(a >= d for a in accepts) for d in range(1, n))
    assert all_slots_free(engine)


def test_oracle_stop_token_inside_run(tiny_dirs):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = reference(tiny_dirs, "llama", 16, PROMPTS, params)
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="NGRAM", num_draft_tokens=12,
                       page_size=16, max_total_tokens=4096)
    use_drafter(llm.engine, OracleDrafter(dict(enumerate(plain)), {i: len(p) for i, p in enumerate(PROMPTS)}, 5, 12))
    stops = [SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(out[12],)) for out in plain]
    outputs = llm.engine.generate(PROMPTS, stops)
    assert [o.output_ids for o in outputs] == [out[: out.index(out[12]) + 1] for out in plain]
    assert all_slots_free(llm.engine)


def test_plan_round_kv_worked_examples():
    slots = torch.tensor([[7, 9, 4, 5], [20, 21, 22, 23]])
    # page size 1: kept nodes [0, 2] -> positions map to slots 7, 4; the rest are freed
    plan = plan_round_kv(slots, [[0, 2], [0, 1, 2]], [10, 3], page_size=1)
    assert plan.table_slots.tolist() == [7, 4, 20, 21, 22]
    assert sorted(plan.free_slots.tolist()) == [5, 9, 23]
    assert plan.move_src.numel() == 0
    # page size 4, request at seq_len 6 (verify slots at positions 6..9 = page A tail 2 slots + page B)
    paged = torch.tensor([[26, 27, 32, 33]])
    plan = plan_round_kv(paged, [[0, 3]], [6], page_size=4)  # keep root + node 3 -> positions 6, 7
    assert plan.table_slots.tolist() == [26, 27]
    assert plan.move_src.tolist() == [33] and plan.move_dst.tolist() == [27]
    assert plan.free_slots.tolist() == [32, 33]  # page B is past the last kept position (7)
    plan = plan_round_kv(paged, [[0, 1, 2]], [6], page_size=4)  # a chain: nothing moves, page B stays
    assert plan.move_src.numel() == 0 and plan.free_slots.numel() == 0


@pytest.mark.parametrize("page_size, topk", [(1, 2), (4, 2), (1, 1), (4, 1)])
def test_the_device_commit_plan_matches_the_host_plan(page_size, topk):
    """plan_round_kv_on_device (fixed shapes, no host read) puts the same slot / KV at every kept position as
    plan_round_kv (the host plan, a worked-example-tested oracle), over random accepted paths."""
    gen = torch.Generator().manual_seed(page_size * 10 + topk)
    bs, n, e = 5, 6, 4
    verify_slots = torch.randperm(200, generator=gen)[: bs * n].view(bs, n) + 1
    kept_nodes = []
    for b in range(bs):
        keep = int(torch.randint(1, e + 1, (1,), generator=gen))
        if topk == 1:  # a chain keeps nodes 0..keep-1
            kept_nodes.append(list(range(keep)))
        else:  # a tree path: the root, then increasing node ids
            kept_nodes.append([0] + sorted(torch.randperm(n - 1, generator=gen)[: keep - 1].add(1).tolist()))
    accept_index = torch.full((bs, e), -1)
    for b, nodes in enumerate(kept_nodes):
        accept_index[b, : len(nodes)] = torch.tensor(nodes) + b * n
    seq_lens = [3, 8, 0, 13, 4]
    host = plan_round_kv(verify_slots, kept_nodes, seq_lens, page_size)
    device = plan_round_kv_on_device(verify_slots, accept_index, page_size, chain=topk == 1)
    assert device.keep_lens.tolist() == [len(k) for k in kept_nodes]
    kv = {int(s): int(s) for s in verify_slots.flatten()}  # slot -> whose KV it holds (its own, before the move)
    if device.move_src is not None:
        moved = {int(d): kv[int(s)] for d, s in zip(device.move_dst, device.move_src)}
        kv.update(moved)
    host_kv = {int(s): int(s) for s in verify_slots.flatten()}
    host_kv.update({int(d): host_kv[int(s)] for d, s in zip(host.move_dst, host.move_src)})
    flat_host = host.table_slots.tolist()
    for b, nodes in enumerate(kept_nodes):  # position seq_len + j: same slot, holding the same node's KV
        first = sum(len(k) for k in kept_nodes[:b])
        for j in range(len(nodes)):
            slot = int(device.table_slots[b, j])
            assert slot == flat_host[first + j]
            assert kv[slot] == host_kv[flat_host[first + j]] == int(verify_slots[b, nodes[j]])
        assert device.nodes[b].tolist() == nodes + [-1] * (e - len(nodes))


@pytest.mark.parametrize("page_size", [1, 4])
def test_reserved_verify_slots_match_an_exact_allocation(page_size):
    """reserve_extend (lengths known only on the device) gives every position a slot on the request's own
    pages, continuing its partial page as alloc_extend does; the pages it did not reach go back, and then
    the allocator holds exactly what the requests hold."""
    from fastspec.memory.allocator import make_allocator

    alloc = make_allocator(256, page_size)
    prefix = [5, 8, 1, 0]
    held = []
    last_loc = []
    for p in prefix:  # each request's existing KV
        slots = alloc.alloc_extend(torch.tensor([0]), torch.tensor([p]), torch.tensor([-1]))
        held.append(slots)
        last_loc.append(int(slots[-1]) if p else -1)
    n = 6
    slots, pages = alloc.reserve_extend(torch.tensor(prefix), n, torch.tensor(last_loc))
    slots = slots.view(len(prefix), n)
    for b, p in enumerate(prefix):
        full = torch.cat([held[b], slots[b]])
        assert full.unique().numel() == p + n  # no slot twice
        if page_size > 1:  # position q sits at offset q % P of its page
            assert (full % page_size).tolist() == [q % page_size for q in range(p + n)]
    if pages is not None:
        alloc.free(alloc.unused_pages(pages, prefix, n))
    alloc.check(torch.cat([*held, slots.flatten()]))
