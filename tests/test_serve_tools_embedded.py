"""Forced and `auto` tool calls on the embedded model (slow): a forced call ends within 64 tokens holding only the
keys its function declares, for several shapes of parameters; `auto` through `fastspec serve` with `<tool_call>` as
a special token (a Hermes template) parses, fits and equals target-only decoding under the same grammar."""

from __future__ import annotations

import json

import openai
import pytest
from serve_helpers import engine_settled
from tool_helpers import NAMED

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.serve.tools import parse_output, parse_tools

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


CITY = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_on_the_embedded_model_end_and_hold_only_declared_keys(choice):
    """A reported example: get_weather(city) without additionalProperties. The forced call ends (EOS) within 64
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
    assert fits(json.loads(calls[0].arguments), CITY["function"]["parameters"]), calls  # city given, a string


HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.first and tools %}Tools: {{ tools | tojson }} "
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n{% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def served_marked(embedded_dir, tmp_path_factory):
    """The embedded model behind `fastspec serve` (EAGLE-3, its shipped head), its tokenizer with `<tool_call>` and
    `</tool_call>` as special tokens (two unused special tokens renamed, as Qwen's tokenizer has them), a Hermes
    tools template."""
    import threading
    import time

    from fastspec.models.embedded import DEFAULT_MODEL, embedded_head
    from fastspec.serve import bind, make_server

    model = tmp_path_factory.mktemp("marked") / "smollm2"
    model.mkdir()
    for f in embedded_dir.iterdir():
        if f.name not in ("tokenizer.json", "generation_config.json"):
            (model / f.name).symlink_to(f)
    text = (embedded_dir / "tokenizer.json").read_text()
    assert text.count('"<reponame>"') == 2 and text.count('"<file_sep>"') == 2  # added token and vocab entry
    (model / "tokenizer.json").write_text(text.replace('"<reponame>"', '"<tool_call>"').replace(
        '"<file_sep>"', '"</tool_call>"'))
    marks = {json.loads(text)["model"]["vocab"][t] for t in ("<reponame>", "<file_sep>")}
    generation = json.loads((embedded_dir / "generation_config.json").read_text())  # (llama.cpp ends on FIM tokens:
    generation["eos_token_id"] = [i for i in generation["eos_token_id"] if i not in marks]  # not as tool marks)
    (model / "generation_config.json").write_text(json.dumps(generation))
    (model / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    llm = fastspec.LLM(str(model), speculative_algorithm="EAGLE3", draft_model=str(embedded_head(DEFAULT_MODEL)),
                       max_total_tokens=4096, speculative_fallback=False)
    sock = bind("127.0.0.1", 0)
    server, service = make_server(llm, "marked", max_queued=8)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % sock.getsockname()[1], api_key="none",
                           max_retries=0, timeout=120)
    yield client, llm, service
    server.should_exit = True
    thread.join(10)
    service.stop()


@pytest.mark.slow
def test_auto_calls_on_the_embedded_model_parse_fit_and_equal_target_only(served_marked):
    """tool_choice auto: free text stays text; where the model opens a call (pushed here by a logit bias on the
    `<tool_call>` token, which a 135M model never writes on its own) the lazy grammar holds the rest to the
    schema, so the call parses with only declared keys and ends; parallel_tool_calls false: one call. The
    streamed deltas join to the same call, and EAGLE-3 equals target-only under the same grammar."""
    client, llm, service = served_marked
    opening = llm.tokenizer.token_to_id("<tool_call>")
    ask = dict(model="marked", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[CITY], tool_choice="auto", max_tokens=64, temperature=0)
    text = client.chat.completions.create(**ask).choices[0]
    assert text.message.tool_calls is None and text.message.content and "<tool_call>" not in text.message.content
    pushed = ask | {"parallel_tool_calls": False, "logit_bias": {str(opening): 100}}
    got = client.chat.completions.create(**pushed).choices[0]
    assert got.finish_reason == "tool_calls", got
    calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert fits(json.loads(calls[0][1]), CITY["function"]["parameters"]), calls  # city given, a string
    streamed, content = {}, ""
    for chunk in client.chat.completions.create(stream=True, **pushed):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                name, args = streamed.get(d.index, ("", ""))
                streamed[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
    assert [streamed[i] for i in sorted(streamed)] == calls and content.strip() == (got.message.content or "")
    tools = parse_tools({"tools": [CITY], "parallel_tool_calls": False})
    params = SamplingParams(max_new_tokens=64, logit_bias={opening: 100},
                            lark=tools.auto_grammar("hermes", llm.tokenizer.special_tokens()))
    ids = llm.encode_chat(ask["messages"], [CITY])
    assert engine_settled(service)
    service.stop()  # (a served LLM runs no direct call: it does once its server has stopped)
    plain = fastspec.LLM(str(llm.engine.model_dir), speculative_algorithm="NONE", max_total_tokens=4096)
    want, spoken = (x.generate([ids], params)[0] for x in (plain, llm))
    assert spoken.output_ids == want.output_ids and want.output_ids[0] == opening


def _function(name: str, parameters: dict, strict: bool = False) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters} | ({"strict": True} if strict
                                                                                         else {})}


SHAPES = {
    "nested": _function("book_trip", {"type": "object", "properties": {"city": {"type": "string"}, "dates": {
        "type": "object", "properties": {"start": {"type": "string", "format": "date"},
                                         "end": {"type": "string", "format": "date"}}, "required": ["start"]}},
        "required": ["city", "dates"]}),
    "array": _function("add_stops", {"type": "object", "properties": {"stops": {"type": "array", "items": {
        "type": "string"}, "maxItems": 4}}, "required": ["stops"]}),
    "enum": _function("set_units", {"type": "object", "properties": {"units": {"enum": ["celsius", "fahrenheit"]}},
                                    "required": ["units"]}),
    "optional": _function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}, "days": {
        "type": "integer"}, "hourly": {"type": "boolean"}}, "required": ["city"]}),
    "strict": _function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}, "country": {
        "type": "string"}}}, strict=True),
}


def fits(value, schema: dict) -> bool:
    """`value` matches `schema` as a forced call must: objects hold declared keys only and every required one."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = props.keys() if schema.get("strict") else schema.get("required", [])
        return (isinstance(value, dict) and set(value) <= set(props) and set(required) <= set(value)
                and all(fits(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)) and all(
            fits(v, schema.get("items", {})) for v in value)
    return {"string": str, "integer": int, "boolean": bool}.get(kind, object) is type(value) or kind is None


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_forced_calls_of_several_shapes_end_within_64_tokens_and_fit(shape):
    """Nested objects, arrays, enums, optional keys and `strict`, `required` and named, on the embedded model: every
    forced call ends (EOS) within 64 tokens, and its arguments fit the function (only declared keys, the required
    ones there, strict: all of them). `required` with parallel_tool_calls false: free to, the 135M model repeats
    its call until the budget ends."""
    function = SHAPES[shape]
    schema = function["function"]["parameters"] | {"strict": function["function"].get("strict", False)}
    llm = fastspec.LLM(speculative_algorithm="NONE", max_total_tokens=4096)
    ids = llm.encode_chat([{"role": "user", "content": "Plan a trip to Paris and tell me the weather there."}],
                          [function])
    for choice in ("required", {"type": "function", "function": {"name": function["function"]["name"]}}):
        tools = parse_tools({"tools": [function], "tool_choice": choice, "parallel_tool_calls": False})
        out = llm.generate([ids], SamplingParams(max_new_tokens=64, json_schema=tools.grammar()))[0]
        assert out.finish_reason == "stop", (choice, out.text)
        content, calls = parse_output(out.text, tools, "hermes")
        assert content is None and calls and all(c.name == function["function"]["name"] for c in calls)
        assert all(fits(json.loads(c.arguments), schema) for c in calls), out.text
