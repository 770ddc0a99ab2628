"""Incremental detokenisation for streaming: output token ids arrive in bursts (one speculative round each) and
leave as text deltas that never split a UTF-8 character and never show text that may still become a stop string.

Owns: the decode window, stop-string matching and trimming, and how many output tokens the kept text needs.
Does not own: tokenisation (tokenizer.py), EOS / max-token rules (scheduler.py), nor dropping the tokens after a
stop (LLM and serve do, from `num_tokens_kept`; serve's usage counts `num_tokens_generated`).

Why a window: decode(suffix) is not the suffix of decode(all) for many tokenizers (SentencePiece drops the first
token's leading space; a byte-level token may hold half a character, which decodes to U+FFFD). So each call
decodes ids[prefix:] — the tokens read last time (context) plus the unread ones — and keeps the text past
decode(ids[prefix:read]). `read` is the first token whose text is not final yet. The window starts only where
text was final (a boundary between characters): byte-fallback decoders turn a whole run of byte tokens into
U+FFFD if it starts inside a character.
"""

from __future__ import annotations

from fastspec.sampling.params import check_stop

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole character
CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the first output tokens
MAX_UNREAD = 4  # unread tokens (a whole character fits in 4 byte tokens) before looking for an earlier cut
MAX_PARTIAL = 3  # U+FFFD an incomplete last character can decode to (byte fallback: one per byte)


class _WindowDecoder:
    """Token ids -> decoded text deltas without partial characters; remembers at which token each char count
    was reached, back to the last emitted text, so the tokens covering a stop-trimmed text can be counted."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        start = max(0, len(prompt_ids) - CONTEXT_TOKENS)
        while 0 < start and len(prompt_ids) - start < 4 * CONTEXT_TOKENS and (
                not (text := self._decode(prompt_ids[start:])) or text.startswith(REPLACEMENT)):
            start -= 1  # start between characters, and with text in front (the first word's space is written)
        self.ids = list(prompt_ids[start:])  # prompt tail + every output id
        self.num_prompt = len(self.ids)
        self.prefix, self.read = 0, self.num_prompt
        self.prefix_text = self._decode(self.ids)  # decode(ids[prefix:read])
        self.tail_emitted = 0  # chars past `read` already handed out (text in front of a split character)
        self.num_chars = 0  # chars handed out in total
        self.bounds = [(self.read, 0, self.prefix)]  # (token index, chars before it, window start from it)

    def push(self, ids: list[int], final: bool = False) -> str:
        """Appends ids; returns the text that is final now (everything if `final`)."""
        self.ids.extend(ids)
        text = self._decode(self.ids[self.prefix:])
        start = len(self.prefix_text)
        if final or not text.endswith(REPLACEMENT):
            return self._move_read(len(self.ids), text[start:])
        out = self._hand_out(text[start:].rstrip(REPLACEMENT))  # the text in front of the split character
        if len(self.ids) - self.read > MAX_UNREAD:  # keep the window short: commit an earlier token boundary
            j = self._last_clean_cut()
            j = self._last_final_cut(text) if j is None else j
            if j is not None:
                out += self._move_read(j, self._decode(self.ids[self.prefix:j])[start:])
        return out

    def _hand_out(self, tail: str) -> str:
        """Hands out what of `tail` (text past `read`) was not handed out yet."""
        delta = tail[self.tail_emitted:]
        self.tail_emitted += len(delta)
        self.num_chars += len(delta)
        return delta

    def _move_read(self, j: int, tail_j: str) -> str:
        """Hands out `tail_j`, the text of tokens [read, j), and makes it context for the next window."""
        delta = self._hand_out(tail_j)
        if j == self.read:  # nothing new: keep the context
            return delta
        self.tail_emitted -= len(tail_j)  # what remains was handed out from past token j
        self.prefix, self.read = self._context_start(self.read, j), j
        self.prefix_text = self._decode(self.ids[self.prefix:j])
        chars_before_j = self.num_chars - self.tail_emitted
        if chars_before_j > self.bounds[-1][1]:  # equal counts keep the earlier token (fewest tokens)
            self.bounds.append((j, chars_before_j, self.prefix))
        return delta

    def _last_clean_cut(self) -> int | None:
        """The last token boundary before the end whose text does not end in U+FFFD (a character boundary)."""
        return next((j for j in range(len(self.ids) - 1, self.read, -1)
                     if not self._decode(self.ids[self.prefix:j]).endswith(REPLACEMENT)), None)

    def _last_final_cut(self, text: str) -> int | None:
        """No character boundary: invalid bytes. The last boundary j whose text is final — a prefix of `text`
        short of its last MAX_PARTIAL chars (the only ones a future byte can change) — and from which the next
        window reads the rest of `text` as this one does (j may cut an invalid byte run in two)."""
        for j in range(len(self.ids) - 1, self.read, -1):
            text_j = self._decode(self.ids[self.prefix:j])
            if len(text_j) > len(text) - MAX_PARTIAL or not text.startswith(text_j):
                continue
            start = self._context_start(self.read, j)  # where the next window starts
            context = len(self._decode(self.ids[start:j]))
            if self._decode(self.ids[start:])[context:] == text[len(text_j):]:
                return j
        return None

    def _context_start(self, start: int, read: int) -> int:
        """Where a window reading from token `read` starts: at `start`, or before it while the tokens in between decode
        to nothing (skipped special tokens, ids the tokenizer lacks: the next word's space needs text in front)."""
        while start > 0 and read - start < 4 * CONTEXT_TOKENS and not self._decode(self.ids[start:read]):
            start -= 1
        return start

    def forget_before(self, num_chars: int) -> None:
        """Drops bounds no stop can need: a stop starts at or after char `num_chars` (all before it is shown)."""
        while len(self.bounds) > 1 and self.bounds[1][1] < num_chars:
            self.bounds.pop(0)

    def tokens_covering(self, kept: str) -> int:
        """Fewest output tokens whose decode starts with `kept` (a prefix of the text handed out so far)."""
        i = next((i for i, bound in enumerate(self.bounds) if bound[1] >= len(kept)), len(self.bounds))
        if i == 0:  # only the initial bound: `kept` is empty
            return 0
        last = self.bounds[i][0] if i < len(self.bounds) else len(self.ids)
        first, chars_before, window = self.bounds[i - 1]
        base = len(self._decode(self.ids[window:first]))
        need = kept[chars_before:]
        n = next((n for n in range(first + 1, last)
                  if self._decode(self.ids[window:n])[base:].startswith(need)), last)
        return n - self.num_prompt


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that are safe to show, trimming at the first
    stop string (the occurrence that ends first). `text` is everything emitted: decode(output ids) (continued
    from the prompt, if given) cut before that stop string; text that might begin a stop string waits until it
    is ruled out or `finish()`. Work per call is O(new tokens): the window and the held text are bounded.

    E.g. stop=("###",): add("a #") -> "a " ("#" waits), add("##") -> "" and stopped, text == "a ".
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        check_stop(stop)
        self._stop = tuple(stop)
        self._decoder = _WindowDecoder(tokenizer, list(prompt_ids or []), skip_special_tokens)
        self._chunks: list[str] = []
        self._num_emitted = 0
        self._held = ""  # decoded text not shown: it may be the start of a stop string
        self._stopped = False
        self._finished = False
        self._num_tokens_kept: int | None = None  # set when a stop string is found
        self._num_tokens_through_stop: int | None = None  # likewise: through the token that completed it

    def add(self, ids: list[int]) -> str:
        """The new text that is safe to show after appending `ids` ("" once stopped)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after finish()")
        if self._stopped:
            return ""
        return self._emit(self._decoder.push(list(ids)), final=False)

    def finish(self, ids: list[int] = ()) -> str:
        """Appends the last `ids` and releases the held-back text (a split character shows as U+FFFD, as decode()
        shows it). A whole output given here is decoded once (add() of it may look back over every token for a
        character boundary)."""
        if self._finished or self._stopped:
            self._finished = True
            return ""
        self._finished = True
        return self._emit(self._decoder.push(list(ids), final=True), final=True)

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def num_tokens_kept(self) -> int:
        """Output tokens the kept text needs: all of them until a stop string, then the fewest whose decode
        contains the text before it (the engine drops the rest)."""
        if self._num_tokens_kept is not None:
            return self._num_tokens_kept
        return len(self._decoder.ids) - self._decoder.num_prompt

    @property
    def num_tokens_generated(self) -> int:
        """Output tokens the model generated for this text: all of them until a stop string, then the fewest whose
        decode contains the stop string (through the token that completed it; tokens a speculative round accepted
        past it are not counted, so the count is plain decoding's)."""
        if self._num_tokens_through_stop is not None:
            return self._num_tokens_through_stop
        return len(self._decoder.ids) - self._decoder.num_prompt

    @property
    def num_tokens_shown(self) -> int:
        """Output tokens the text handed out so far needs (the fewest whose decode starts with it): a token whose
        text is held back (part of a character, or what may begin a stop string) is not among them yet."""
        if self._stopped:
            return self.num_tokens_kept
        return self._decoder.tokens_covering(self.text)

    def _emit(self, delta: str, final: bool) -> str:
        pending = self._held + delta  # a stop can only start here: shown text never ends in a stop prefix
        found = _find_stop(pending, self._stop)
        if found is not None:
            cut, end = found
            out, self._held, self._stopped = pending[:cut], "", True
            self._num_tokens_through_stop = self._decoder.tokens_covering(self.text + pending[:end])
            self._num_tokens_kept = self._decoder.tokens_covering(self.text + out)
        else:
            keep = 0 if final else _stop_prefix_len(pending, self._stop)
            out, self._held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        if out:
            self._chunks.append(out)
            self._num_emitted += len(out)
        self._decoder.forget_before(self._num_emitted)
        return out


def _find_stop(text: str, stop: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the stop occurrence in `text` that ends first (ties: the longest), None if there is none.
    Ending first is what a char-by-char stream would see first, so the cut does not depend on the bursts:
    with stops ("abcdef", "cd"), "abcdef" is cut at "cd" whether it arrives whole or one char at a time."""
    found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stop) if i >= 0]
    return min(found)[::-1] if found else None


def _stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (it may become one)."""
    return max((k for s in stop for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)
