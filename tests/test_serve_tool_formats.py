"""Tool-call formats without a server: every format (hermes, llama3, mistral, pythonic, deepseek_v3) parsed and
streamed from hand-written answers; each format's lazy grammar checked with text and special-token markers; the
tools and earlier calls as the chat template sees them; forced calls' schemas closed (strict: every property
required)."""

from __future__ import annotations

import json

import pytest
from tool_helpers import MESSAGES, TIME, WEATHER

from fastspec.sampling import SamplingParams
from fastspec.serve.api_error import APIError
from fastspec.serve.tool_stream import ToolStream
from fastspec.serve.tools import close_objects, parse_output, parse_tools, template_parser

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


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
