"""Every tool-call format streamed against its finished answer: fed token by token (the embedded model's tokenizer,
the formats' markers added as special tokens, through the server's incremental detokenizer), several tokens at a
time (a speculative round's burst), a character at a time and in random pieces, the content and call deltas join
to exactly the finished answer's content and calls (`parse_output`), whether a grammar held the answer to its
format or it is free text (the request brought its own response_format / regex / ebnf). The answers are
well-formed ones and ones that open a call by a known function's name and then fail to be one; from free text
those are content, and no call delta is sent for them."""

from __future__ import annotations

import random
import shutil
from dataclasses import replace

import pytest
from test_serve_tools import TIME, WEATHER

from fastspec.serve.tool_formats import FORMATS
from fastspec.serve.tool_stream import ToolStream
from fastspec.serve.tools import parse_output, parse_tools
from fastspec.text.detokenizer import IncrementalDetokenizer

HELD = parse_tools({"tools": [WEATHER, TIME]})
FREE = replace(HELD, held=False)
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
DS_END = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"

WELL_FORMED = {  # per format: answers a grammar could have written (or plain text)
    "hermes": ['Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
               '\n<tool_call>{"name": "get_time"}</tool_call>\n', "No call here, a < b."],
    "llama3": ['<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; {"name": "get_weather", '
               '"parameters": {"city": "Rome", "days": 1}}', '  {"name": "get_time", "parameters": {}}', "Sure {x}"],
    "mistral": ['Right. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}]',
                '[TOOL_CALLS]get_time[ARGS]{"zone": "cet"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 1}'],
    "pythonic": ["[get_weather(city='Oslo', days=3), get_time(zone=\"utc\")]", ' [get_time(zone="a)b")]',
                 "Lists look like [1, 2]"],
    "deepseek_v3": [f'Ok{DS}get_time\n```json\n{{"zone": "utc"}}\n```{DS_END}', "plain"],
}

MALFORMED = {  # per format: answers that open a call by a known name and then are not one
    "hermes": ['<tool_call>{"name": "get_time", "arguments": {"zone": utc}}</tool_call>',  # not a JSON literal
               'Hm <tool_call>{"name": "get_time", "arguments": {"zone": "utc"',  # unclosed
               '<tool_call>{"name": "get_time" garbage</tool_call> after',
               '<tool_call>{"name": "get_time", "arguments": {"zone": "utc", 7}}</tool_call>',  # breaks midway
               '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}} and text',  # no </tool_call>
               '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call>',  # a string
               '<tool_call>{"name": "get_time", "name": "get_weather", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call><tool_call>{"name": "get_'
               'weather", "arguments": {"city": "Os'],  # a whole call, then one cut off
    "llama3": ['{"name": "get_time", "parameters": {"zone": utc}}', '{"name": "get_time", "parameters": {"zone": "u',
               '<|python_tag|>{"name": "get_time" garbage', '{"name": "get_time", "parameters": {"zone": "utc", 7}}',
               '{"name": "get_time", "parameters": {"zone": "utc"}} and text',
               '{"name": "get_time", "parameters": {"zone": "utc"}}; {"name": "get_weather", "parameters": {"c": x}}'],
    "mistral": ['[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": utc}}]',
                'Sure [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"',
                '[TOOL_CALLS][{"name": "get_time" garbage]', '[TOOL_CALLS][{"name": "get_time", "arguments": 5}]',
                '[TOOL_CALLS]get_time then free text', '[TOOL_CALLS]get_time[ARGS]{"zone": utc}',
                '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"', '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"} trailing',
                '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}[TOOL_CALLS]get_weather[ARGS]{"city": }',
                '[TOOL_CALLS]get_time[ARGS]'],
    "pythonic": ["[get_time(zone=utc)]", "[get_time(zone='utc'", "[get_time garbage]", '[get_time("utc")]',
                 '[get_time(zone="utc"), get_weather(city=Oslo)]', '[get_time(zone="utc")] trailing',
                 '[get_time(zone="utc")', "[get_time(**{'zone': 'utc'})]"],
    "deepseek_v3": [f'{DS}get_time\n```json\n{{"zone": utc}}\n```{DS_END}', f'{DS}get_time\n```json\n{{"zone": "u',
                    f"{DS}get_time garbage", "Hi<｜tool▁calls▁begin｜> and then prose",
                    f'{DS}get_time\n{{"zone": "utc"}}{DS_END}',  # no ```json fence
                    f'{DS}get_time\n```json\n{{"zone": "utc"}}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
                    f'<｜tool▁sep｜>get_weather\n```json\n{{"city": 1,}}\n```{DS_END}'],
}
ODD = ['<tool_call>{"name": "get_\ntime", "arguments": {}}</tool_call>',  # a raw newline in a JSON string
       '{"name": "get_\\qtime", "parameters": {"zone": "\\q"}}']  # bad escapes
ALL = [text for answers in (WELL_FORMED, MALFORMED) for texts in answers.values() for text in texts] + ODD


@pytest.fixture(scope="module")
def tokenizer(embedded_dir, tmp_path_factory):
    """The embedded model's tokenizer with every format's markers as special tokens (as real tokenizers have them)."""
    from tokenizers import Tokenizer as RustTokenizer

    from fastspec.text.tokenizer import Tokenizer

    model = tmp_path_factory.mktemp("markers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, model / name)
    rust = RustTokenizer.from_file(str(model / "tokenizer.json"))
    rust.add_special_tokens(sorted({m for _, _, markers in FORMATS.values() for m in markers}))
    rust.save(str(model / "tokenizer.json"))
    return Tokenizer(model)


def token_prefixes(tok, text: str, burst: int) -> list[str]:
    """The answer's text as the server sees it grow: its tokens `burst` at a time through the incremental
    detokenizer (special tokens kept), then its finish."""
    ids = tok.encode(text, add_special_tokens=False)
    detok, prefixes, sent = IncrementalDetokenizer(tok, None, (), skip_special_tokens=False), [], ""
    for k in range(0, len(ids), burst):
        sent += detok.add(ids[k:k + burst])
        prefixes.append(sent)
    prefixes.append(sent + detok.finish())
    assert prefixes[-1] == text  # the markers are whole tokens and the text round-trips
    return prefixes


def cut_prefixes(text: str, cuts) -> list[str]:
    return [text[:end] for end in sorted(set(cuts) | {len(text)}) if end > 0] or [text]


def streamed(prefixes: list[str], tools, parser: str) -> tuple[str, list[tuple[str, str]]]:
    """What a stream fed these prefixes of an answer (the last one finished) sent, joined: (content, calls)."""
    stream, content, calls = ToolStream(tools, parser), "", {}
    for k, text in enumerate(prefixes):
        piece, deltas = stream.feed(text, k == len(prefixes) - 1)
        content += piece
        for d in deltas:
            assert (d.name is not None) == (d.index not in calls) == ("id" in d.as_dict())  # id and name come first
            assert d.index == len(calls) or d.index in calls  # calls are sent in order
            name, arguments = calls.get(d.index, (d.name, ""))
            calls[d.index] = (name, arguments + d.arguments)
    return content, [calls[i] for i in sorted(calls)]


def finished(text: str, tools, parser: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_output(text, tools, parser)
    return content or "", [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("tools", [HELD, FREE], ids=["held", "free-text"])
@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_streamed_deltas_join_to_the_finished_answer_however_it_arrives(tokenizer, parser, tools):
    """Every answer (each format's, read by every parser) in every chunking: the stream sends exactly the finished
    answer, never a call that the finished answer does not have nor content it does not have."""
    rng = random.Random(0)
    for text in ALL:
        want = finished(text, tools, parser)
        chunkings = [token_prefixes(tokenizer, text, 1), token_prefixes(tokenizer, text, 4),
                     cut_prefixes(text, range(1, len(text)))]
        chunkings += [cut_prefixes(text, rng.sample(range(1, len(text)), min(len(text) - 1, 5))) for _ in range(3)]
        for prefixes in chunkings:
            assert streamed(prefixes, tools, parser) == want, (text, prefixes)


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_free_text_is_calls_only_where_it_is_whole_calls(parser):
    """From free text a well-formed answer reads as it does held to its format, and one that opens a call by a
    known name and then is not one is all content; the pythonic answer with a bare name is content either way."""
    for text in WELL_FORMED[parser]:
        assert finished(text, FREE, parser) == finished(text, HELD, parser), text
    for text in MALFORMED[parser]:
        if parser == "hermes" and text.startswith('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}<'):
            assert finished(text, FREE, parser) == (text[text.index("</tool_call>") + 12:],
                                                    [("get_time", '{"zone": "utc"}')])  # blocks stand alone
            continue
        assert finished(text, FREE, parser) == (text, []), text
    assert finished("[get_time(zone=utc)]", HELD, "pythonic") == ("[get_time(zone=utc)]", [])
