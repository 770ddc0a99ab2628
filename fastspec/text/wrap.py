"""Word wrapping for a streamed answer in a terminal: words stay whole at the terminal's edge.

A word is held until it ends (a space or a newline follows) and then placed on the current line, or on the next one
if it would cross the width, which is read again for every piece of the stream (a resized terminal is followed).
Not wrapped: lines inside a ``` code block, a word longer than the whole width (a URL: it streams as it comes, from
the start of a line), and everything when the terminal is narrower than `min_width`. Nothing is dropped but the
spaces a line break replaces. Widths are terminal cells: a wide character (CJK, most emoji) takes two, a combining
mark or a joiner none. Knows nothing about terminals: the caller writes what `feed` and `flush` return.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

FENCE = "```"


def cells(text: str) -> int:
    """The terminal columns `text` takes (as wcwidth counts them, for the characters a model writes)."""
    return sum(0 if unicodedata.category(ch) in ("Mn", "Me", "Cf") else
               2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


class WordWrap:
    def __init__(self, width: Callable[[], int], min_width: int = 20):
        self.width, self.min_width = width, min_width
        self.col = 0  # cells taken on the current terminal line
        self.word = ""  # the word being received, not yet placed
        self.spaces = ""  # the spaces after the last placed word, not yet written
        self.line = ""  # the answer's current line (for code fences)
        self.code = False  # inside a ``` block
        self.unbroken = False  # the current word outgrew the width: streamed as it comes
        self.cols = 0  # the width, read once per piece fed

    def feed(self, text: str) -> str:
        """What to write now for the next piece of the answer."""
        self.cols = self.width()
        return "".join(self._char(ch) for ch in text)

    def flush(self) -> str:
        """The held word and spaces (at the end of an answer, or before anything else is printed)."""
        out = self._place() + self.spaces
        self.col += len(self.spaces)
        self.spaces = ""
        return out

    def reset(self) -> None:
        """A new answer starts at the beginning of a line."""
        self.__init__(self.width, self.min_width)

    def _char(self, ch: str) -> str:
        if ch == "\n":
            out = self.flush() + "\n"
            if self.line.lstrip().startswith(FENCE):
                self.code = not self.code
            self.col, self.line = 0, ""
            return out
        self.line += ch
        if self.code or self.cols < self.min_width:
            out = self.flush() + ch
            self.col += cells(ch)
            return out
        if ch in " \t":
            out = self._place()
            self.spaces += ch
            return out
        if self.unbroken:
            self.col += cells(ch)
            return ch
        self.word += ch
        if cells(self.word) > self.cols:  # can never fit a line: on a line of its own, as it comes
            out = ("\n" if self.col > 0 else self.spaces) + self.word
            self.col = cells(self.word) if self.col > 0 else self.col + cells(out)
            self.word, self.spaces, self.unbroken = "", "", True
            return out
        return ""

    def _place(self) -> str:
        """The held word on this line after its spaces, or at the start of the next one."""
        self.unbroken = False
        if not self.word:
            return ""
        if self.col > 0 and self.col + len(self.spaces) + cells(self.word) > self.cols:
            out, self.col = "\n" + self.word, cells(self.word)
        else:
            out = self.spaces + self.word
            self.col += cells(out)
        self.word, self.spaces = "", ""
        return out
