"""One streamed choice of a request with tools: after each piece of the answer, the content and tool-call deltas
that are new. Content is sent as soon as it cannot be the start of a call; a call is sent once the format's scan
knows it is one (the first delta with id and name), then its arguments' text as it grows. The finished answer read
by `fastspec.serve.tools.parse_output` is exactly what these deltas join to: content that is only spaces waits
until it is known to be the answer's (a finished answer with calls has none)."""

from __future__ import annotations

from fastspec.serve.tools import ArgumentsDelta, Tools, scan


class ToolStream:
    def __init__(self, tools: Tools | None, parser: str):
        self.tools, self.parser = tools, parser
        self.content = 0  # characters of content sent
        self.arguments: list[str] = []  # per call, its arguments sent so far

    def feed(self, text: str, final: bool) -> tuple[str, tuple[ArgumentsDelta, ...]]:
        """(new content, new call deltas) for the answer's text so far; `final` once it is finished."""
        found = scan(text, self.tools, self.parser, final)
        content = ""
        if found.content.strip() or (final and not found.calls):
            content, self.content = found.content[self.content:], max(self.content, len(found.content))
        deltas = []
        for index, call in enumerate(found.calls):
            if call.name is None:
                break
            if index == len(self.arguments):
                deltas.append(ArgumentsDelta(index, call.name, call.arguments))
                self.arguments.append(call.arguments)
            elif len(call.arguments) > len(self.arguments[index]):
                deltas.append(ArgumentsDelta(index, None, call.arguments[len(self.arguments[index]):]))
                self.arguments[index] = call.arguments
        return content, tuple(deltas)

    @property
    def called(self) -> bool:
        return bool(self.arguments)
