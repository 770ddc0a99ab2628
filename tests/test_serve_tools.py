"""Tool calls through `fastspec serve` with the official openai client: `required` and named choices always parse
and match their function's schema, and equal target-only decoding under the same grammar (the server speculates
with EAGLE-3); streamed tool-call deltas join to the non-streamed call; `auto` answers in text; tool messages are
taken back; bad tools are OpenAI 400s. The Hermes and Llama-3 formats parsed from hand-written answers."""

from __future__ import annotations

import json

import openai
import pytest
from test_serve import MODEL, engine_settled, served  # noqa: F401  (the served fixture: serial and overlap)

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.serve.errors import APIError
from fastspec.serve.tools import close_objects, hold_back, parse_output, parse_tools

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def matches(name: str, arguments: str) -> bool:
    """`arguments` (JSON text) valid under `name`'s schema above, checked by hand."""
    args = json.loads(arguments)
    if name == "get_time":
        return args.keys() == {"zone"} and args["zone"] in ("utc", "cet")
    return (name == "get_weather" and args.keys() == {"city", "days"} and isinstance(args["city"], str)
            and len(args["city"]) <= 6 and type(args["days"]) is int and 1 <= args["days"] <= 7)


def target_only(llm, tools: list[dict], choice) -> str:
    """The answer of target-only decoding (no speculation) under the grammar the choice implies."""
    parsed = parse_tools({"tools": tools, "tool_choice": choice})
    plain = fastspec.LLM(str(llm.engine.model_dir), speculative_algorithm="NONE", max_total_tokens=2048)
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
    if choice == NAMED:  # the arguments stream as they are generated, not in one piece at the end
        assert pieces > 1
    assert engine_settled(service)


def test_auto_answers_in_text_and_tool_messages_are_taken_back(served):
    client, _, _, service = served
    ask = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=12, temperature=0)
    got = client.chat.completions.create(**ask).choices[0]
    assert got.message.tool_calls is None and got.message.content  # a random model writes no <tool_call>
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **ask)
                       if c.choices)
    assert streamed == got.message.content
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.chat.completions.create(**(ask | {"messages": history})).choices[0].message.content
    assert client.chat.completions.create(**(ask | {"tool_choice": "none"})).choices[0].message.content
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


def test_hermes_and_llama3_answers_parse_into_calls():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    hermes = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
              '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>')
    content, calls = parse_output(hermes, tools, "hermes")
    assert content == "Let me check. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "utc"})]
    assert parse_output("<tool_call>{not json}</tool_call>", tools, "hermes") == (
        "<tool_call>{not json}</tool_call>", [])  # what does not parse stays content
    llama = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; {"name": "get_weather", ' \
            '"parameters": {"city": "Rome", "days": 1}}'
    content, calls = parse_output(llama, tools, "llama3")
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_output('{"name": "unknown", "parameters": {}}', tools, "llama3")[1] == []
    # streaming holds back what may become a call: from "<tool_call>", or a prefix of it at the end
    assert hold_back("Let me check. <tool", tools, "hermes") == len("Let me check. ")
    assert hold_back("Let me check. <tool_call>{", tools, "hermes") == len("Let me check. ")
    assert hold_back("a < b", tools, "hermes") == len("a < b")
    assert hold_back(' {"name"', tools, "llama3") == 0 and hold_back("Sure", tools, "llama3") == 4


def test_the_chat_template_sees_the_tools_and_earlier_calls(tmp_path):
    """The tools reach the template as transformers passes them (`tools`: the function dicts), an assistant turn's
    calls with their arguments as a dict; the template's own format picks the parser."""
    from tiny_models import write_chat_target

    from fastspec.serve.protocol import parse_request
    from fastspec.serve.tools import template_parser
    from fastspec.text.tokenizer import Tokenizer

    target = write_chat_target(tmp_path / "target")
    (target / "chat_template.jinja").write_text(
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %};{% endfor %}")
    body = {"model": "m", "tools": [WEATHER, TIME], "messages": MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}
    parsed = parse_request(body, True, "m")
    text = Tokenizer(target).apply_chat_template(parsed.messages, tools=list(parsed.tools.functions))
    assert text == "[get_weather][get_time]user:Weather in Oslo?;assistant:get_weather(Oslo);tool:sunny;"
    assert template_parser("{{ '<|python_tag|>' }}") == "llama3" and template_parser("<tool_call>") == "hermes"


def test_forced_call_schemas_close_their_objects_and_strict_requires_every_property():
    nested = {"type": "object", "properties": {
        "city": {"type": "string"}, "when": {"type": "object", "properties": {"day": {"enum": ["mon", "tue"]}}},
        "stops": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}}}, "required": ["city"]}
    original = json.dumps(nested)
    closed = close_objects(nested)
    assert json.dumps(nested) == original  # a copy: the template still sees the function as given
    assert closed["additionalProperties"] is False and closed["required"] == ["city"]
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert closed["properties"]["stops"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}  # says otherwise: kept
    strict = close_objects({k: v for k, v in nested.items()} | {"properties": {
        k: v for k, v in nested["properties"].items() if k != "extra"}}, strict=True)
    assert strict["required"] == ["city", "when", "stops"] and strict["properties"]["when"]["required"] == ["day"]
    with pytest.raises(ValueError, match="parameters.extra allows keys"):
        close_objects(nested, strict=True)
    ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}  # no arguments: only {}
    assert parse_tools({"tools": [ping]}).schemas["ping"] == {"type": "object", "properties": {},
                                                              "additionalProperties": False}
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(tools.grammar())["maxItems"] == 1
    assert "maxItems" not in json.loads(parse_tools({"tools": [WEATHER], "tool_choice": "required"}).grammar())
    with pytest.raises(APIError, match="parallel_tool_calls must be a boolean"):
        parse_tools({"tools": [WEATHER], "parallel_tool_calls": "yes"})


CITY = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_on_the_embedded_model_end_and_hold_only_declared_keys(choice):
    """Issue 36's example: get_weather(city) without additionalProperties. The forced call ends (EOS) within 64
    tokens with only the declared key, and speculative (EAGLE-3) decoding equals target-only under the grammar."""
    tools = parse_tools({"tools": [CITY], "tool_choice": choice})
    params = SamplingParams(max_new_tokens=64, json_schema=tools.grammar())
    answers = []
    for algorithm in ("EAGLE3", "NONE"):
        llm = fastspec.LLM(speculative_algorithm=algorithm, max_total_tokens=4096, speculative_fallback=False)
        ids = llm.encode_chat([{"role": "user", "content": "What is the weather in Paris?"}], [CITY])
        answers.append(llm.generate([ids], params)[0])
    assert answers[0].output_ids == answers[1].output_ids
    out = answers[0]
    assert out.finish_reason == "stop", out.text
    content, calls = parse_output(out.text, tools, "hermes")
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert set(json.loads(calls[0].arguments)) <= {"city"}
