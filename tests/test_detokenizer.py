"""IncrementalDetokenizer against independent oracles: the tokenizer's own decode of all ids so far (real
embedded tokenizer, random bursts), brute-force stop-string rules, and hand-made byte vocabularies that force
split UTF-8 characters, byte-fallback runs, SentencePiece leading spaces and long runs of invalid bytes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastspec.errors import FastspecError
from fastspec.text.detokenizer import MAX_PARTIAL, MAX_UNREAD, IncrementalDetokenizer
from fastspec.text.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXTS = ["naïve café 🚀 日本語 ünïcödé", "Hi!\n\nUser: what is 2+2?\n\n### Answer: 4 ## done 🚀🚀",
         "def f(x):\n    return x  # ünïcödé 日本語\n\n###"]
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def tok(embedded_dir):
    return Tokenizer(embedded_dir)


def split(ids, sizes):
    """ids cut into consecutive bursts of the given sizes (cycled)."""
    out, i, k = [], 0, 0
    while i < len(ids):
        out.append(ids[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


def shown_before_stop(decoded, stop):
    """Brute-force oracle: what may be shown of `decoded` (all text so far, split char not yet decodable) —
    cut before the stop occurrence ending first (longest on ties), else minus the longest suffix that is a
    proper prefix of a stop string. Returns (text, stopped)."""
    clean = decoded.rstrip(FFFD)
    for end in range(1, len(clean) + 1):
        hits = [s for s in stop if clean[:end].endswith(s)]
        if hits:
            return clean[:end - max(map(len, hits))], True
    held = next((len(clean) - p for p in range(len(clean))
                 if any(s.startswith(clean[p:]) and s != clean[p:] for s in stop)), 0)
    return clean[:len(clean) - held], False


# ---- real embedded tokenizer ----

@SETTINGS
@given(text=st.sampled_from(TEXTS), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
       with_prompt=st.booleans())
def test_bursts_reproduce_decode_without_partial_chars(tok, text, sizes, with_prompt):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}]) if with_prompt else None
    detok, seen = IncrementalDetokenizer(tok, prompt_ids=prompt), []
    for burst in split(ids, sizes):
        delta = detok.add(burst)
        seen += burst
        assert isinstance(delta, str) and FFFD not in delta
        delta.encode("utf-8")  # a valid str: no lone surrogates
        assert detok.text == tok.decode(seen).rstrip(FFFD)  # nothing final is held back, nothing partial shown
    tail = detok.finish()
    assert detok.text == tok.decode(ids) == text and FFFD not in tail
    assert not detok.stopped and detok.num_tokens_kept == len(ids)
    assert IncrementalDetokenizer(tok, prompt_ids=prompt).finish(ids) == text  # (a whole output at once)


@SETTINGS
@given(data=st.data(), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_invalid_byte_runs_still_match_decode(tok, data, sizes):
    """Byte tokens in random order (orphan continuation bytes, unfinished characters) and special tokens."""
    pool = sorted(set(tok.encode("🚀 日本語 ünï", add_special_tokens=False)) | {0, 2})
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=60))
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    for burst in split(ids, sizes):
        detok.add(burst)
        assert full.startswith(detok.text)  # whatever was shown is final
    detok.finish()
    assert detok.text == full == IncrementalDetokenizer(tok).finish(ids)


@SETTINGS
@given(data=st.data(), text=st.sampled_from(TEXTS), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_stop_strings_across_tokens_and_bursts(tok, data, text, sizes):
    ids = tok.encode(text, add_special_tokens=False)
    for _ in range(data.draw(st.integers(0, 3))):  # skipped special tokens: decode to "" between tokens
        ids.insert(data.draw(st.integers(0, len(ids))), 2)
    full = tok.decode(ids)
    starts = st.integers(0, len(full) - 1)
    stop = tuple(full[i:i + n] + extra for i, n, extra in data.draw(st.lists(
        st.tuples(starts, st.integers(1, 6), st.sampled_from(["", "", "Z"])), min_size=1, max_size=3)))
    detok, seen = IncrementalDetokenizer(tok, stop=stop), []
    for burst in split(ids, sizes):
        detok.add(burst)
        seen += burst
        expected, stopped = shown_before_stop(tok.decode(seen), stop)
        assert (detok.text, detok.stopped) == (expected, stopped)
        if stopped:
            break
    detok.finish()
    kept, stopped = shown_before_stop(full, stop)
    assert detok.stopped == stopped
    assert detok.text == (kept if stopped else full)
    if stopped:  # fewest tokens whose decode contains the kept text; generated: the fewest that hold a stop string
        assert detok.num_tokens_kept == next(n for n in range(len(ids) + 1) if tok.decode(ids[:n]).startswith(kept))
        assert detok.num_tokens_generated == next(n for n in range(len(ids) + 1)
                                                  if any(s in tok.decode(ids[:n]) for s in stop))
    else:
        assert detok.num_tokens_generated == detok.num_tokens_kept == len(ids)


def test_stop_hand_worked(tok):
    a, space_hash, hashes, space_b = (tok.token_to_id(t) for t in ("a", "Ġ#", "##", "Ġb"))
    detok = IncrementalDetokenizer(tok, stop=("###",))
    assert [detok.add([a]), detok.add([space_hash]), detok.add([hashes, space_b])] == ["a", " ", ""]
    assert detok.stopped and detok.text == "a " and detok.num_tokens_kept == 2 and detok.add([a]) == ""
    assert detok.num_tokens_generated == 3  # through "##", which completed the stop string (" b" came after it)
    detok = IncrementalDetokenizer(tok, stop=("###",))
    assert [detok.add([a, space_hash]), detok.add([space_b]), detok.finish()] == ["a ", "# b", ""]
    detok = IncrementalDetokenizer(tok, stop=("###",))
    assert [detok.add([a, space_hash]), detok.finish()] == ["a ", "#"]  # finish releases the held "#"
    assert not detok.stopped and detok.num_tokens_kept == 2


def test_stop_that_ends_first_wins_whatever_the_bursts(tok):
    ids = tok.encode("abcdef", add_special_tokens=False)
    for sizes in ([1], [len(ids)]):
        detok = IncrementalDetokenizer(tok, stop=("abcdef", "cd"))
        for burst in split(ids, sizes):
            detok.add(burst)
        assert detok.text == "ab" and detok.stopped


def test_special_tokens_shown_when_not_skipped(tok):
    ids = tok.encode("Hi", add_special_tokens=False) + [2]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert detok.add(ids) + detok.finish() == "Hi<|im_end|>"


def test_misuse_raises(tok):
    # an empty stop string: SamplingParams' refusal, word for word (it said `stop strings must not be empty`)
    with pytest.raises(FastspecError, match=r"^stop must not hold an empty string, got \('ok', ''\)$"):
        IncrementalDetokenizer(tok, stop=("ok", ""))
    detok = IncrementalDetokenizer(tok)
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.add([81])


# ---- hand-made vocabularies ----

class ByteTokenizer:
    """Tokens are byte strings. Byte-level BPE decode: join and replace invalid UTF-8 (one U+FFFD per maximal
    invalid run, as Rust's from_utf8_lossy). byte_fallback: single-byte tokens >= 0x80 are grouped and, if the
    group is not UTF-8, become one U+FFFD per byte (SentencePiece's ByteFallback decoder)."""

    def __init__(self, vocab, byte_fallback=False):
        self.vocab, self.byte_fallback, self.decoded_lengths = vocab, byte_fallback, []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_lengths.append(len(ids))
        if not self.byte_fallback:
            return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")
        out, group = [], b""
        for piece in [self.vocab[i] for i in ids] + [b""]:
            if len(piece) == 1 and piece[0] >= 0x80:
                group += piece
                continue
            try:
                out.append(group.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(FFFD * len(group))
            out.append(piece.decode())
            group = b""
        return "".join(out)


SPLIT_VOCAB = [b"h", b"i", b" ", b"\xe6", b"\x97", b"\xa5", b"\xf0", b"\x9f", b"\x9a", b"\x80", b"a\xe6"]
H, I, SP, E6, N97, A5, F0, N9F, N9A, N80, A_E6 = range(len(SPLIT_VOCAB))


def run(detok, bursts):
    return [detok.add(b) for b in bursts] + [detok.finish()]


def test_split_character_waits_for_its_last_byte():
    tok = ByteTokenizer(SPLIT_VOCAB)
    assert tok.decode([E6, N97]) == FFFD  # the case being forced: half a character decodes to U+FFFD
    assert run(IncrementalDetokenizer(tok), [[H], [I], [SP], [E6], [N97], [A5]]) == ["h", "i", " ", "", "", "日", ""]
    assert run(IncrementalDetokenizer(tok), [[H, I, E6], [N97, A5, F0], [N9F, N9A], [N80]]) == \
        ["hi", "日", "", "🚀", ""]
    assert run(IncrementalDetokenizer(tok), [[A_E6], [N97, A5]]) == ["a", "日", ""]  # text in front is not held
    assert run(IncrementalDetokenizer(tok), [[H, E6], [N97]]) == ["h", "", FFFD]  # finish shows what decode shows


def test_byte_fallback_run_of_replacements_is_held():
    tok = ByteTokenizer(SPLIT_VOCAB, byte_fallback=True)
    assert tok.decode([F0, N9F, N9A]) == FFFD * 3
    assert run(IncrementalDetokenizer(tok), [[H, F0], [N9F, N9A], [N80, I]]) == ["h", "", "🚀i", ""]
    assert run(IncrementalDetokenizer(tok, stop=("🚀",)), [[H, F0, N9F], [N9A], [N80, I]]) == ["h", "", "", ""]
    prompt = [H, E6, N97, A5, E6, N97, A5]  # its last 4 tokens start inside a character
    assert tok.decode(prompt[-4:] + [E6, N97, A5]) == FFFD * 7  # so a window starting there never decodes
    assert run(IncrementalDetokenizer(tok, prompt_ids=prompt), [[E6], [N97], [A5, I]]) == ["", "", "日i", ""]


class PieceTokenizer:
    """SentencePiece-style: "▁" marks a space and decode drops the leading space of the first piece."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_sentencepiece_leading_space_is_kept():
    tok = PieceTokenizer(["▁Hello", "▁world", "!", "▁###"])
    assert tok.decode([1]) == "world"  # decoding a suffix alone loses the space
    assert run(IncrementalDetokenizer(tok), [[0], [1], [2]]) == ["Hello", " world", "!", ""]
    assert run(IncrementalDetokenizer(tok, prompt_ids=[0]), [[1], [2]]) == [" world", "!", ""]
    detok = IncrementalDetokenizer(tok, prompt_ids=[0], stop=(" #",))
    assert run(detok, [[1], [2, 3, 1]]) == [" world", "!", ""] and detok.num_tokens_kept == 2



def test_a_token_that_decodes_to_nothing_keeps_the_next_words_space():
    """A skipped special token (or an id the tokenizer lacks) decodes to "": the word after it still has its space,
    as decode of the whole text writes it (the stream said " world" + "" + "world")."""
    tok = PieceTokenizer(["▁Hello", "▁world", ""])  # 2: a special token, skipped
    assert tok.decode([0, 2, 1]) == "Hello world"
    assert run(IncrementalDetokenizer(tok), [[0], [2], [1], [2], [2], [1]]) == ["Hello", "", " world", "", "",
                                                                                 " world", ""]
    assert run(IncrementalDetokenizer(tok, prompt_ids=[0, 2, 2, 2, 2]), [[1]]) == [" world", ""]

def check_bounded_and_exact(tok, ids, sizes):
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok)
    tok.decoded_lengths.clear()
    for burst in split(ids, sizes):
        detok.add(burst)
        assert full.startswith(detok.text)  # whatever was shown is final
    detok.finish()
    assert detok.text == full
    assert max(tok.decoded_lengths) <= 2 * (MAX_UNREAD + MAX_PARTIAL + max(sizes))  # not growing with len(ids)


BURSTS = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@SETTINGS
@given(ids=st.lists(st.sampled_from(range(len(SPLIT_VOCAB))), min_size=40, max_size=120), sizes=BURSTS)
def test_invalid_bytes_keep_window_bounded_and_text_exact(ids, sizes):
    """Long runs of orphan bytes never become characters; the decode window must not grow with them."""
    check_bounded_and_exact(ByteTokenizer(SPLIT_VOCAB), ids, sizes)


@SETTINGS
@given(chars=st.lists(st.sampled_from([[H], [SP], [E6, N97, A5], [F0, N9F, N9A, N80]]), min_size=20, max_size=60),
       sizes=BURSTS)
def test_byte_fallback_characters_split_anywhere(chars, sizes):
    """Valid text only: ByteFallback decodes a whole run of byte tokens at once, so one invalid byte turns the
    characters before it in the run into U+FFFD too (not prefix-stable; no streaming decoder can follow it)."""
    check_bounded_and_exact(ByteTokenizer(SPLIT_VOCAB, byte_fallback=True), [i for c in chars for i in c], sizes)


@pytest.mark.parametrize("junk", [[N80], [E6], [E6, N97], [F0, N9F, N9A], [N97, E6, N97, A5, F0, N9A]])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_long_invalid_runs_are_committed(junk, size):
    """No character boundary for 40+ tokens: the window must still move on, cutting the invalid run exactly."""
    check_bounded_and_exact(ByteTokenizer(SPLIT_VOCAB), [H] + junk * (40 // len(junk) + 1) + [E6, N97, A5], [size])
