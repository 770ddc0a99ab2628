"""Sampled speculative decoding follows the target distribution, end to end through the engine.

A tiny target with an 8-token vocabulary and a different random STANDALONE draft; 3000 seeded requests emit
two tokens each; the (first, second) pair counts are chi-square tested against the exact target probabilities
computed by transformers (the oracle), after temperature / top-k / top-p processing.
"""

import pytest
import torch
from conftest import make_hf_model

import fastspec
from fastspec.sampling import SamplingParams

VOCAB, PROMPT, SAMPLES = 8, [1, 5, 3], 3000


def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's sampling distribution, computed independently of fastspec (float64)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or mass >= top_p:
            break
        keep[token], mass = True, mass + float(p[token])
    p = torch.where(keep, p, 0)
    return p / p.sum()


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    target = make_hf_model("llama", seed=3, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    target.save_pretrained(root / "target")
    make_hf_model("llama", seed=9, vocab_size=VOCAB, num_hidden_layers=1, bos_token_id=0,
                  eos_token_id=0).save_pretrained(root / "draft")
    return root, target


@pytest.mark.parametrize("topk, steps, n", [(1, 3, 4), (2, 2, 4)])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.8, 5, 1.0), (1.0, -1, 0.75)])
def test_two_token_distribution_matches_target(small_vocab, topk, steps, n, temperature, top_k, top_p):
    root, target = small_vocab
    with torch.no_grad():
        first = processed(target(torch.tensor([PROMPT])).logits[0, -1], temperature, top_k, top_p)
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = torch.stack([processed(row, temperature, top_k, top_p) for row in target(contexts).logits[:, -1]])
    expected = (first[:, None] * second).flatten() * SAMPLES  # [V*V]

    llm = fastspec.LLM(str(root / "target"), speculative_algorithm="STANDALONE", draft_model=str(root / "draft"),
                       num_steps=steps, topk=topk, num_draft_tokens=n, max_total_tokens=20000,
                       max_running_requests=256)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s, max_new_tokens=2,
                             ignore_eos=True) for s in range(SAMPLES)]
    outputs = llm.engine.generate([PROMPT] * SAMPLES, params)
    pairs = torch.tensor([o.output_ids[0] * VOCAB + o.output_ids[1] for o in outputs])
    observed = torch.bincount(pairs, minlength=VOCAB * VOCAB).double()
    assert observed[expected == 0].sum() == 0  # never a token the processed target excludes
    assert sum(o.metrics.verify_rounds for o in outputs) > 0
    cells = expected > 0
    chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    dof = int(cells.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), chi2 / 2))
    assert p_value > 1e-3, f"chi2={float(chi2):.1f} dof={dof}"


def triple_probs(target, prompt: list[int], vocab: int, dist) -> torch.Tensor:  # float64 [vocab^3]
    """The exact probability of each first three output tokens (t1, t2, t3), flattened: dist(logits, output) is
    the sampling distribution after `output` from the target's logits there (float64, the test's own)."""
    with torch.no_grad():  # rows: after the prompt, after each t1, after each (t1, t2)
        rows = [target(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
                for seqs in ([()], [(a,) for a in range(vocab)], [(a, b) for a in range(vocab) for b in range(vocab)])]
    out = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        for b in range(vocab):
            out[a, b] = dist(rows[0][0], [])[a] * dist(rows[1][a], [a])[b] * dist(rows[2][a * vocab + b], [a, b])
    return out.flatten()


def triples_p_value(outputs, vocab: int, expected: torch.Tensor) -> float:
    """Chi-square p-value of the outputs' (t1, t2, t3) counts against `expected` counts (cells expecting > 5);
    a triple the target cannot produce fails at once."""
    triples = torch.tensor([(o.output_ids[0] * vocab + o.output_ids[1]) * vocab + o.output_ids[2] for o in outputs])
    observed = torch.bincount(triples, minlength=vocab ** 3).double()
    assert observed[expected == 0].sum() == 0
    cells = expected > 5
    chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    return float(torch.special.gammaincc(torch.tensor((int(cells.sum()) - 1) / 2.0), chi2 / 2))


@pytest.mark.parametrize("algorithm, steps, topk, n", [("EAGLE", 3, 1, 4), ("EAGLE3", 3, 2, 6), ("EAGLE3", 2, 3, 7),
                                                       ("NGRAM", None, None, 6)])
def test_three_token_distribution_matches_target_for_every_drafter(tmp_path, algorithm, steps, topk, n):
    """3000 seeded requests, three tokens each, at temperature 1.3 and top-p 0.9 on a 6-token target: the
    (t1, t2, t3) counts chi-square tested (p > 1e-3) against the target's exact probabilities, for the drafters
    the STANDALONE and NEXTN tests above and in test_deepseek do not cover (random heads; NGRAM drafts from a
    repetitive prompt), chains and trees; a third of the emitted tokens at least are accepted drafts."""
    from fastspec.models.heads import write_random_head

    vocab, prompt, samples, temperature, top_p = 6, [1, 5, 3, 4, 1, 5, 3, 2, 1, 5], 3000, 1.3, 0.9
    target = make_hf_model("llama", seed=3, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    target.save_pretrained(tmp_path / "target")
    kind = algorithm.lower() if algorithm != "NGRAM" else None
    draft = kind and write_random_head(tmp_path / kind, target.config.hidden_size, vocab, kind, draft_vocab=vocab)
    expected = triple_probs(target, prompt, vocab, lambda logits, _: processed(logits, temperature, -1, top_p))
    expected = expected * samples
    llm = fastspec.LLM(str(tmp_path / "target"), speculative_algorithm=algorithm, draft_model=draft and str(draft),
                       num_steps=steps, topk=topk, num_draft_tokens=n, max_total_tokens=60000, max_running_requests=256)
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s, max_new_tokens=3, ignore_eos=True)
              for s in range(samples)]
    outputs = llm.engine.generate([prompt] * samples, params)
    assert sum(o.metrics.accepted_tokens for o in outputs) > samples / 3
    assert triples_p_value(outputs, vocab, expected) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# Seeded sampling is position-keyed: each token is drawn with the uniform of (seed, its position), so speculative
# rounds (every node at a depth draws with that depth's uniform) emit exactly what plain sampling emits.

SEEDED = [SamplingParams(temperature=0.9, seed=11, max_new_tokens=24, ignore_eos=True),
          SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=-5, max_new_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, seed=2**63 - 1,
                         max_new_tokens=24, ignore_eos=True),
          SamplingParams(max_new_tokens=24, ignore_eos=True)]  # a greedy request in the same batch
SEEDED_PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [7, 7, 8, 60, 61, 62, 7, 7], [28, 84, 19]]


@pytest.mark.parametrize("algorithm, draft, steps, topk, n", [
    ("EAGLE3", "eagle3", 3, 2, 5), ("STANDALONE", "self", 3, 1, 4), ("NGRAM", None, None, None, 6)])
def test_seeded_speculative_sampling_emits_what_plain_sampling_emits(tiny_dirs, draft_dirs, algorithm, draft, steps,
                                                                       topk, n):
    """Token for token, batched and alone, with the measured fallback switching between the two or not: a seeded
    request's output does not depend on how its tokens were drawn. (Sampled rounds did accept drafts.)"""
    directory = str(tiny_dirs["llama"][0])
    plain = fastspec.LLM(directory, speculative_algorithm="NONE", max_total_tokens=4096)
    expected = [plain.engine.generate([p], [sp])[0].output_ids for p, sp in zip(SEEDED_PROMPTS, SEEDED)]
    draft_path = directory if draft == "self" else (str(draft_dirs["llama"][draft]) if draft else None)
    for fallback in (False, True):
        llm = fastspec.LLM(directory, speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                           topk=topk, num_draft_tokens=n, max_total_tokens=4096, speculative_fallback=fallback)
        batched = llm.engine.generate(SEEDED_PROMPTS, SEEDED)
        assert [o.output_ids for o in batched] == expected
        alone = [llm.engine.generate([p], [sp])[0] for p, sp in zip(SEEDED_PROMPTS, SEEDED)]
        assert [o.output_ids for o in alone] == expected
        if not fallback:
            assert sum(o.metrics.emitted_tokens - o.metrics.verify_rounds for o in alone[:3]) > 0


def test_position_uniforms_are_uniform_and_independent_across_positions_and_seeds():
    """Chi-square (p > 1e-3) of 20000 draws over 20 bins, and of (position p, p + 1) and (seed s, s + 1) pairs
    over 10 x 10 cells; values depend on (seed, position) only, not on the batch they are computed in."""
    from fastspec.sampling.draw import position_uniforms

    seeds = torch.arange(5000) * 7 - 1000
    u = position_uniforms(seeds, torch.arange(4).repeat(5000, 1) + 300)  # [5000, 4]
    assert 0 <= float(u.min()) and float(u.max()) < 1

    def p_value(counts: torch.Tensor) -> float:
        expected = counts.sum() / counts.numel()
        chi2 = ((counts - expected) ** 2 / expected).sum()
        return float(torch.special.gammaincc(torch.tensor((counts.numel() - 1) / 2.0), chi2 / 2))
    assert p_value(torch.histc(u.flatten(), 20, 0, 1).double()) > 1e-3
    cells = lambda a, b: torch.bincount((a * 10).long() * 10 + (b * 10).long(), minlength=100).double()  # noqa: E731
    assert p_value(cells(u[:, 0], u[:, 1])) > 1e-3
    assert p_value(cells(u[:-1, 0], u[1:, 0])) > 1e-3
    assert torch.equal(position_uniforms(seeds[7:9], torch.tensor([[301], [303]])), torch.stack([u[7, 1:2], u[8, 3:]]))


def test_relaxed_acceptance_thresholds_sample_the_same_batched_or_alone(tiny_dirs, draft_dirs):
    """--speculative-accept-threshold-*: SGLang's target-only rejection sampling, relaxed (lossy by design); its
    coins are position-keyed too, so a seeded request is still reproducible whatever batch it runs in. A greedy
    request beside them (the thresholds relax only sampled rows) emits what it emits alone, the target's own."""
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), speculative_algorithm="EAGLE3",
                       draft_model=str(draft_dirs["llama"]["eagle3"]), num_steps=3, topk=2, num_draft_tokens=5,
                       accept_threshold_single=0.3, accept_threshold_acc=0.5, max_total_tokens=4096)
    sampled, prompts = SEEDED[:3], SEEDED_PROMPTS[:3]  # (SEEDED[3] is greedy)
    batched = llm.engine.generate(prompts, sampled)
    alone = [llm.engine.generate([p], [sp])[0] for p, sp in zip(prompts, sampled)]
    assert [o.output_ids for o in batched] == [o.output_ids for o in alone]
    assert all(len(o.output_ids) == 24 for o in alone) and sum(o.metrics.verify_rounds for o in alone) > 0
    mixed = llm.engine.generate(SEEDED_PROMPTS, SEEDED)
    assert [o.output_ids for o in mixed[:3]] == [o.output_ids for o in alone]
    assert mixed[3].output_ids == llm.engine.generate(SEEDED_PROMPTS[3:], SEEDED[3:])[0].output_ids


@pytest.mark.parametrize("temperature", [1e-7, 1e-40, 5e-324])
def test_a_temperature_too_small_to_divide_by_samples_greedily(tiny_dirs, temperature):
    """A temperature below 1e-6 is greedy (SGLang's rule): divided by it, float32 logits overflowed to inf below
    float32's normal range, every probability came out NaN and the last token of the vocabulary was drawn at
    every step, target-only and speculative alike."""
    directory = str(tiny_dirs["llama"][0])
    params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=8, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for kw in ({}, dict(speculative_algorithm="STANDALONE", draft_model=directory, num_steps=2, topk=2,
                        num_draft_tokens=4)):
        llm = fastspec.LLM(directory, max_total_tokens=4096, **kw)
        expected = [o.output_ids for o in llm.engine.generate(SEEDED_PROMPTS, [greedy] * 4)]
        sampled = [SamplingParams(temperature=0.9, seed=1, max_new_tokens=8, ignore_eos=True), params] * 2
        assert [o.output_ids for o in llm.engine.generate(SEEDED_PROMPTS, sampled)][1::2] == expected[1::2]
    assert params.greedy and not SamplingParams(temperature=1e-6).greedy


@pytest.mark.parametrize("controls, temperature", [(dict(logit_bias={5: 1e39}), 1.0),  # past float32: inf
                                                   (dict(logit_bias={5: 1e35}), 1e-4)])  # inf once divided
def test_a_logit_past_float32s_range_takes_all_the_mass(tiny_dirs, controls, temperature):
    """A token whose controlled logit overflows float32 (a huge bias, or one divided by a small temperature) is
    drawn every time, as in the limit of a growing bias; before, inf - inf made every probability NaN and the
    vocabulary's last token was drawn instead, target-only and speculative alike (greedy was right)."""
    directory = str(tiny_dirs["llama"][0])
    params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=6, ignore_eos=True, **controls)
    for kw in ({}, dict(speculative_algorithm="STANDALONE", draft_model=directory, num_steps=2, topk=2,
                        num_draft_tokens=4)):
        llm = fastspec.LLM(directory, max_total_tokens=4096, **kw)
        outputs = llm.engine.generate(SEEDED_PROMPTS, [params, SEEDED[0]] * 2)
        assert [o.output_ids for o in outputs][::2] == [[5] * 6] * 2
