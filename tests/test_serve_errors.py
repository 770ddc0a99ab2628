"""`fastspec serve`'s refusals: bad requests get OpenAI's error object (status, type, param) and the server keeps
serving; overload is a 503; the command's own bad flags are one line before it listens."""

import socket

import openai
import pytest
from serve_helpers import MODEL, engine_settled, raw, served  # noqa: F401  (the fixture)
from typer.testing import CliRunner

from fastspec.cli import app
from fastspec.errors import BadField
from fastspec.sampling.params import KINDS
from fastspec.serve.service import PARAMS
from fastspec.serve.tools import Tools

pytestmark = pytest.mark.commands  # a `fastspec` command: .ci/run runs these again over a hostile user cache


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    client, url, _, service = served
    message = [{"role": "user", "content": "abc"}]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=message)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=message, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.chat.completions.create(model=MODEL, messages=message, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="abc", temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        client.completions.create(model=MODEL, prompt="abc", max_tokens=2, logit_bias={"5": 101})
    with pytest.raises(openai.BadRequestError, match="one grammar per request: response_format and regex"):
        client.chat.completions.create(model=MODEL, messages=message, response_format={"type": "json_object"},
                                       extra_body={"regex": "a+"})
    for past_int64 in ({"seed": 2**64}, {"seed": -2**63 - 1}, {"top_k": 2**63}):  # (each once a 500 whose slot
        with pytest.raises(openai.BadRequestError, match="seed|top_k"):  # leaked, or an engine stopped for all)
            client.completions.create(model=MODEL, prompt="abc", max_tokens=2, extra_body=past_int64)
    status, body = raw(url, "POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 2}')  # no model: the
    assert status == 200 and body["model"] == MODEL  # served one, as SGLang and vLLM take it
    status, bad = raw(url, "POST", "/v1/completions", b"{not json")
    assert status == 400 and bad["error"]["type"] == "invalid_request_error"
    assert raw(url, "GET", "/v1/nowhere")[0] == 404
    assert raw(url, "GET", "/health")[1]["status"] == "ok"
    listed = raw(url, "GET", "/v1/models")[1]["data"][0]
    assert listed["id"] == MODEL and listed["created"] > 1_600_000_000  # (when it started, as vLLM's: it was 0)
    assert client.models.list().data[0].id == MODEL
    assert client.models.retrieve(MODEL).model_dump(exclude_none=True) == listed  # (was a bare 404 "Not Found")
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0).choices[0].text
    assert engine_settled(service)


@pytest.mark.parametrize("field, value, says", [("top_p", 2, "top_p must be in (0, 1], got 2.0"),
                                                 ("repetition_penalty", 0, "repetition_penalty must be > 0"),
                                                 ("min_p", 1.5, "min_p must be in [0, 1]"),
                                                 ("logit_bias", {"-1": 5}, "logit_bias must map token ids >= 0"),
                                                 ("ignore_eos", True, "ignore_eos must be off with a regex")])
def test_a_sampling_refusal_names_the_request_field_as_sent(served, field, value, says):
    """SamplingParams' refusal of a request's value is a 400 whose message and param name the field as the request
    spells it (`top_p`; the message said `top-p`; ignore_eos with a grammar said `ignore-eos`, no param)."""
    client, _, _, service = served
    grammar = {"regex": "a"} if field == "ignore_eos" else {}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=2, extra_body={field: value} | grammar)
    assert e.value.body["param"] == field and e.value.body["message"].startswith(says), e.value.body
    assert engine_settled(service)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_ignore_eos_with_tools_is_a_400_naming_it(served, choice):
    """The tools' grammar (auto: the format's lark; required: the calls' JSON schema) ends the output at EOS: with
    ignore_eos the request is refused as its client sent it (it was a 500 naming a grammar the client never sent)."""
    client, _, _, service = served
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=tools, tool_choice=choice, extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos", e.value.body
    assert e.value.body["message"].startswith("ignore_eos must be off with tools"), e.value.body
    assert engine_settled(service)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "no-such-type"}}}
REFUSALS = [  # (chat, what the request asks, the engine's message starts with, OpenAI's param)
    (False, dict(prompt=[999]), "prompt must be token ids in [0, ", "prompt"),
    (False, dict(prompt="abc", logit_bias={"999": 5}), "logit_bias must name token ids in [0, ", "logit_bias"),
    (True, dict(extra_body={"regex": "(a"}), "invalid regex", "regex"),
    (True, dict(extra_body={"regex": ""}), "the regex matches only the empty output", "regex"),
    (True, dict(extra_body={"ebnf": "root ::= ("}), "invalid ebnf", "ebnf"),
    (True, dict(response_format=BAD_SCHEMA), "invalid json schema", "response_format"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "invalid lark", "tools"),
]


@pytest.mark.parametrize("reworded", [False, True], ids=["as-said", "reworded"])
def test_each_engine_refusal_names_its_param_by_the_field_it_carries(served, monkeypatch, reworded):
    """Each kind of the engine's refusals (Engine.request: the prompt's and logit bias's token ids, every grammar's
    compile) reaches the client as a 400 naming the request's field (OpenAI's param) through the HTTP app, its
    message the engine's. The param comes from the field the refusal carries, not from its words: reworded (here
    by a wrapper round Engine.request), every refusal still names its param. The tools' `auto` grammar (Lark) is
    the server's own, so a broken one is given here to reach the compile."""
    client, _, _, service = served
    monkeypatch.setattr(Tools, "auto_grammar", lambda self, parser, specials: 'start: "(')
    if reworded:
        request = service.engine.request

        def reworded_request(rid, prompt, params):
            try:
                return request(rid, prompt, params)
            except BadField as e:
                raise BadField(f"refused, in other words: {e}", e.field) from None
        monkeypatch.setattr(service.engine, "request", reworded_request)
    message = [{"role": "user", "content": "abc"}]
    for chat, ask, says, param in REFUSALS:
        with pytest.raises(openai.BadRequestError) as e:
            if chat:
                client.chat.completions.create(model=MODEL, messages=message, max_tokens=2, **ask)
            else:
                client.completions.create(model=MODEL, max_tokens=2, **ask)
        error = e.value.body
        assert error["param"] == param, (ask, error)
        start = "refused, in other words: " if reworded else ""
        assert error["message"].startswith(start + says), (ask, error)
    assert set(KINDS) <= set(PARAMS)  # every grammar field has its param
    assert engine_settled(service)


def test_the_engines_refusal_of_a_chats_prompt_names_its_messages(served, monkeypatch):
    """A chat's prompt is its messages: the engine's refusal of it (here an empty prompt, from a chat template that
    renders nothing of an empty message) is OpenAI's 400 naming `messages`, as a completions request's names
    `prompt`."""
    import jinja2

    client, _, llm, service = served
    monkeypatch.setitem(vars(llm.tokenizer), "_template",
                        jinja2.Template("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ""}], max_tokens=2)
    assert (e.value.body["param"], e.value.body["message"]) == ("messages", "empty prompt")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[999], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=2)
    assert engine_settled(service)


def test_a_request_past_the_context_names_its_own_field(served):
    """The context-length refusal names the request's field (OpenAI's param, code context_length_exceeded): the
    length field it sent, or the messages / prompt when they alone leave no room (a chat that sent no max_tokens
    is not told about one). Never the CLI's --max-new-tokens."""
    client, _, llm, service = served
    ctx = llm.engine.worker.max_context_len
    long, short = "x" * ctx, [{"role": "user", "content": "abc"}]
    cases = [(client.chat.completions.create, dict(messages=[{"role": "user", "content": long}]), "messages"),
             (client.chat.completions.create, dict(messages=short, max_tokens=ctx), "max_tokens"),
             (client.chat.completions.create, dict(messages=short, max_completion_tokens=ctx), "max_completion_tokens"),
             (client.completions.create, dict(prompt=long, max_tokens=4), "prompt"),
             (client.completions.create, dict(prompt=long), "prompt"),
             (client.completions.create, dict(prompt="abc", max_tokens=ctx), "max_tokens"),
             (client.completions.create, dict(prompt=["abc", long], max_tokens=2), "prompt")]
    for create, ask, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, **ask)
        error = e.value.body
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), ask
        assert f"context length {ctx}" in error["message"] and "max-new-tokens" not in error["message"]
        assert param in error["message"] and ("batch" in error["message"]) == (len(ask.get("prompt", "")) == 2)
    assert engine_settled(service)


def _called(**changed) -> dict:
    """An assistant message with one tool call, OpenAI's keys changed or added as given."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}} | changed
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "x", "foo": 1}, r"unknown field\(s\) in messages\[1\] \(user\): foo"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, r"messages\[1\] \(user\): tool_call_id"),
    ({"role": "tool", "content": "4", "tool_call_id": "c1", "name": "f"}, r"messages\[1\] \(tool\): name"),
    ({"role": "system", "content": "x", "refusal": "no"}, r"messages\[1\] \(system\): refusal"),
    ({"role": "assistant", "content": None, "audio": {"id": "a1"}}, r"messages\[1\]: audio is not supported"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     r"messages\[1\]: function_call is not supported"),
    ({"role": "user", "content": "x", "name": 5}, r"messages\[1\]\.name must be of type str, got int"),
    (_called(index=0), r"unknown field\(s\) in messages\[1\]\.tool_calls\[0\]: index$"),
    (_called(function={"name": "f", "arguments": "{}", "strict": True}),
     r"unknown field\(s\) in messages\[1\]\.tool_calls\[0\]\.function: strict$"),
    (_called(type="custom"), r"messages\[1\]\.tool_calls\[0\]\.type must be function, got 'custom'"),
    (_called(function={"name": "f", "arguments": "[1]"}),
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object")],
    ids=["unknown", "user-tool_call_id", "tool-name", "system-refusal", "audio", "function_call", "name-type",
         "call-key", "function-key", "call-type", "arguments-list"])
def test_unknown_keys_inside_messages_are_a_400_naming_them(message, error):
    """A message holds the keys OpenAI's schema gives its role, as a request holds OpenAI's fields: any other is a
    400 naming it (it was taken and dropped); OpenAI's that fastspec does not serve (audio, function_call) are
    refused, not dropped. So are the keys of an assistant's tool_calls items (id, type, function) and of their
    function (name, arguments)."""
    from fastspec.serve import protocol
    from fastspec.serve.api_error import APIError

    with pytest.raises(APIError, match=error) as e:
        protocol.parse_request({"messages": [{"role": "user", "content": "hi"}, message]}, True, MODEL)
    assert (e.value.status, e.value.param) == (400, "messages")


def test_the_message_keys_openai_allows_are_taken():
    """name (every role but tool), an assistant's refusal and tool_calls, a tool's tool_call_id: the template sees
    the name, and a refusal with null content is what the assistant said."""
    from fastspec.serve import protocol

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bare = {"id": "c2", "function": {"name": "g"}}  # (no type, no arguments: OpenAI's defaults, not a 500)
    messages = [{"role": "developer", "content": "be brief", "name": "ops"},
                {"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": None, "refusal": "I can't.", "name": "bot"},
                {"role": "assistant", "content": None, "tool_calls": [call, bare], "refusal": None},
                {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    got = protocol.parse_request({"messages": messages}, True, MODEL).messages
    assert got[:3] == [{"role": "system", "content": "be brief", "name": "ops"},
                       {"role": "user", "content": "hi", "name": "ann"},
                       {"role": "assistant", "content": "I can't.", "name": "bot"}]
    assert got[3]["content"] == "" and [c["function"] for c in got[3]["tool_calls"]] == [
        {"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]
    assert got[4] == {"role": "tool", "content": "4", "tool_call_id": "c1"}


def test_a_strict_response_format_is_held_as_strict_tools_are():
    """response_format json_schema with strict true: every object closed and every property required, and an object
    that allows more keys a 400 naming response_format (as a strict tool's parameters); strict false or absent: the
    schema as given."""
    import json

    from fastspec.serve import protocol
    from fastspec.serve.api_error import APIError

    def parse(schema, **spec):
        body = {"messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema} | spec}}
        return protocol.parse_request(body, True, MODEL).params.json_schema

    point = {"type": "object", "properties": {"x": {"type": "integer"}, "tag": {
        "type": "object", "properties": {"k": {"type": "string"}}}}}
    assert json.loads(parse(point, strict=True)) == {
        "type": "object", "properties": {"x": {"type": "integer"}, "tag": {
            "type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": False,
            "required": ["k"]}}, "additionalProperties": False, "required": ["x", "tag"]}
    assert json.loads(parse(json.dumps(point), strict=True)) == json.loads(parse(point, strict=True))
    assert json.loads(parse(point)) == json.loads(parse(point, strict=False)) == point
    open_tag = point | {"properties": point["properties"] | {"tag": {"type": "object", "additionalProperties": True}}}
    for schema, spec, error in ((open_tag, {"strict": True}, "strict needs closed objects, but schema.tag allows keys"),
                                (point, {"strict": "yes"}, "strict must be of type bool, got str"),
                                ("{not json", {"strict": True}, "not valid JSON")):
        with pytest.raises(APIError, match=error) as e:
            parse(schema, **spec)
        assert (e.value.status, e.value.param) == (400, "response_format")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(chat):
    """OpenAI answers a field of the wrong type with a 400 whose param names it: a model that is no string is not an
    unknown model (404), and fields fastspec does not use (user, stream_options' keys) are checked all the same;
    stream_options without stream true is a 400, as OpenAI's. What the openai client sends for these fields is
    taken, and chat's fields for OpenAI's own platform (metadata, store, service_tier, prompt_cache_key,
    safety_identifier; reasoning_effort, verbosity, prediction, modalities ["text"]: they were unknown fields) are
    checked and unused, as vLLM takes them; audio output and web search are refused."""
    from fastspec.serve import protocol
    from fastspec.serve.api_error import APIError

    base = {"model": MODEL} | ({"messages": [{"role": "user", "content": "abc"}]} if chat else {"prompt": "abc"})
    bad = [("model", None), ("model", 5), ("model", ["x"]), ("user", 5), ("user", {}), ("top_p", 5), ("temperature",
           "1"), ("stream_options", {"include_usage": "x"}), ("stream_options", {"include_usage": 1}),
           ("stream_options", {"include_obfuscation": "no"}), ("stream_options", {"usage": True}),
           ("logit_bias", {"5": "1"}), ("logit_bias", {"5": True}), ("max_tokens", "8")]
    bad += [("max_completion_tokens", 2.5), ("parallel_tool_calls", "yes"), ("metadata", "x"), ("metadata", {"k": 1}),
            ("store", "no"), ("service_tier", 1), ("prompt_cache_key", 1), ("safety_identifier", []),
            ("reasoning_effort", 1), ("verbosity", []), ("prediction", "x"), ("modalities", "text"),
            ("modalities", ["text", "audio"]), ("web_search_options", {})] if chat else [
        ("echo", "yes"), ("store", False)]
    bad += [("stop", ["a"] * 65), ("stop", ""), ("stop", ["a", ""])]
    for field, value in bad:
        with pytest.raises(APIError) as e:
            protocol.parse_request(base | {"stream": field == "stream_options", field: value}, chat, MODEL)
        assert (e.value.status, e.value.param) == (400, field), (field, value, str(e.value))
    for stream in (False, None):  # (OpenAI's rule: stream_options only with stream true; null is no options)
        with pytest.raises(APIError, match="stream_options is only allowed when stream is true") as e:
            protocol.parse_request(base | {"stream": stream, "stream_options": {"include_usage": True}}, chat, MODEL)
        assert (e.value.status, e.value.param) == (400, "stream_options")
    assert not protocol.parse_request(base | {"stream_options": None}, chat, MODEL).include_usage
    with pytest.raises(APIError) as e:
        protocol.parse_request(base | {"model": "gpt-9"}, chat, MODEL)
    assert e.value.status == 404
    good = {"user": "u-1", "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
            "logit_bias": {"5": -100, "6": 2.5}, "max_tokens": 8, "seed": None, "top_p": None}
    platform = {"parallel_tool_calls": False, "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "p", "safety_identifier": "s", "reasoning_effort": "low", "verbosity": "low",
                "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
                "web_search_options": None}  # (OpenAI's own: taken and unused, as vLLM does)
    parsed = protocol.parse_request(base | good | (platform if chat else {}), chat, MODEL)
    assert parsed.include_usage and parsed.params.max_new_tokens == 8
    assert dict(parsed.params.logit_bias) == {5: -100, 6: 2.5}


def test_overload_is_a_503_not_a_crash(served):
    client, _, _, service = served
    service.max_queued = 1
    try:
        long = client.completions.create(model=MODEL, prompt="abc", max_tokens=240, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))
        with pytest.raises(openai.InternalServerError, match="overloaded"):
            client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
        long.close()
    finally:
        service.max_queued = 64
    assert engine_settled(service)
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3).choices[0].text is not None


def test_cli_port_in_use_and_model_errors_are_one_line_before_listening(tiny_dirs, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["llama"][0]), "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    taken.close()
    missing = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "missing"), "--port", "0"])
    assert missing.exit_code == 2 and missing.stderr.startswith("error:")
    assert len(missing.stderr.strip().splitlines()) == 1
    parser = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["llama"][0]), "--tool-call-parser", "xml"])
    assert parser.exit_code == 2 and len(parser.stderr.strip().splitlines()) == 1
    assert ("--tool-call-parser must be one of hermes, llama3, mistral, pythonic, deepseek_v3, got 'xml'"
            in parser.stderr)
