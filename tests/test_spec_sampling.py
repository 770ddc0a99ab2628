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
