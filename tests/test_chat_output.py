"""What the terminal chat shows. Its streamed word wrapping (fastspec.text.wrap): words stay whole, nothing but a
replaced space is lost, code blocks and over-long words pass as they come, a narrow terminal is left alone, resizing
is followed. Its banner: what decodes at batch size 1, a tuned plain tier included."""

import random
import textwrap

import pytest

from fastspec.text.wrap import WordWrap

TEXT = ("Light travels through water more slowly than through air, which bends it where light encounters the "
        "surface of a lake, including water in a glass; see https://example.com/a/very/long/path/that/never/fits "
        "for more.\nA second paragraph follows here with a few more words to wrap.")


def streamed(text: str, width, pieces: int, seed: int = 0) -> str:
    wrap = WordWrap(width if callable(width) else (lambda: width))
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), pieces - 1)) if pieces > 1 else []
    out = [wrap.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return "".join(out) + wrap.flush()


def test_lines_fit_words_stay_whole_and_nothing_is_lost():
    for width in (20, 33, 80):
        out = streamed(TEXT, width, pieces=1)
        assert out.split() == TEXT.split()  # the same words, none cut
        assert out.replace("\n", " ").split(" ") == TEXT.replace("\n", " ").split(" ")  # only spaces became breaks
        for line in out.split("\n"):
            assert len(line) <= width or " " not in line.strip()  # only a word longer than the width overflows
        for pieces in (7, 40, len(TEXT) - 1):  # however the answer is streamed
            assert streamed(TEXT, width, pieces, seed=pieces) == out


def greedy_fill(text: str, width: int) -> str:
    """The oracle: textwrap's greedy fill of each paragraph, words kept whole."""
    return "\n".join("\n".join(textwrap.wrap(p, width, break_long_words=False, break_on_hyphens=False))
                     for p in text.split("\n"))


def edge_text(width: int, seed: int) -> str:
    """Two paragraphs of words of 1 to `width` letters: some lines end with a word exactly at the edge (a word
    `width` long fills a line by itself)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefgh", k=rng.choice([*range(1, 10), width]))) for _ in range(90)]
    return " ".join(words[:50]) + "\n" + " ".join(words[50:])


@pytest.mark.parametrize("width", [20, 21, 23, 27, 32, 40])
def test_lines_are_filled_as_a_greedy_fill_fills_them(width):
    """A word goes to the next line only if it does not fit this one: a word ending exactly at the edge stays."""
    text = edge_text(width, seed=width)
    expected = greedy_fill(text, width)
    assert sum(len(line) == width for line in expected.split("\n")) >= 2  # the text tests the edge
    for pieces in (1, 9, len(text)):  # however the answer is streamed
        assert streamed(text, width, pieces, seed=pieces) == expected


def test_a_word_ending_at_the_edge_stays_on_its_line():
    exact = "aaaa bbbb cccc ddddd eeee " + "f" * 20 + " g"  # 20 columns, then a word as wide as the line
    assert streamed(exact, 20, pieces=1) == "aaaa bbbb cccc ddddd\neeee\n" + "f" * 20 + "\ng"


def test_a_word_longer_than_the_line_streams_as_it_comes():
    wrap = WordWrap(lambda: 20)
    assert wrap.feed("see ") == "see"
    shown = wrap.feed("https://example.com/path/long")  # past 20 characters: written without waiting
    assert shown and "https://example.com/path/long".startswith(shown.lstrip())


def test_code_blocks_and_narrow_terminals_are_left_as_they_are():
    code = "Run:\n```python\nprint('a long line of code that must stay on one line, whatever the width')\n```\nDone."
    out = streamed(code, 24, pieces=1)
    assert "print('a long line of code that must stay on one line, whatever the width')" in out.split("\n")
    assert streamed(TEXT, 12, pieces=5) == TEXT  # narrower than 20 columns: not wrapped


def test_prose_after_a_closed_code_block_is_wrapped_again():
    code = "print('a long line of code that must stay on one line, whatever the width')"
    prose = "After the block the answer goes on in prose, long enough that it must be wrapped at the edge again."
    text = f"{prose}\n```python\n{code}\n```\n{prose}"
    expected = f"{greedy_fill(prose, 24)}\n```python\n{code}\n```\n{greedy_fill(prose, 24)}"
    assert len(greedy_fill(prose, 24).split("\n")) > 3  # the prose is wrapped, before the block and after it
    for pieces in (1, 11, len(text)):
        assert streamed(text, 24, pieces, seed=pieces) == expected


def test_wide_characters_take_two_columns():
    """CJK and emoji take two terminal cells each (a combining accent none): a line holding them is wrapped by the
    columns it takes, so the terminal never breaks a word itself."""
    line = "🎉 Write three words with emoji 日本語 ünï in a sentence."  # 38 characters to "ünï", 42 cells
    assert streamed(line, 40, pieces=1) == "🎉 Write three words with emoji 日本語\nünï in a sentence."
    from fastspec.text.wrap import cells
    rng = random.Random(0)
    words = ["".join(rng.choices("ab日本語🎉e\u0301", k=rng.randint(1, 8))) for _ in range(120)]
    text = " ".join(words)
    for width in (20, 31, 40):
        out = streamed(text, width, pieces=1)
        assert out.split() == text.split() and all(cells(line) <= width for line in out.split("\n"))
        assert streamed(text, width, pieces=37, seed=width) == out


CHILD = """
import sys
from pathlib import Path
from types import SimpleNamespace
from fastspec.cli.chat import TerminalChatIO
from fastspec.spec_config import SpecConfig
engine = SimpleNamespace(model_dir=Path("m"), config=SimpleNamespace(speculative_fallback=False))
io = TerminalChatIO(SimpleNamespace(llm=SimpleNamespace(planned_spec=SpecConfig(), tuned_schedule=None, engine=engine)))
Path(sys.argv[1]).write_text(io.read(), encoding="utf-8")
"""


def test_a_message_longer_than_the_terminals_line_buffer_is_read_whole(tmp_path):
    """A terminal in its line mode keeps 4095 characters of a line and drops the rest; the chat reads through
    readline, so a long pasted message arrives whole (and its prompt is readline's, to edit the line)."""
    pty = pytest.importorskip("pty")
    pytest.importorskip("readline")
    import os
    import select
    import subprocess
    import sys
    import time

    message = " ".join(f"w{i}é" for i in range(1500)) + " END"  # 9000 characters
    main, child = pty.openpty()
    out = tmp_path / "read.txt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], stdin=child, stdout=child, stderr=child,
                            env={**os.environ, "TERM": "xterm"}, close_fds=True)
    os.close(child)
    shown, data = b"", (message + "\r").encode()
    while b"you>" not in shown:  # the prompt: the child is reading
        shown += os.read(main, 4096)
    while data:
        data = data[os.write(main, data[:1024]):]
        while select.select([main], [], [], 0.01)[0]:  # (the echo drained, or the terminal stops taking input)
            os.read(main, 65536)
    deadline = time.monotonic() + 120  # (a bound on a hang, not a timing)
    while proc.poll() is None and time.monotonic() < deadline:
        if select.select([main], [], [], 0.1)[0]:
            try:
                os.read(main, 65536)
            except OSError:
                break
    proc.kill()
    proc.wait()
    os.close(main)
    assert out.read_text(encoding="utf-8") == message


def test_a_resized_terminal_is_followed():
    width = [80]
    wrap = WordWrap(lambda: width[0])
    first = wrap.feed(TEXT[:100])
    width[0] = 24
    lines = (first + wrap.feed(TEXT[100:]) + wrap.flush()).split("\n")
    assert len(lines[0]) > 24 and all(len(line) <= 24 or " " not in line for line in lines[2:])


def test_the_banner_says_what_decodes_at_batch_1():
    from fastspec.spec_config import SpecConfig, SpecParams
    from fastspec.text.conversation import decoding

    eagle = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model="head", num_steps=3, topk=2,
                               num_draft_tokens=4)
    assert decoding(SpecConfig(), True) == "plain decoding"
    assert decoding(SpecConfig(), True, tuned_plain=True) == "plain decoding (tuned)"  # (a tuned file chose it)
    assert decoding(eagle, False) == "EAGLE3 3/2/4"
    assert decoding(eagle, True) == "EAGLE3 3/2/4 · plain where measured faster"
    tuned = eagle.with_schedule(((1, None), (4, SpecParams(2, 4, 5))))
    assert decoding(tuned, True) == "EAGLE3 · plain at batch 1 (tuned)"  # not "EAGLE3" alone: the draft is not loaded
    assert decoding(eagle.with_schedule(((1, SpecParams(2, 2, 3)),)), False) == "EAGLE3 2/2/3 (tuned)"


@pytest.mark.slow
def test_warming_up_before_the_prompt_leaves_no_trace():
    """chat runs what the first answer would run before the first prompt; the session, the fallback policy's
    measurements and the answers are as if it had not."""
    import copy

    import fastspec
    from fastspec.sampling import SamplingParams
    from fastspec.text.conversation import ChatSession

    answers = []
    for warm in (True, False):
        llm = fastspec.LLM(max_total_tokens=4096, speculative_fallback=True)
        engine = llm.engine
        session = ChatSession(llm, SamplingParams(max_new_tokens=12))
        if warm:
            before = copy.deepcopy(engine.policy)
            session.warm_up()
            assert session.messages == [] and session.turns == [] and engine.policy == before
            engine.check_kv()  # the prefix cache holds nothing: every KV slot is free
            assert engine.worker.cache is not None and engine.allocator.num_free() == engine.pool.capacity
        answers.append("".join(session.respond("What is the capital of France?")))
        assert engine.worker.reused_tokens == 0  # the first answer prefilled its whole prompt (the template's too)
    assert answers[0] == answers[1]


def test_stats_say_what_decodes_and_the_acceptance_even_when_nothing_was_accepted():
    from types import SimpleNamespace

    from fastspec.spec_config import SpecConfig
    from fastspec.text.conversation import ChatSession, TurnStats
    from fastspec.utils.metrics import SpecMetrics

    spec = SpecConfig.resolve("EAGLE3", "LlamaForCausalLM", draft_model="head", num_steps=2, topk=2,
                              num_draft_tokens=3)
    engine = SimpleNamespace(config=SimpleNamespace(speculative_fallback=True))
    llm = SimpleNamespace(planned_spec=spec, tuned_schedule=None, engine=engine)
    session = ChatSession(llm, None)
    session.turns = [TurnStats(8, 0.5, SpecMetrics().add_round(0, 1, 2).add_round(0, 1, 2), "stop")]
    assert session.stats() == ("EAGLE3 2/2/3 · plain where measured faster · 1 answer · 8 tokens · 16.0 tok/s · "
                               "tau 1.00 · acceptance by depth [0.0, 0.0]")
    session.turns.append(TurnStats(4, 0.5, SpecMetrics().add_round(1, 2, 2), "stop"))
    assert session.stats().endswith("tau 1.33 · acceptance by depth [0.33, 0.0]")
