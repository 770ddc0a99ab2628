"""fastspec's light tokenizer agrees with transformers' AutoTokenizer (the oracle) on the embedded model."""

import pytest

from fastspec.errors import FastspecError
from fastspec.text.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  leading spaces and 12345 digits", "naïve café — ünïcödé 🚀", "line\nbreaks\n\n"]


@pytest.fixture(scope="module")
def pair(embedded_dir):
    from transformers import AutoTokenizer

    return Tokenizer(embedded_dir), AutoTokenizer.from_pretrained(str(embedded_dir))


def test_encode_decode_match_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(pair):
    ours, theirs = pair
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    for messages in (conversation[1:2], conversation):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
        assert ours.encode_chat(messages) == theirs.encode(expected, add_special_tokens=False)
    assert ours.apply_chat_template(conversation[1:2]).startswith("<|im_start|>system\n")


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FastspecError, match="cannot load the tokenizer"):
        Tokenizer(tmp_path)


def test_a_long_encode_lets_other_threads_run(pair):
    """Tokenizing a long prompt lets go of the GIL: another thread (a server's engine, its other streams) keeps
    going meanwhile instead of standing still until the whole prompt is tokenized."""
    import threading

    ours, _ = pair
    text, ticks, done = "hello world " * 100_000, [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(1)
            done.wait(0.001)
    ticker = threading.Thread(target=tick)
    ticker.start()
    ids = ours.encode(text)
    done.set()
    ticker.join()
    assert len(ids) > 100_000 and len(ticks) > 10  # (holding the GIL throughout it gets one or two)
