"""`fastspec serve`'s refusals: bad requests get OpenAI's error object (status, type, param) and the server keeps
serving; overload is a 503; the command's own bad flags are one line before it listens. A request body's refusals
as the protocol parses it, without a server: test_serve_protocol."""

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


@pytest.mark.parametrize("number, field", [
    (b'"max_tokens": ' + b"9" * 5000, "max_tokens"), (b'"top_p": 1' + b"0" * 400, "top_p"),
    (b'"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "number", "maximum": NaN}}}',
     "response_format")], ids=["long-int", "int-past-float", "schema-NaN"])
def test_a_number_no_field_takes_is_a_400_naming_it(served, number, field):
    """Past the digits Python reads, past a float's range, or NaN / Infinity: OpenAI's 400 naming the field (the
    first two were 500s; a schema's NaN was written out as NaN, a 400 from the grammar compiler saying the schema
    was not JSON). A sampling field's 1e999 or NaN: test_serve_protocol."""
    _, url, _, service = served
    status, body = raw(url, "POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 2, ' + number + b"}")
    assert (status, body["error"]["param"]) == (400, field), body
    assert body["error"]["message"].startswith(f"{field} must "), body
    assert raw(url, "POST", "/v1/completions", b'{"prompt": "abc", "max_tokens": 2}')[0] == 200
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
