"""A chat's session across turns: which typed lines are commands and which are messages."""

from types import SimpleNamespace

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
                              speculative_fallback=False)), planned_spec=SimpleNamespace(enabled=False), stream=stream)
    session = ChatSession(llm, SamplingParams(max_new_tokens=8))
    io = ScriptedIO(["/usr/bin/env is what?", "/STATS", "//reset now", "/System  Be brief.", "/Help", "/reset",
                     "/EXIT", "never read"])
    run_chat(session, io)
    assert sent == ["/usr/bin/env is what?", "/reset now"] and io.answers == ["ok", "ok"]
    assert io.infos[0].startswith("plain decoding · 1 answer · ")  # /STATS: the session's totals
    assert io.infos[1:] == ["system prompt set", HELP, "conversation cleared"] and session.system == "Be brief."
    assert io.lines == ["never read"]  # /EXIT ended the chat
    assert session.cleared[0]["messages"][2] == {"role": "user", "content": "/reset now"}

