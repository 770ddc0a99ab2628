"""A chat conversation over an LLM: history, slash commands, streamed answers, per-turn and session stats.

No terminal I/O here (fastspec.cli.chat renders); an answer is a generator of text deltas the caller prints, and a
`should_stop()` callback (Ctrl-C) ends it early while keeping the partial answer in the history.
Each turn encodes the whole conversation; the engine's prefix cache starts it on the KV of the turns before (a
conversation past the context leaves out its oldest turns a quarter of the context at a time, so that stays true).
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastspec.errors import FastspecError
from fastspec.sampling.params import SamplingParams
from fastspec.text.tokenizer import valid_text
from fastspec.utils.files import write_new
from fastspec.utils.metrics import SpecMetrics

HELP = ("/reset  clear the conversation · /system TEXT  set the system prompt · /stats  session totals · /help · /exit"
        " · //TEXT  sends /TEXT")
COMMANDS = ("/reset", "/system", "/stats", "/help", "/exit")


def is_command(line: str) -> bool:
    """Whether a typed line is a command: its first word is one of COMMANDS, in any case (`/EXIT`). Any other line is
    a message, one starting with `/` too (`/usr/bin/env is what?`)."""
    return line.split(maxsplit=1)[0].lower() in COMMANDS if line.strip() else False


def message_text(line: str) -> str:
    """The message a line that is no command sends: a leading `//` sends the rest from its second `/` (`//reset
    now` sends `/reset now`), the way to start a message with a command's word."""
    return line[1:] if line.startswith("//") else line


@dataclass(frozen=True)
class TurnStats:
    tokens: int
    seconds: float
    metrics: SpecMetrics
    finish_reason: str

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        tau = f" · tau {self.metrics.tau:.2f}" if self.metrics.verify_rounds else ""
        return f"{self.tokens} tokens · {self.tok_s:.1f} tok/s{tau} · {self.finish_reason}"


def decoding(spec, fallback: bool, tuned_plain: bool = False) -> str:
    """What decodes an answer (batch size 1), as the banner and /stats say it: `EAGLE3 3/2/4 (tuned)`,
    `EAGLE3 · plain at batch 1 (tuned)`, `plain decoding`; `plain decoding (tuned)` where a tuned file chose plain
    decoding at every batch size (`tuned_plain`: LLM.tuned_schedule is ()). `fallback`: the measured fallback may
    still decode plainly where that measures faster."""
    if not spec.enabled:
        return "plain decoding" + (" (tuned)" if tuned_plain else "")
    params, tuned = spec.params_for(1), " (tuned)" if spec.schedule else ""
    if params is None:
        return f"{spec.algorithm} · plain at batch 1{tuned}"
    shape = f"{spec.algorithm} {params.shape}{tuned}"
    return shape + (" · plain where measured faster" if fallback else "")


class ChatSession:
    def __init__(self, llm, params: SamplingParams, system: str | None = None):
        self.llm, self.params, self.system = llm, params, system
        self.messages: list[dict] = []
        self.cleared: list[dict] = []  # conversations ended by /reset, still saved at exit
        self.turns: list[TurnStats] = []
        self.refused: list[dict] = []  # messages not answered (too long, interrupted at once): kept in the record
        self.unseen = 0  # the first messages of the conversation that no longer fit the context: not sent
        self.notes: list[str] = []  # for the user, once: the conversation outgrew the context

    def command(self, line: str) -> str | None:
        """Handle a slash command (a line `is_command` takes); returns a message to show, or None for /exit."""
        name, _, arg = line.strip().partition(" ")
        name = name.lower()
        if name == "/exit":
            return None
        if name == "/reset":
            if self.messages:
                self.cleared.append({"system": self.system, "messages": self.messages})
            self.messages, self.unseen = [], 0
            return "conversation cleared"
        if name == "/system":
            self.system = arg.strip() or None
            return f"system prompt {'set' if self.system else 'cleared'}"
        if name == "/stats":
            return self.stats()
        if name == "/help":
            return HELP
        return f"unknown command {name}; {HELP}"

    def warm_up(self) -> None:
        """Run once what the first answer would run first (graph buckets, every kernel's first call, the draft), so
        the first answer is as fast as the later ones. Leaves no trace: no history, stats, cached prefix, nor a
        measurement in the fallback policy (first calls are slow). It draws as the answers will (greedy or sampled),
        so it runs the acceptance they will."""
        engine, p = self.llm.engine, self.params
        policy = copy.deepcopy(engine.policy)
        ids = self.llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        engine.generate([ids], [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                               max_new_tokens=8, ignore_eos=True)])
        engine.flush_cache()
        engine.policy = policy

    def respond(self, text: str, should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Stream the answer to `text`; the answer joins the history when done, or as far as it got when the
        stream is cut (an exception, the generator closed: a signal ending the chat)."""
        messages = self.messages + [{"role": "user", "content": valid_text(text)}]
        start, answer, tokens, last = time.perf_counter(), [], 0, None
        try:
            ids, unseen = self._prompt(messages)
            steps = self.llm.stream([ids], [self.params])
            first = next(steps, [])  # (the request is checked here)
        except FastspecError as e:  # (e.g. too long): the history unchanged, the message kept in the record
            self.refused.append({"content": messages[-1]["content"], "error": str(e)})
            raise
        if unseen > self.unseen:
            self.notes.append(f"the conversation outgrew the {self.llm.engine.room_for(0)}-token context: "
                              f"the model no longer sees its first {unseen} messages (the saved record keeps them; "
                              "/reset starts afresh)")
        self.unseen = unseen
        try:
            for step in itertools.chain([first], steps):
                for delta in step:
                    answer.append(delta.text)
                    tokens += len(delta.new_ids)
                    last = delta if delta.finish_reason else last
                    if delta.text:
                        yield delta.text
                if last is None and should_stop():
                    self.llm.abort(0)
        finally:
            reason = last.finish_reason if last else "abort"
            self.turns.append(TurnStats(tokens, time.perf_counter() - start, last.metrics if last else SpecMetrics(),
                                        "interrupted" if reason == "abort" else reason))
            if reason == "abort" and not "".join(answer):  # stopped before a word: the model does not see it
                self.refused.append({"content": messages[-1]["content"], "error": "interrupted before an answer"})
            else:
                self.messages = messages + [{"role": "assistant", "content": "".join(answer)}]

    def _prompt(self, messages: list[dict]) -> tuple[list[int], int]:
        """(the tokens an answer to `messages` is asked with, how many of its first messages they leave out). While
        the answer has its max-new-tokens in the context, the messages left out before stay the same; once it does
        not, whole turns go, oldest first, until a quarter of the context is free beyond the answer's room too (or,
        short of that, the fewest that leave the room), so that the turns that follow extend this prompt, whose KV
        the prefix cache holds, rather than each leaving out one more turn and reading the whole prompt again. The
        system prompt and the latest message are always sent (alone too long, the engine refuses)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        slack, fewest = self.llm.engine.room_for(0) // 4, None
        for unseen in range(self.unseen, len(messages), 2):  # (a user message and its answer at a time)
            ids = self.llm.tokenizer.encode_chat(system + messages[unseen:])
            room = self.llm.engine.room_for(len(ids)) - self.params.max_new_tokens
            if room >= (0 if unseen == self.unseen else slack):
                return ids, unseen
            fewest = fewest or ((ids, unseen) if room >= 0 else None)
        return fewest or (ids, len(messages) - 1)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def stats(self) -> str:
        if not self.turns:
            return "no answers yet"
        tokens = sum(t.tokens for t in self.turns)
        seconds = sum(t.seconds for t in self.turns)
        metrics = sum((t.metrics for t in self.turns[1:]), self.turns[0].metrics)
        depths = [round(a, 2) for a in metrics.acceptance_by_depth]  # every depth drafted, 0.0 where none reached
        tau = f" · tau {metrics.tau:.2f} · acceptance by depth {depths}"
        engine, n = self.llm.engine, len(self.turns)
        said = decoding(self.llm.planned_spec, engine.config.speculative_fallback, self.llm.tuned_schedule == ())
        return (f"{said} · "
                f"{n} answer{'s' * (n != 1)} · {tokens} tokens · {tokens / seconds:.1f} tok/s"
                + (tau if metrics.verify_rounds else ""))

    def save(self, directory: Path) -> Path | None:
        """Write the conversation (and any cleared by /reset) as JSON, so nothing typed or generated is lost;
        None if there is nothing to write. A new file each time, whole or not at all (OSError if impossible)."""
        if not self.messages and not self.cleared and not self.refused:
            return None
        stem = time.strftime("chat-%Y%m%d-%H%M%S")
        text = json.dumps(self.record(), indent=1, ensure_ascii=False).encode()
        names = (f"{stem}{'' if n == 1 else f'-{n}'}.json" for n in itertools.count(1))  # two chats in a second
        return write_new(directory, names, lambda f: f.write(text))

    def record(self) -> dict:
        """Everything said: the current conversation, those cleared by /reset, the messages refused."""
        return {"system": self.system, "messages": self.messages, "cleared": self.cleared,
                **({"refused": self.refused} if self.refused else {})}

