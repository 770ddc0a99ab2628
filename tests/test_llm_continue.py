"""A chat's last message continued (continue_final_message, vLLM's LLM.chat keyword, in LLM.chat and serve) as
transformers templates it, and a completion's text written as its stream shows it, after the prompt's words.
(test_llm_inputs.py: the checkpoint and the word-level tokenizer these tests share.)"""

import json

import pytest
from serve_helpers import raw, start_server
from test_llm_inputs import PARAMS, TEMPLATE, bare_dir, bare_llm, words_dir, words_llm  # noqa: F401  (fixtures)
from tiny_models import write_word_tokenizer
from tokenizers import Tokenizer

from fastspec import SamplingParams
from fastspec.errors import FastspecError
from fastspec.text.tokenizer import Tokenizer as FastTokenizer


CONVERSATIONS = [[{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5 w6"}],
                 [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w5 w6 "}],  # (seen before)
                 [{"role": "user", "content": "w7"}]]


def transformers_template(directory, template: str, messages: list[dict], **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), chat_template=template)
    return theirs.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_continues_the_final_message_as_transformers_templates_it(bare_llm, words_llm, words_dir, tmp_path):
    """continue_final_message (vLLM's LLM.chat keyword): the prompt is transformers' apply_chat_template(...,
    continue_final_message=True) text, which ends inside the last message (no end of turn, no new turn), also where
    that text appeared before and where the template trims it; the answer is the model's for those ids.
    add_generation_prompt=False alone ends after the last turn. Both at once, or a template that does not show the
    content, are one-line refusals; the caller's messages are left as they were."""
    theirs = Tokenizer.from_file(str(words_dir / "tokenizer.json"))
    for messages in CONVERSATIONS:
        text = transformers_template(words_dir, TEMPLATE, messages, continue_final_message=True,
                                     add_generation_prompt=False)
        assert words_llm.tokenizer.apply_chat_template(messages, continue_final_message=True) == text
        ids = theirs.encode(text, add_special_tokens=False).ids
        for kwargs in ({}, {"add_generation_prompt": False}):
            got = words_llm.chat(messages, PARAMS, continue_final_message=True, **kwargs)[0]
            assert got.prompt_ids == ids and got.output_ids == bare_llm.generate([ids], PARAMS)[0].output_ids
        ended = transformers_template(words_dir, TEMPLATE, messages, add_generation_prompt=False)
        assert words_llm.encode_chat(messages, add_generation_prompt=False) == theirs.encode(
            ended, add_special_tokens=False).ids
    assert words_llm.encode_chat(CONVERSATIONS[0])[-1] == 91  # (by default: a new assistant turn, <bot>)
    trimmed = "{% for m in messages %}<user> {{ m.content | trim }}</s>{% endfor %}"
    directory = write_word_tokenizer(tmp_path / "trimmed", template=trimmed)
    assert (FastTokenizer(directory).apply_chat_template(CONVERSATIONS[1], continue_final_message=True)
            == transformers_template(directory, trimmed, CONVERSATIONS[1], continue_final_message=True,
                                     add_generation_prompt=False) == "<user> w5 w6</s><user> w5 w6")
    original = [dict(m) for m in CONVERSATIONS[0]]
    with pytest.raises(FastspecError, match="^continue_final_message continues the last message, "
                                            "add_generation_prompt starts a new one: give add_generation_prompt=False"):
        words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True, add_generation_prompt=True)
    hidden = write_word_tokenizer(tmp_path / "hidden", template="{% for m in messages %}<user>{% endfor %}")
    with pytest.raises(FastspecError, match="^continue_final_message: the chat template does not show the last "):
        FastTokenizer(hidden).apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    assert CONVERSATIONS[0] == original


def test_serve_takes_continue_final_message(words_llm):
    """vLLM's chat-completion extras continue_final_message and add_generation_prompt: the answer is LLM.chat's
    continuation of the last message; a wrong type or both set is a 400 naming them."""
    expected = words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True)[0]
    streamed = "".join(d.text for step in words_llm.stream([expected.prompt_ids], PARAMS) for d in step)
    assert streamed == expected.text
    server, thread, service, url, _ = start_server(words_llm, "words", max_queued=8)
    try:
        body = {"messages": CONVERSATIONS[0], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        continued = {"continue_final_message": True}
        for extra in (continued, continued | {"add_generation_prompt": False}):
            status, data = raw(url, "POST", "/v1/chat/completions", json.dumps(body | extra).encode())
            assert status == 200, data
            assert data["choices"][0]["message"]["content"] == expected.text
            assert data["usage"]["prompt_tokens"] == len(expected.prompt_ids)
        for extra, message, param in (
                ({"continue_final_message": "yes"}, "continue_final_message must be of type bool",
                 "continue_final_message"),
                ({"continue_final_message": True, "add_generation_prompt": True},
                 "continue_final_message continues the last message, add_generation_prompt starts",
                 "add_generation_prompt"),
                ({"messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": [
                    {"type": "text", "text": "w4"}]}], "continue_final_message": True}, None, None)):
            status, data = raw(url, "POST", "/v1/chat/completions", json.dumps(body | extra).encode())
            if message is None:  # (serve joins text parts: a continued message of parts is continued as its text)
                assert status == 200, data
                continue
            assert status == 400 and data["error"]["message"].startswith(message), data
            assert data["error"]["param"] == param, data
    finally:
        server.should_exit = True
        thread.join(10)
        service.stop()


def test_generate_writes_the_text_a_stream_shows_with_or_without_stop_strings(words_llm, words_dir):
    """A completion's text is its tokens decoded after the prompt's, as stream, serve and generate with stop strings
    write it: a word-level tokenizer (as SentencePiece's) writes the space before the first word, so a continued
    message's content + the answer's text is the message continued (generate without stop strings decoded the output
    alone: 'w12 ...' where its stream said ' w12 ...')."""
    theirs = Tokenizer.from_file(str(words_dir / "tokenizer.json"))
    never = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=("w999",))
    plain = words_llm.generate("w3 w4 w5 w6", PARAMS)[0]
    streamed = "".join(d.text for step in words_llm.stream("w3 w4 w5 w6", PARAMS) for d in step)
    assert plain.text == words_llm.generate("w3 w4 w5 w6", never)[0].text == streamed
    assert plain.text == " " + theirs.decode(plain.output_ids)
    content = CONVERSATIONS[0][-1]["content"]
    continued = words_llm.chat(CONVERSATIONS[0], PARAMS, continue_final_message=True)[0]
    assert content + continued.text == theirs.decode(theirs.encode(content).ids + continued.output_ids)
