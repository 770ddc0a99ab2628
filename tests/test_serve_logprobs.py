"""Logprobs through `fastspec serve` where tokens and characters do not line up: the embedded model's byte-level
tokens, held by a regex to text whose characters (emoji, CJK) take several tokens each. Each token's `bytes` are its
own (together: the answer's UTF-8), a token that is no whole character is named by its bytes, so completions'
top_logprobs keep every alternative asked for; text_offset stays inside the text and the stream's equal the
answer's; a stop string that takes several tokens leaves logprobs for the tokens shown, and usage counts it."""

import openai
import pytest
from serve_helpers import engine_settled, start_server

import fastspec

pytestmark = pytest.mark.slow  # loads the embedded model

MODEL = "smol-logprobs"
ANSWER = "😀🎉 日本語 ✓ done"  # 😀 takes 3 of the embedded model's tokens, 日 2
EOS = ("<|im_end|>", "<|endoftext|>")  # the embedded model's end tokens (llama.cpp's end-of-generation set)


@pytest.fixture(scope="module")
def served(embedded_dir):
    llm = fastspec.LLM(str(embedded_dir), max_total_tokens=2048, max_running_requests=4)
    server, thread, service, _, client = start_server(llm, MODEL, max_queued=8)
    yield client, service
    server.should_exit = True
    thread.join(10)
    service.stop()


def ask(**extra) -> dict:
    return dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"regex": ANSWER}) | extra


def test_chat_logprobs_carry_each_tokens_own_bytes(served):
    client, service = served
    messages = [{"role": "user", "content": "Two emoji, please."}]
    got = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3, **ask()).choices[0]
    assert got.message.content == ANSWER
    entries = [e for e in got.logprobs.content if e.token not in EOS]
    assert len(entries) > len(ANSWER.split()) + 4  # several tokens no whole character
    assert b"".join(bytes(e.bytes) for e in entries) == ANSWER.encode()
    for e in entries + [t for e in entries for t in e.top_logprobs]:  # a name that is its bytes, or says them
        assert e.token.encode() == bytes(e.bytes) or e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)
    assert all(len({t.token for t in e.top_logprobs}) == 3 for e in entries)
    streamed = [e for c in client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=3,
                                                          stream=True, **ask())
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in got.logprobs.content]
    assert engine_settled(service)


def token_bytes(token: str) -> bytes:
    """A completions token's bytes: its text, or the bytes a `bytes:\\x..` name spells."""
    return bytes.fromhex(token[6:].replace("\\x", "")) if token.startswith("bytes:") else token.encode()


def test_completion_logprobs_keep_every_alternative_and_offsets_inside_the_text(served):
    client, service = served
    got = client.completions.create(prompt="Emoji:", logprobs=2, **ask()).choices[0]
    assert got.text == ANSWER
    lp = got.logprobs
    assert all(len(top) >= 2 for top in lp.top_logprobs)  # (distinct byte tokens once shared the key "\ufffd")
    pieces = [token_bytes(t) for t in lp.tokens]
    assert b"".join(pieces[:-1]) == ANSWER.encode() and lp.tokens[-1] in EOS
    before = [b"".join(pieces[:i]).decode(errors="ignore") for i in range(len(pieces))]  # the whole characters
    assert lp.text_offset == [len(b) for b in before] and max(lp.text_offset) <= len(ANSWER)
    offsets = [o for c in client.completions.create(prompt="Emoji:", logprobs=2, stream=True, **ask())
               if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    assert engine_settled(service)


def counts(pieces: list[bytes], stop: str) -> tuple[int, int]:
    """(tokens shown, tokens generated) of an answer of these tokens cut at `stop`: the fewest whose text starts with
    the text before it, the fewest whose text holds it."""
    upto = [b"".join(pieces[:n]) for n in range(len(pieces) + 1)]
    kept = ANSWER[: ANSWER.index(stop)].encode()
    return (next(n for n, b in enumerate(upto) if b.startswith(kept)),
            next(n for n, b in enumerate(upto) if stop.encode() in b))


@pytest.mark.parametrize("stop", ["🎉", "語 ✓", " ✓ d"])
def test_a_stop_string_over_several_tokens_leaves_logprobs_for_the_tokens_shown(served, stop):
    """usage counts the stop string's tokens (generated, their text trimmed); logprobs cover the tokens shown."""
    client, service = served
    want = ANSWER[: ANSWER.index(stop)]
    full = client.completions.create(prompt="Emoji:", logprobs=1, **ask()).choices[0].logprobs.tokens
    shown, generated = counts([token_bytes(t) for t in full], stop)
    assert shown < generated
    got = client.completions.create(prompt="Emoji:", logprobs=1, stop=[stop], **ask())
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    assert (len(got.choices[0].logprobs.tokens), got.usage.completion_tokens) == (shown, generated)
    messages = [{"role": "user", "content": "Emoji?"}]
    full = client.chat.completions.create(messages=messages, logprobs=True, **ask()).choices[0].logprobs.content
    chat = client.chat.completions.create(messages=messages, logprobs=True, stop=stop, **ask())
    assert chat.choices[0].message.content == want
    assert (len(chat.choices[0].logprobs.content), chat.usage.completion_tokens) == counts(
        [bytes(e.bytes) for e in full], stop)
    text, tokens, usage = "", 0, None
    for c in client.completions.create(prompt="Emoji:", logprobs=1, stop=[stop], stream=True,
                                       stream_options={"include_usage": True}, **ask()):
        usage = c.usage.completion_tokens if c.usage else usage
        for choice in c.choices:
            text += choice.text
            tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
    assert (text, tokens, usage) == (want, shown, generated)
    assert engine_settled(service)


def test_top_logprobs_out_of_range_names_its_field(served):
    client = served[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21,
                                       **ask())
    assert e.value.body["param"] == "top_logprobs"
