"""What a request may be before it runs: its length within the context and what the KV pool can ever hold, its
token ids within the vocabulary, its grammar compiled (Engine.request). Reads the worker's limits; runs nothing and
holds no request."""

from __future__ import annotations

from fastspec.engine.scheduler import Request
from fastspec.errors import BadField, RequestTooLong
from fastspec.sampling.draw import request_seed
from fastspec.sampling.grammar import GrammarCompiler
from fastspec.sampling.params import SamplingParams


class Intake:
    """The checks of one engine's requests, and its grammar compiler (structured output)."""

    def __init__(self, worker, page_size: int):
        self.worker, self.page_size = worker, page_size
        self.grammars = GrammarCompiler(worker.sources.tokenizer_dir, worker.model.config.vocab_size, worker.eos_ids)

    def room_for(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens may ask for: what both the context and the KV pool
        leave (< 1: none). The KV a request can ever hold is its prompt + all output in whole pages + a round's
        headroom. A server's default length is capped by it."""
        fits = (self.worker.memory.ceiling - self.worker.round_headroom()) // self.page_size
        return min(self.worker.max_context_len, fits * self.page_size) - prompt_len

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """The one check of a request's length (`request` makes it; a server, to name its own fields): past the
        context length or past what the KV pool can ever hold is a RequestTooLong saying which, and the room left."""
        ctx, room = self.worker.max_context_len, self.room_for(prompt_len)  # (room: what both limits leave)
        if prompt_len + max_new_tokens > ctx:
            raise RequestTooLong("context", ctx, prompt_len, max_new_tokens, room)
        if max_new_tokens <= room:
            return
        page, headroom = self.page_size, self.worker.round_headroom()
        need = -(-(prompt_len + max_new_tokens) // page) * page + headroom
        raise RequestTooLong("kv_pool", self.worker.memory.ceiling, prompt_len, max_new_tokens, room, need, page)

    def request(self, rid: int, prompt: list[int], params: SamplingParams) -> Request:
        """A checked request for `run` (a BadField naming the field: empty, bad ids or grammar; a RequestTooLong: too
        long for the context or the pool); `rid` names it in the StepOutputs and for `abort`."""
        if not prompt:
            raise BadField("empty prompt", "prompt")
        self.check_length(len(prompt), params.max_new_tokens)
        vocab = self.worker.model.config.vocab_size
        # each message's subject is the field (a CLI swaps it for its flag); it ends with the first id out of range
        bad = _outside(prompt, vocab)
        if bad is not None:
            raise BadField(f"prompt must be token ids in [0, {vocab}), got {bad}", "prompt")
        bad = _outside([t for t, _ in params.logit_bias], vocab)
        if bad is not None:
            raise BadField(f"logit_bias must name token ids in [0, {vocab}), got {bad}", "logit_bias")
        bad = _outside(params.stop_token_ids, vocab)
        if bad is not None:
            raise BadField(f"stop_token_ids must be in [0, {vocab}), got {bad}", "stop_token_ids")
        return Request(rid, list(prompt), params, request_seed(params.seed), grammar=self.grammars.compile(params))


def _outside(ids, vocab: int) -> int | None:
    """The first of `ids` not in [0, vocab), or None."""
    return next((t for t in ids if not 0 <= t < vocab), None)
