"""Training data for an EAGLE-3 head: the target's own responses, and the target's features on them.

Owns: regenerating responses with the target (one greedy answer per prompt plus sampled ones) into an
append-only `conversations.jsonl` (an interrupted run keeps every finished chunk), the packed target forward
that yields the EAGLE-3 aux features and the target's greedy label at every position, and the draft vocabulary
chosen by label frequency. Does not own the objective (ttt.py) nor the loop and checkpoints (trainer.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fastspec.errors import FastspecError
from fastspec.memory.state_pool import StatePool
from fastspec.sampling.params import SamplingParams

SAMPLED = dict(temperature=0.8, top_p=0.95)  # the non-greedy answers: varied, still the target's own text


@dataclass(frozen=True)
class Conversation:
    ids: tuple[int, ...]  # chat-templated prompt + the target's response
    prompt_len: int
    greedy: bool


@dataclass(frozen=True)
class Features:
    """Every conversation concatenated: row r of each tensor is one token position."""
    tokens: torch.Tensor  # [N] int64
    aux: torch.Tensor  # [N, 3H] bfloat16 residual stream entering the three capture layers
    labels: torch.Tensor  # [N] int64 the target's greedy next token after this position (see extract_features)
    offsets: torch.Tensor  # [C + 1] int64 start of conversation c, then N
    prompt_lens: torch.Tensor  # [C] int64
    soft_ids: torch.Tensor | None = None  # [N, k] int32 the k likeliest next tokens of the target (soft labels)
    soft_probs: torch.Tensor | None = None  # [N, k] float16 their probabilities under the target

    def __len__(self) -> int:
        return self.prompt_lens.numel()


def generate_conversations(llm, prompts: list[str], store, made: list[dict], samples: int, max_new_tokens: int,
                           seed: int, chunk: int = 64,
                           on_progress: Callable[[int, int], None] = lambda done, total: None) -> list[Conversation]:
    """Answer every prompt `samples` times (the first greedily) with the target, appending each chunk to `store`
    (a JsonlStore or a Corpus: `append(records)`); answers already `made` (its records, read once by the caller) are
    not made again."""
    done = {(r["prompt"], r["sample"]): r for r in made}  # keyed by prompt text: sets may grow
    jobs = [(i, s) for i in range(len(prompts)) for s in range(samples) if (prompts[i], s) not in done]
    total = len(prompts) * samples
    on_progress(total - len(jobs), total)
    for start in range(0, len(jobs), chunk):
        batch = jobs[start:start + chunk]
        params = [_params(i, s, seed, max_new_tokens) for i, s in batch]
        outs = llm.generate([prompts[i] for i, _ in batch], params, chat=True)
        records = [{"prompt": prompts[i], "sample": s, "prompt_ids": out.prompt_ids, "output_ids": out.output_ids}
                   for (i, s), out in zip(batch, outs)]
        store.append(records)
        done.update(((r["prompt"], r["sample"]), r) for r in records)
        on_progress(total - len(jobs) + start + len(batch), total)
    return [_conversation(done[(p, s)]) for p in prompts for s in range(samples)]


def check_prompts(model_dir: Path, prompts: list[str], max_new_tokens: int, source: str,
                  answered: frozenset[str] = frozenset()) -> None:
    """The target can answer every prompt not `answered` yet: it is a target (not a draft head) with a tokenizer and
    a chat template, and each chat-templated prompt leaves room for `max_new_tokens` in its context (a FastspecError
    naming the first that does not; `source`: where the prompts came from). Cheap: run before anything is generated
    or written."""
    from fastspec.models.loader import check_target, read_config
    from fastspec.text.tokenizer import Tokenizer

    config = read_config(model_dir)
    check_target(config, model_dir)
    todo = [(i, prompt) for i, prompt in enumerate(prompts) if prompt not in answered]
    if not todo:
        return
    tokenizer, context = Tokenizer(model_dir), config.context_len(None)
    for i, prompt in todo:
        n = len(tokenizer.encode_chat([{"role": "user", "content": prompt}]))  # as LLM.generate(chat=True) does
        if n + max_new_tokens > context:
            shown = prompt if len(prompt) <= 40 else prompt[:40] + "..."
            raise FastspecError(f"{source}: prompt {i + 1} ({json.dumps(shown)}) is {n} tokens with the chat "
                                f"template; with --max-new-tokens {max_new_tokens} it exceeds the target's context "
                                f"of {context} tokens")


class JsonlStore:
    """A run's own answers, one JSON line each, appended per chunk (an interrupted run keeps every finished
    chunk; a last line cut short is dropped)."""

    def __init__(self, path: Path):
        self.path = path

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line an interruption cut short: made again
                continue
        return records

    def append(self, records: list[dict]) -> None:
        cut = self.path.exists() and not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size > 0
        with self.path.open("a", encoding="utf-8") as f:
            f.write(("\n" if cut else "") + "".join(json.dumps(r) + "\n" for r in records))


def _params(i: int, s: int, seed: int, max_new_tokens: int) -> SamplingParams:
    if s == 0:
        return SamplingParams(max_new_tokens=max_new_tokens)
    return SamplingParams(max_new_tokens=max_new_tokens, seed=seed * 1_000_003 + i * 101 + s, **SAMPLED)


def _conversation(record: dict) -> Conversation:
    return Conversation(tuple(record["prompt_ids"] + record["output_ids"]), len(record["prompt_ids"]),
                        record["sample"] == 0)


class PackedCausalAttention:
    """`attend` for sequences packed into one row without a KV cache: causal inside each sequence.

    One causal SDPA per sequence: a single masked SDPA over the packed row would take torch's math path and
    spend ~90% of a 2048-token forward on [T, T] scores that the mask throws away."""

    def __init__(self, doc_ids: torch.Tensor, hybrid=None):  # [T], equal ids contiguous
        """`hybrid`: a hybrid target's HybridConfig: its recurrent layers get fresh zero states per sequence."""
        self.lengths = torch.unique_consecutive(doc_ids, return_counts=True)[1].tolist()
        self.states = None
        if hybrid is not None:
            rows = torch.arange(len(self.lengths), device=doc_ids.device)
            pool = StatePool(hybrid, len(self.lengths), 0, device=doc_ids.device)
            self.states = pool.view(rows, lens=tuple(self.lengths))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D]
        out = [F.scaled_dot_product_attention(qd.transpose(0, 1), kd.transpose(0, 1), vd.transpose(0, 1),
                                              is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
               for qd, kd, vd in zip(q.split(self.lengths), k.split(self.lengths), v.split(self.lengths))]
        return torch.cat(out)

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int, scale: float):
        # MLA: q [T, Hq, C+R]; latent [T, 1, C+R] is K, its first C dims are V -> [T, Hq, C]
        return self.attend(layer, q, latent, latent[..., :v_dim], scale)


def pack(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Greedy packing of sequence indices (in order) into groups of at most `batch_tokens` tokens
    (a longer sequence gets a group of its own)."""
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > batch_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return groups + ([current] if current else [])


@torch.no_grad()
def extract_features(target, conversations: list[Conversation], batch_tokens: int = 2048, bf16: bool = False,
                     on_progress: Callable[[int, int], None] = lambda done, total: None,
                     soft_topk: int = 0) -> Features:
    """Aux features and greedy labels of `target` (built with EAGLE-3 capture layers) on every conversation, and
    with `soft_topk` > 0 the top-k of the target's next-token distribution at every position (soft labels).

    A greedy conversation is its own label (the target chose every response token by argmax); sampled ones
    take the argmax of the target's logits. `bf16` autocasts the forward (faster on CPUs with AMX, much slower on
    AVX2-only ones)."""
    device = target.lm_head.weight.device
    tokens, aux, labels, soft_ids, soft_probs = [], [], [], [], []
    groups = pack([len(c.ids) for c in conversations], batch_tokens)
    for n, group in enumerate(groups):
        ids = torch.tensor([t for i in group for t in conversations[i].ids], device=device)
        doc = torch.cat([torch.full((len(conversations[i].ids),), j, device=device) for j, i in enumerate(group)])
        positions = torch.cat([torch.arange(len(conversations[i].ids), device=device) for i in group])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            hidden = target(ids, positions, PackedCausalAttention(doc, target.config.hybrid))
            label = torch.roll(ids, -1)  # next data token; a document's last label is never used
            sampled = torch.cat([torch.full((len(conversations[i].ids),), not conversations[i].greedy)
                                 for i in group]).to(device)
            if bool(sampled.any()):
                label[sampled] = target.compute_logits(hidden.final[sampled]).argmax(-1)
        if soft_topk:
            ids_k, probs_k = top_probs(target, hidden.final, soft_topk)
            soft_ids.append(ids_k.cpu())
            soft_probs.append(probs_k.cpu())
        tokens.append(ids.cpu())
        aux.append(hidden.aux.to(torch.bfloat16).cpu())
        labels.append(label.cpu())
        on_progress(n + 1, len(groups))
    lengths = torch.tensor([len(c.ids) for c in conversations])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    soft = (torch.cat(soft_ids), torch.cat(soft_probs)) if soft_topk else (None, None)
    return Features(torch.cat(tokens), torch.cat(aux), torch.cat(labels), offsets,
                    torch.tensor([c.prompt_len for c in conversations]), *soft)


def top_probs(target, final: torch.Tensor, k: int, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] int32 token ids, [T, k] float16 probabilities): the k likeliest next tokens at every position, computed
    `rows` positions at a time (a [T, V] float32 logit matrix of a packed batch would take gigabytes)."""
    ids, probs = [], []
    for chunk in final.split(rows):
        p = torch.softmax(target.compute_logits(chunk), dim=-1)  # [rows, V] float32
        top = p.topk(min(k, p.shape[-1]), dim=-1)
        ids.append(top.indices.to(torch.int32))
        probs.append(top.values.to(torch.float16))
    return torch.cat(ids), torch.cat(probs)


def response_labels(features: Features) -> torch.Tensor:
    """[M] the labels that predict a response token: the tokens a draft head is asked for."""
    keep = torch.zeros(features.tokens.numel(), dtype=torch.bool)
    for start, end, plen in zip(features.offsets[:-1].tolist(), features.offsets[1:].tolist(),
                                features.prompt_lens.tolist()):
        keep[start + plen - 1:end - 1] = True  # label at p predicts token p + 1
    return features.labels[keep]


def choose_draft_vocab(labels: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """[Vd] ascending target ids: the `draft_vocab_size` most frequent labels (ties: lower id first)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise FastspecError(f"--draft-vocab-size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts = torch.bincount(labels, minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # most frequent first, lower id on ties
    return order[:draft_vocab_size].sort().values
