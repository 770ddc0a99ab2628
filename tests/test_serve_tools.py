"""Tool calls through `fastspec serve` with the official openai client: `required` and named choices always parse
and match their function's schema, and equal target-only decoding under the same grammar (the server speculates
with EAGLE-3); streamed tool-call deltas join to the non-streamed call; `auto` answers in text, and a call it opens
is held to the schema by the format's lazy grammar; the tools, earlier calls and tool messages reach the chat
template (no tools under `none`); with a request's own regex, EAGLE-3's bursts stream to exactly the non-streamed
answer, and a call that is not one is content; bad tools are OpenAI 400s.
Every format (hermes, llama3, mistral, pythonic, deepseek_v3) parsed and streamed from hand-written answers, and
its lazy grammar checked with text and special-token markers."""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from serve_helpers import MODEL, engine_settled, served  # noqa: F401  (the served fixture: serial and overlap)

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.serve.api_error import APIError
from fastspec.serve.tool_stream import ToolStream
from fastspec.serve.tools import close_objects, parse_output, parse_tools, template_parser, writes_spaces
from fastspec.text.tokenizer import Tokenizer

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


ANSWERS = {  # per format, hand-written answers in it: (text, content, [(name, arguments)])
    "hermes": [('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
                "Let me check. ", [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", '{"zone": "utc"}')]),
               ("<tool_call>{not json}</tool_call> a < b", "<tool_call>{not json}</tool_call> a < b", []),
               ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [])],
    "llama3": [('<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; {"name": "get_weather", '
                '"parameters": {"city": "Rome", "days": 1}}', None,
                [("get_time", '{"zone": "cet"}'), ("get_weather", '{"city": "Rome", "days": 1}')]),
               ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
               ("Sure {x}", "Sure {x}", [])],
    "mistral": [('Right. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}]', "Right. ",
                 [("get_time", '{"zone": "utc"}')]),
                ('[TOOL_CALLS]get_time[ARGS]{"zone": "cet"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 1}',
                 None, [("get_time", '{"zone": "cet"}'), ("get_weather", '{"city": "Oslo", "days": 1}')]),
                ("No [TOOL nothing", "No [TOOL nothing", [])],
    "pythonic": [("[get_weather(city='Oslo', days=3), get_time(zone=\"utc\")]", None,
                  [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", '{"zone": "utc"}')]),
                 ("Lists look like [1, 2]", "Lists look like [1, 2]", [])],
    "deepseek_v3": [("Ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
                     '{"zone": "utc"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Ok", [("get_time", '{"zone": "utc"}')]),
                    ("plain", "plain", [])],
}


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_each_format_parses_and_its_stream_joins_to_exactly_the_answer(parser):
    """Streamed a character at a time and in pieces of 7, content and call deltas join to the finished answer's
    content and calls; nothing of a call is sent as content, a call's name comes before its arguments."""
    tools = parse_tools({"tools": [WEATHER, TIME]})
    for text, content, calls in ANSWERS[parser]:
        got_content, got_calls = parse_output(text, tools, parser)
        assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
        for size in (1, 7):
            stream, sent, streamed = ToolStream(tools, parser), "", {}
            for end in [*range(size, len(text), size), len(text)]:
                piece, deltas = stream.feed(text[:end], end == len(text))
                sent += piece
                for d in deltas:
                    assert (d.name is not None) == (d.index not in streamed)
                    name, args = streamed.get(d.index, (d.name, ""))
                    streamed[d.index] = (name, args + d.arguments)
            assert sent == (content or "")
            assert [streamed[i] for i in sorted(streamed)] == calls
    assert template_parser("{{ '<|python_tag|>' }}") == "llama3" and template_parser("<tool_call>") == "hermes"
    assert template_parser("[TOOL_CALLS]") == "mistral" and template_parser("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert template_parser("[func_name1(params_name1=params_value1)]") == "pythonic"


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-markers"])
def test_auto_grammars_hold_calls_to_their_schemas_and_leave_text_free(embedded_dir, tmp_path, special):
    """Each format's lazy grammar, through the engine's compiler on the embedded model's tokenizer (its markers as
    text, or added as special tokens as real Mistral / Llama / DeepSeek tokenizers have them): free text is
    allowed, an opened call must follow a function's schema (no unknown value, no undeclared key), and
    parallel_tool_calls false ends the answer after one call."""
    import shutil

    from tokenizers import Tokenizer as RustTokenizer

    from fastspec.sampling.grammar import GrammarCompiler
    from fastspec.serve.tool_formats import FORMATS
    from fastspec.text.tokenizer import Tokenizer

    model = tmp_path / "tok"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, model / name)
    if special:
        rust = RustTokenizer.from_file(str(model / "tokenizer.json"))
        rust.add_special_tokens(sorted({m for _, _, markers in FORMATS.values() for m in markers} | {"<|python_tag|>"}))
        rust.save(str(model / "tokenizer.json"))
    tok = Tokenizer(model)
    assert len(tok.special_tokens()) > (8 if special else 0)
    compiler = GrammarCompiler(model, tok.vocab_size, [tok.token_to_id("<|im_end|>")])
    good = {"hermes": '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
            "llama3": '{"name": "get_time", "parameters": {"zone": "utc"}}',
            "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]',
            "pythonic": '[get_time(zone="utc")]',
            "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
                           '{"zone": "utc"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'}
    if special:  # a tokenizer with [ARGS] (Mistral's v11): a call per [TOOL_CALLS], name[ARGS]{...}
        good["mistral"] = '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}'
    bad_zone = {k: v.replace("utc", "mars") for k, v in good.items()}
    extra_key = {k: v.replace('"utc"', '"utc", "x": 1').replace('="utc"', '="utc", x=1') for k, v in good.items()}
    for parser, call in good.items():
        for parallel in (True, False):
            tools = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": parallel})
            source = tools.auto_grammar(parser, tok.special_tokens())

            def accepts(text: str, whole: bool = True) -> bool:
                g = compiler.compile(SamplingParams(lark=source))
                ids = tok.encode(text, add_special_tokens=False)
                ok = g._m.validate_tokens(ids) == len(ids)
                if ok:
                    g._m.consume_tokens(ids)
                return ok and (not whole or g._m.is_accepting())

            assert accepts("Just some text.") and accepts(call), parser
            assert not accepts(bad_zone[parser], whole=False) and not accepts(extra_key[parser], whole=False), parser
            two = {"hermes": call + " and " + call, "llama3": call + "; " + call, "mistral": call + call if special
                   else call[:-1] + ", " + call[len("[TOOL_CALLS]["):], "pythonic": call[:-1] + ", " + call[1:],
                   "deepseek_v3": call.replace("<｜tool▁calls▁end｜>", "") + call[len("<｜tool▁calls▁begin｜>"):]}
            assert accepts(two[parser], whole=False) == parallel, parser


def test_the_chat_template_sees_the_tools_and_earlier_calls(tmp_path):
    """The tools reach the template as transformers passes them (`tools`: the function dicts), an assistant turn's
    calls with their arguments as a dict; the template's own format picks the parser."""
    from tiny_models import write_chat_target

    from fastspec.serve.protocol import parse_request
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
        if f.name != "tokenizer.json":
            (model / f.name).symlink_to(f)
    text = (embedded_dir / "tokenizer.json").read_text()
    assert text.count('"<reponame>"') == 2 and text.count('"<file_sep>"') == 2  # added token and vocab entry
    (model / "tokenizer.json").write_text(text.replace('"<reponame>"', '"<tool_call>"').replace(
        '"<file_sep>"', '"</tool_call>"'))
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
    plain = fastspec.LLM(str(llm.engine.model_dir), speculative_algorithm="NONE", max_total_tokens=4096)
    want, spoken = (x.generate([ids], params)[0] for x in (plain, llm))
    assert spoken.output_ids == want.output_ids and want.output_ids[0] == opening
    assert engine_settled(service)


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
