"""Tool calls through `fastspec serve` with the official openai client: `required` and named choices always parse
and match their function's schema, and equal target-only decoding under the same grammar (the server speculates
with EAGLE-3); streamed tool-call deltas join to the non-streamed call; `auto` answers in text, and a call it opens
is held to the schema by the format's lazy grammar; the tools, earlier calls and tool messages reach the chat
template (no tools under `none`); with a request's own regex, EAGLE-3's bursts stream to exactly the non-streamed
answer, and a call that is not one is content; bad tools are OpenAI 400s. (The formats without a server:
test_serve_tool_formats.py; on the embedded model: test_serve_tools_embedded.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from serve_helpers import MODEL, engine_settled, served  # noqa: F401  (the served fixture: serial and overlap)
from tool_helpers import MESSAGES, NAMED, TIME, WEATHER

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.serve.tools import parse_tools, writes_spaces
from fastspec.text.tokenizer import Tokenizer

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def matches(name: str, arguments: str) -> bool:
    """`arguments` (JSON text) valid under `name`'s schema (tool_helpers' WEATHER, TIME), checked by hand."""
    args = json.loads(arguments)
    if name == "get_time":
        return args.keys() == {"zone"} and args["zone"] in ("utc", "cet")
    return (name == "get_weather" and args.keys() == {"city", "days"} and isinstance(args["city"], str)
            and len(args["city"]) <= 6 and type(args["days"]) is int and 1 <= args["days"] <= 7)


def target_only(llm, tools: list[dict], choice) -> str:
    """The answer of target-only decoding (no speculation) under the grammar the choice implies."""
    plain = fastspec.LLM(str(llm.engine.model_dir), speculative_algorithm="NONE", max_total_tokens=2048)
    parsed = replace(parse_tools({"tools": tools, "tool_choice": choice}), spaced=writes_spaces(plain.tokenizer))
    ids = plain.encode_chat(MESSAGES, tools)
    return plain.generate([ids], SamplingParams(max_new_tokens=200, json_schema=parsed.grammar()))[0].text


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_parse_match_their_schema_and_equal_target_only_decoding(served, choice):
    client, _, llm, service = served
    ask = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200,
               temperature=0)
    got = client.chat.completions.create(**ask).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls]
    assert calls and all(matches(*c) for c in calls) and all(c.id.startswith("call_") for c in got.message.tool_calls)
    answer = json.loads(target_only(llm, [WEATHER, TIME], choice))
    want = [("get_weather", answer)] if choice == NAMED else [(c["name"], c["parameters"]) for c in answer]
    assert [(name, json.loads(args)) for name, args in calls] == want
    streamed, reasons, pieces = {}, [], 0
    for chunk in client.chat.completions.create(stream=True, **ask):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                name, args = streamed.get(d.index, ("", ""))
                streamed[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
                assert (d.id is not None) == (name == "")  # the id with the call's first delta only
                pieces += 1
    assert [streamed[i] for i in sorted(streamed)] == calls and reasons[-1] == "tool_calls"
    assert pieces > len(calls)  # the arguments stream as they are generated, not in one piece per call
    assert engine_settled(service)


TOOLS_TEMPLATE = (  # writes the tools it is given and every message's calls, as a tools template does (briefly:
    #                 the tiny served model's context is 256 tokens)
    "{% for t in tools or [] %}[{{ t.function.name }}: {{ t.function.description }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}>"
    "{% endfor %}")


class RenderingTokenizer(Tokenizer):
    """A model's tokenizer with TOOLS_TEMPLATE, keeping every prompt it renders (what the chat template saw)."""

    def __init__(self, model_dir, tmp_path):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name).symlink_to(model_dir / name)
        (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
        super().__init__(tmp_path)
        self.prompts: list[str] = []

    def apply_chat_template(self, *args, **kwargs) -> str:
        self.prompts.append(super().apply_chat_template(*args, **kwargs))
        return self.prompts[-1]


def test_auto_answers_in_text_and_tool_messages_are_taken_back(served, monkeypatch, tmp_path):
    """`auto` answers in text; the tools reach the chat template, and earlier calls and their results with them;
    under tool_choice none the template sees no tools."""
    client, _, llm, service = served
    tok = RenderingTokenizer(llm.engine.model_dir, tmp_path)
    monkeypatch.setattr(llm, "tokenizer", tok)
    ask = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=12, temperature=0)
    got = client.chat.completions.create(**ask).choices[0]
    assert got.message.tool_calls is None and got.message.content  # a random model writes no <tool_call>
    assert tok.prompts[-1] == "[get_weather: Weather by city.]<user:Weather in Oslo?>"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **ask)
                       if c.choices)
    assert streamed == got.message.content
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.chat.completions.create(**(ask | {"messages": history})).choices[0].message.content
    assert tok.prompts[-1].endswith('<assistant:CALL:get_weather{"city": "Oslo", "days": 1}><tool:sunny>')
    assert client.chat.completions.create(**(ask | {"tool_choice": "none"})).choices[0].message.content
    assert tok.prompts[-1] == "<user:Weather in Oslo?>"  # no tools offered: the template is given none
    assert engine_settled(service)


def forcing(text: str) -> str:
    """A regex that matches `text` alone."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


FORCED = {  # per format: (an answer with a call after free text, one that opens a call and is not one); no spaces
    "hermes": ('Sure!<tool_call>{"name":"get_time","arguments":{"zone":"utc"}}</tool_call>',
               'Sure!<tool_call>{"name":"get_time","arguments":{"zone":utc}}</tool_call>'),
    "pythonic": ('[get_time(zone="cet"),get_weather(city="Oslo",days=2)]', "[get_time(zone=utc)]"),
}


def test_speculative_streams_join_to_the_answer_where_the_request_brings_its_own_grammar(served):
    """A request with tools and its own regex (so no format grammar: calls are read from free text), answered by
    EAGLE-3 several tokens a round: the streamed content and call deltas join to exactly the non-streamed answer,
    the call after free text is one, and an answer that opens a call and is not one is content, with no call
    delta. hermes through the served app, pythonic through an app over the same engine."""
    from starlette.testclient import TestClient

    from fastspec.serve.app import build_app

    client, _, _, service = served
    pythonic = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                             http_client=TestClient(build_app(service, MODEL, "pythonic")))
    for parser, http in (("hermes", client), ("pythonic", pythonic)):
        for text in FORCED[parser]:
            ask = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
                       extra_body={"regex": forcing(text)})
            got = http.chat.completions.create(**ask)
            assert got.model_extra["meta_info"]["spec_accepted_tokens"] > 0  # some rounds gave several tokens
            answer = got.choices[0]
            calls = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or []]
            content, streamed, reasons = "", {}, []
            for chunk in http.chat.completions.create(stream=True, **ask):
                for c in chunk.choices:
                    content, reasons = content + (c.delta.content or ""), reasons + [c.finish_reason]
                    for d in c.delta.tool_calls or []:
                        name, args = streamed.get(d.index, ("", ""))
                        assert (d.id is not None) == (name == "")
                        streamed[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            assert (content, [streamed[i] for i in sorted(streamed)]) == (answer.message.content or "", calls)
            assert reasons[-1] == answer.finish_reason
            if text == FORCED[parser][0]:
                assert answer.message.content == ("Sure!" if parser == "hermes" else None)
                assert answer.finish_reason == "tool_calls" and calls and all(matches(*c) for c in calls)
            else:
                assert (answer.message.content, calls, answer.finish_reason) == (text, [], "stop")
    pythonic.close()
    assert engine_settled(service)


@pytest.mark.parametrize("tools, choice, messages, message", [
    ([{"type": "function", "function": {"description": "no name"}}], None, MESSAGES, "function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}], None, MESSAGES, "tool 'f'"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, MESSAGES, "not among the tools"),
    ([WEATHER], None, MESSAGES + [{"role": "tool", "content": "sunny"}], "tool_call_id"),
    (None, "required", MESSAGES, "tool_choice needs tools"),
    ([{"type": "function", "function": {"name": "g", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "object", "additionalProperties": True}}}}}], None, MESSAGES,
     "tool 'g': strict needs closed objects, but parameters.x allows keys beyond its properties"),
])
def test_bad_tools_are_openai_400s_and_the_server_keeps_serving(served, tools, choice, messages, message):
    client, _, _, service = served
    ask = {"model": MODEL, "messages": messages, "max_tokens": 3}
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**ask, **({"tools": tools} if tools else {}),
                                       **({"tool_choice": choice} if choice else {}))
    assert client.chat.completions.create(**ask | {"messages": MESSAGES}).choices[0].message.content is not None
    assert engine_settled(service)
