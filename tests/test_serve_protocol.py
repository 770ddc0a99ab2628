"""OpenAI request bodies as `fastspec serve` parses them (fastspec.serve.protocol), without a server: the keys a
message may hold, a strict response_format, and fields of the wrong type are 400s naming their param. The
server's own refusals (and that it keeps serving): test_serve_errors."""

import pytest
from serve_helpers import MODEL

pytestmark = pytest.mark.commands  # (as test_serve_errors, where these began): .ci/run runs them over a hostile cache


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


@pytest.mark.parametrize("raw, field, says", [
    (b'"temperature": 1e999', "temperature", "temperature must be a finite number, got 1e999"),
    (b'"top_p": 1e309', "top_p", "top_p must be a finite number, got 1e309"),
    (b'"max_tokens": 1e400', "max_tokens", "max_tokens must be a finite number, got 1e400"),
    (b'"presence_penalty": -Infinity', "presence_penalty", "presence_penalty must be a finite number, got -Infinity"),
    (b'"min_p": NaN', "min_p", "min_p must be a finite number, got NaN"),
    (b'"logit_bias": {"5": 1e999}', "logit_bias", "logit_bias must hold only finite numbers, got 1e999"),
    (b'"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "number", "maximum": NaN}}}',
     "response_format", "response_format must hold only finite numbers, got NaN"),
    (b'"temperature": 1' + b"0" * 400, "temperature", "temperature must be a finite number, got an integer of 401"),
    (b'"top_p": -1' + b"0" * 400 + b".5", "top_p", "top_p must be a finite number, got a number of 404 characters"),
    (b'"logit_bias": {"5": 1' + b"0" * 400 + b"}", "logit_bias", r"logit_bias values must be in \[-100, 100\]"),
    (b'"max_tokens": ' + b"9" * 5000, "max_tokens", "max_tokens must be an integer of at most 4300 digits, got an "
                                                    "integer of 5000 digits"),
    (b'"prompt": [1, ' + b"9" * 5000 + b"]", "prompt", "prompt must hold only integers of at most 4300 digits")],
    ids=["inf", "inf-top_p", "inf-max_tokens", "-Infinity", "NaN", "bias", "schema", "int-past-float",
         "long-float", "bias-past-float", "long-int", "long-int-inside"])
def test_a_number_past_a_floats_range_or_not_finite_is_a_400_naming_its_field(raw, field, says):
    """json.loads reads 1e999 as inf and takes NaN / Infinity: each is a 400 naming the field that holds it, however
    deep (a schema's NaN was taken, written out as NaN); an integer past a float's range (a float() OverflowError)
    or past the digits Python reads (a ValueError from json.loads) was a 500."""
    from fastspec.serve import protocol
    from fastspec.serve.api_error import APIError
    from fastspec.serve.body import parse_body

    with pytest.raises(APIError, match="^" + says) as e:
        protocol.parse_request(parse_body(b'{"prompt": "abc", ' + raw + b"}"), False, MODEL)
    assert (e.value.status, e.value.param) == (400, field)


def test_a_finite_number_and_a_nan_overridden_by_a_later_key_are_taken():
    from fastspec.serve.body import parse_body

    assert parse_body(b'{"temperature": NaN, "temperature": 0.5, "logit_bias": {"5": -1e2}}') == {
        "temperature": 0.5, "logit_bias": {"5": -100.0}}
