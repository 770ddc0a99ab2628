"""The engine: owns the target model, its static KV pool, the allocator and the request->slot table.

`generate` runs plain (non-speculative) continuous batching: admit -> batched prefill of the admitted
prompts -> decode rounds over the running batch -> commit. `commit` is the one place where request lengths,
tokens and KV slots advance. Tokenisation stays outside (fastspec.llm); the engine speaks token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.attention import AttentionContext, TorchAttnBackend, decode_metadata, extend_metadata
from fastspec.config import EngineConfig
from fastspec.errors import FastspecError
from fastspec.memory import KVPool, ReqToTokenTable, make_allocator
from fastspec.models.loader import load_target, read_config, resolve_model_dir
from fastspec.sampling import SamplingParams, SamplingTensors, make_generator, sample
from fastspec.scheduler import Request, Scheduler


@dataclass(frozen=True)
class GenerateOutput:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str


def generation_eos_ids(model_dir, config_eos: tuple[int, ...]) -> frozenset[int]:
    """EOS ids from config.json and generation_config.json (either may list several)."""
    import json

    ids = set(config_eos)
    path = model_dir / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        model_config = read_config(self.model_dir)
        self.max_context_len = config.max_context_len or model_config.max_position_embeddings
        self.model = load_target(self.model_dir, config.torch_dtype, config.device)
        self.eos_ids = generation_eos_ids(self.model_dir, model_config.eos_token_ids)
        c = self.model.config
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, config.torch_dtype)
        capacity = KVPool.capacity_for(per_token, max_tokens=config.max_total_tokens,
                                       mem_fraction=None if config.max_total_tokens else config.kv_mem_fraction,
                                       device=config.device, page_size=config.page_size)
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, config.page_size,
                           config.torch_dtype, config.device)
        self.allocator = make_allocator(self.pool.capacity, config.page_size, config.device)
        self.table = ReqToTokenTable(config.max_running_requests, self.max_context_len, config.device)
        self.backend = TorchAttnBackend()

    # ---- public API -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerateOutput]:
        reqs = [self._make_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        scheduler = Scheduler(self.pool.capacity, self.config.max_running_requests, self.config.page_size)
        for r in reqs:
            scheduler.add(r)
        with torch.inference_mode():
            while not scheduler.idle:
                admitted = scheduler.admit()
                if admitted:
                    self._prefill(admitted)
                elif scheduler.running:
                    self._decode(scheduler.running)
                else:
                    raise FastspecError("a request does not fit in the KV pool (raise --max-total-tokens)")
                scheduler.retire()
        return [GenerateOutput(r.prompt_ids, r.output_ids, r.finish_reason) for r in reqs]

    def check_kv(self, running: list[Request] = ()) -> None:
        """Leak check: free slots + slots held by `running` == capacity (AssertionError otherwise)."""
        held = [self.table.slots(r.row, 0, r.seq_len) for r in running]
        self.allocator.check(torch.cat(held) if held else torch.zeros(0, dtype=torch.int64))

    # ---- rounds -----------------------------------------------------------------------------------------

    def _make_request(self, rid: int, prompt: list[int], params: SamplingParams) -> Request:
        if not prompt:
            raise FastspecError("empty prompt")
        if len(prompt) + params.max_new_tokens > self.max_context_len:
            raise FastspecError(f"prompt ({len(prompt)} tokens) + max-new-tokens ({params.max_new_tokens}) "
                                f"exceeds the context length {self.max_context_len}")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise FastspecError(f"input token ids must be in [0, {vocab})")
        return Request(rid, list(prompt), params, make_generator(params.seed, self.config.device))

    def _prefill(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.row = self.table.alloc()
        lens = [len(r.prompt_ids) for r in reqs]
        ids = torch.tensor([t for r in reqs for t in r.prompt_ids], device=self.config.device)
        logits = self._extend(reqs, ids, lens)
        self._commit(reqs, lens, self._sample(reqs, logits))

    def _decode(self, reqs: list[Request]) -> None:
        ids = torch.tensor([r.output_ids[-1] for r in reqs], device=self.config.device)
        logits = self._extend(reqs, ids, [1] * len(reqs))
        self._commit(reqs, [1] * len(reqs), self._sample(reqs, logits))

    def _extend(self, reqs: list[Request], input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Append `lens[b]` tokens to request b's KV; logits of each request's last new token [bs, V]."""
        device = self.config.device
        rows = torch.tensor([r.row for r in reqs], device=device)
        prefix = torch.tensor([r.seq_len for r in reqs], device=device)
        ext = torch.tensor(lens, device=device)
        self._alloc_slots(rows, prefix, prefix + ext)
        if all(n == 1 for n in lens):
            meta = decode_metadata(self.table.table, rows, prefix + 1)
        else:
            meta = extend_metadata(self.table.table, rows, prefix, ext)
        positions = torch.cat([torch.arange(p, p + n, device=device) for p, n in zip(prefix.tolist(), lens)])
        hidden = self.model(input_ids, positions, AttentionContext.build(self.backend, meta, self.pool))
        last = torch.cumsum(ext, 0) - 1
        return self.model.compute_logits(hidden.final[last])

    def _alloc_slots(self, rows: torch.Tensor, prefix: torch.Tensor, seq_lens: torch.Tensor) -> None:
        last_loc = torch.where(prefix > 0, self.table.table[rows, (prefix - 1).clamp(min=0)].long(), -1)
        slots = self.allocator.alloc_extend(prefix, seq_lens, last_loc)
        if slots is None:
            raise FastspecError("KV pool exhausted")  # unreachable: admission reserves whole budgets
        self.table.write(rows, prefix, seq_lens - prefix, slots)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        return sample(logits, sampling, [r.generator for r in reqs]).tolist()

    def _commit(self, reqs: list[Request], fed: list[int], tokens: list[int]) -> None:
        """The one place state advances: KV lengths, emitted tokens, finishing and freeing."""
        for r, n, token in zip(reqs, fed, tokens):
            r.seq_len += n
            r.output_ids.append(token)
            r.finish_reason = self._finish_reason(r, token)
            if r.finished:
                self._release(r)

    def _finish_reason(self, r: Request, token: int) -> str | None:
        if token in r.params.stop_token_ids or (token in self.eos_ids and not r.params.ignore_eos):
            return "stop"
        if len(r.output_ids) >= r.params.max_new_tokens:
            return "length"
        return None

    def _release(self, r: Request) -> None:
        self.allocator.free(self.table.slots(r.row, 0, r.seq_len))
        self.table.free(r.row)
        r.row = -1
