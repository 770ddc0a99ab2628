"""A chat's session across turns: which typed lines are commands and which are messages, and a conversation past the
context leaving out its oldest turns in steps the prefix cache can follow."""

from types import SimpleNamespace

import fastspec
from fastspec.cli.chat import run_chat
from fastspec.llm import TextDelta
from fastspec.sampling import SamplingParams
from fastspec.text.conversation import HELP, ChatSession
from fastspec.utils.metrics import SpecMetrics


class ScriptedIO:
    """run_chat's front end over a list of typed lines: what it shows is kept."""

    def __init__(self, lines):
        self.lines, self.infos, self.answers = list(lines), [], []

    def read(self):
        return self.lines.pop(0) if self.lines else None

    def info(self, message):
        self.infos.append(message)

    def write(self, text):
        self.answers.append(text)

    def end_answer(self, status):
        pass


def test_only_known_commands_in_any_case_are_commands_and_a_double_slash_sends_a_slash():
    """`/EXIT` ends the chat as `/exit` does; a line starting with `/` that is no command (a path) is a message, not
    refused as an unknown command; `//reset now` sends `/reset now`. Before, every line starting with `/` was taken
    as a command, case-sensitively."""
    sent = []

    def stream(ids, params):
        yield [TextDelta(0, "ok", "stop", SpecMetrics(), [8], 1)]

    llm = SimpleNamespace(tokenizer=SimpleNamespace(encode_chat=lambda messages: sent.append(messages[-1]["content"])
                                                    or [1] * len(messages)),
                          engine=SimpleNamespace(room_for=lambda n: 100 - n, config=SimpleNamespace(
                              speculative_fallback=False)), planned_spec=SimpleNamespace(enabled=False),
                          tuned_schedule=None, stream=stream)
    session = ChatSession(llm, SamplingParams(max_new_tokens=8))
    io = ScriptedIO(["/usr/bin/env is what?", "/STATS", "//reset now", "/System  Be brief.", "/Help", "/reset",
                     "/EXIT", "never read"])
    run_chat(session, io)
    assert sent == ["/usr/bin/env is what?", "/reset now"] and io.answers == ["ok", "ok"]
    assert io.infos[0].startswith("plain decoding · 1 answer · ")  # /STATS: the session's totals
    assert io.infos[1:] == ["system prompt set", HELP, "conversation cleared"] and session.system == "Be brief."
    assert io.lines == ["never read"]  # /EXIT ended the chat
    assert session.cleared[0]["messages"][2] == {"role": "user", "content": "/reset now"}


def test_a_conversation_past_the_context_leaves_out_turns_so_the_next_turns_reuse_the_cached_prefix():
    """Once a conversation outgrows the context, turns go a quarter of the context at a time: the turns after a
    drop extend the prompt before them, which the prefix cache holds (its reused tokens count them), rather than
    each leaving out one more turn and reading its whole prompt again (as it did: a drop every turn, no reuse)."""
    llm = fastspec.LLM(max_total_tokens=4096, max_context_len=256, speculative_algorithm="NONE")
    session = ChatSession(llm, SamplingParams(max_new_tokens=24, ignore_eos=True), system="Be brief.")
    drops, reused_after_drop, previous = [], [], None
    for i, c in enumerate("ABCDEFGHIJ"):
        unseen, before = session.unseen, llm.engine.worker.reused_tokens
        assert "".join(session.respond(f"Question {i}: name an animal that starts with the letter {c}."))
        seen = session.messages[session.unseen:-1]  # what the answer was asked with (its own reply aside)
        prompt = llm.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *seen])
        assert len(prompt) + 24 <= 256 and seen[-1]["role"] == "user"
        if session.unseen != unseen:
            drops.append(i)
            assert len(prompt) + 24 <= 256 - 256 // 4  # a quarter of the context freed beyond the answer's room
        elif drops:  # a turn after a drop: the prompt before it (and its answer) came from the cache
            reused_after_drop.append(llm.engine.worker.reused_tokens - before)
            assert reused_after_drop[-1] >= len(previous), (i, reused_after_drop, len(previous))
        previous = prompt
    assert drops and len(drops) < 10 - drops[0] - 1 and reused_after_drop  # fewer drops than turns after the first
    assert [m["content"] for m in session.messages[::2]][-1].startswith("Question 9")
