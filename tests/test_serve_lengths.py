"""How long a served request may be, on a server whose KV pool (64 tokens) is smaller than the context: the
default length fits the pool, a request past it is OpenAI's 400 naming its own field (from the engine's one length
check, Engine.check_length), and a client that keeps sending such requests does not flood the server's log. The
engine's own refusal names the length as a Python caller typed it, a command as its flags."""

import json
import logging
import shutil

import openai
import pytest
from serve_helpers import engine_settled, start_server
from tiny_models import write_char_tokenizer

import fastspec
from fastspec.errors import FastspecError, RequestTooLong

MODEL = "tiny-lengths"
REFUSED = "raise --max-total-tokens"  # (the server's remedy: in its log, never told to the client)


@pytest.fixture(scope="module")
def small(tiny_dirs, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("lengths") / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    llm = fastspec.LLM(str(model_dir), max_total_tokens=64, overlap_schedule="off")
    server, thread, service, url, client = start_server(llm, MODEL, max_queued=4)
    yield client, llm, service, server.config.app.state.pool_refusals
    server.should_exit = True
    thread.join(10)
    service.stop()


def test_a_chat_without_max_tokens_fits_a_small_kv_pool_and_more_than_it_holds_is_a_400_naming_the_field(
        small, caplog):
    """Chat's default length (the rest of the context, capped) is capped by what the KV pool holds too: a chat that
    asked for no length on a server whose pool is smaller than the context runs to the pool's end (it was a 400,
    "a request of 4 prompt + 252 new tokens does not fit in the KV pool of 64 tokens"). A length asked for beyond
    it, or a prompt the pool cannot hold with an answer, is OpenAI's 400 naming the request's field (param, code
    context_length_exceeded), as past the context; the server's flag (--max-total-tokens) is said in its log, not
    to the client (it was param null, "raise --max-total-tokens")."""
    client, llm, service, refusals = small
    hi = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model=MODEL, messages=hi, extra_body={"ignore_eos": True})
    prompt = answer.usage.prompt_tokens
    assert answer.choices[0].finish_reason == "length"
    room = llm.engine.room_for(prompt)
    assert answer.usage.completion_tokens == room == 64 - 1 - prompt  # (1: a round's)
    asks = [("max_tokens", dict(messages=hi, max_tokens=room + 1), f"at most {room}"),
            ("max_completion_tokens", dict(messages=hi, max_completion_tokens=60), f"at most {room}"),
            ("messages", dict(messages=[{"role": "user", "content": "x" * 70}]), "no room for an answer"),
            ("prompt", dict(prompt="x" * 70, max_tokens=1), "no room for an answer")]
    for param, ask, says in asks:
        create = client.chat.completions.create if "messages" in ask else client.completions.create
        refusals.last = None  # (as if this were the server's first refusal: it is logged)
        with caplog.at_level(logging.WARNING, logger="fastspec.serve.lengths"):
            caplog.clear()
            with pytest.raises(openai.BadRequestError, match="this server's KV pool") as e:
                create(model=MODEL, **ask)
        error = e.value.body
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), ask
        assert says in error["message"] and "max-total-tokens" not in error["message"]
        assert [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()], ask
    assert client.chat.completions.create(model=MODEL, messages=hi, max_tokens=room).choices
    assert engine_settled(service)


def test_a_client_sending_requests_past_the_pool_does_not_flood_the_servers_log(small, caplog):
    """Each request past the KV pool is a 400, but the server's log says so once, then at most once a minute with
    a count of the refusals since its last line (it logged a line per request: one client could fill the log)."""
    client, _, service, refusals = small
    refusals.last = None
    with caplog.at_level(logging.WARNING, logger="fastspec.serve.lengths"):
        caplog.clear()
        for _ in range(10):
            with pytest.raises(openai.BadRequestError, match="this server's KV pool"):
                client.completions.create(model=MODEL, prompt="abc", max_tokens=62)
        lines = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
        assert len(lines) == 1 and "more refused" not in lines[0]
        refusals.last -= refusals.interval  # (as if its line were a minute old)
        with pytest.raises(openai.BadRequestError, match="this server's KV pool"):
            client.completions.create(model=MODEL, prompt="abc", max_tokens=62)
        lines = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
    assert len(lines) == 2 and "(9 more refused since the last such line)" in lines[1]
    with pytest.raises(openai.BadRequestError, match="context length"):  # (past the context: the client's to fix,
        client.completions.create(model=MODEL, prompt="abc", max_tokens=10**6)  # never the server's log)
    assert len([r for r in caplog.records if REFUSED in r.getMessage()]) == 2
    assert engine_settled(service)


def test_the_engine_checks_both_limits_in_one_place_and_says_which(small):
    """Engine.check_length is the one length check: `request` refuses by it (its text names the length and the
    pool's size by LLM's and SamplingParams' keywords, as a Python caller typed them; a command by its flags: below)
    and a server names its fields from the refusal's numbers: which limit, its size, and the most new tokens the
    prompt leaves there (room_for's, to the token)."""
    _, llm, _, _ = small
    engine, ctx = llm.engine, llm.engine.worker.max_context_len
    room = engine.room_for(5)
    engine.check_length(5, room)  # (exactly what fits)
    with pytest.raises(RequestTooLong) as e:
        engine.check_length(5, room + 1)
    assert (e.value.limit, e.value.capacity, e.value.room) == ("kv_pool", 64, room)
    with pytest.raises(FastspecError, match=rf"^a request of 5 prompt \+ {room + 1} new tokens does not fit in the "
                                            r"KV pool of 64 tokens \(it needs 65: a decode round's headroom; "
                                            r"raise max_total_tokens\)$"):
        engine.request(0, [1] * 5, fastspec.SamplingParams(max_new_tokens=room + 1))
    with pytest.raises(RequestTooLong) as e:
        engine.check_length(5, ctx)
    assert (e.value.limit, e.value.capacity, e.value.room) == ("context", ctx, room)  # (not ctx - 5: the pool's
    # smaller room, which a client retrying with it gets: found by the QA pass of today's changes)
    assert room < ctx - 5
    with pytest.raises(FastspecError, match=rf"^prompt \(5 tokens\) \+ max_new_tokens \({ctx}\) exceeds the "
                                            rf"context length {ctx}$"):
        engine.request(0, [1] * 5, fastspec.SamplingParams(max_new_tokens=ctx))
    with pytest.raises(RequestTooLong) as e:
        engine.check_length(70, 1)
    assert (e.value.limit, e.value.room) == ("kv_pool", room - 65)


def test_a_one_token_prompt_is_told_as_one_token(small):
    """A refused prompt's length is counted in the singular when it is one token, by the engine and the server."""
    from types import SimpleNamespace

    from fastspec.serve.api_error import APIError
    from fastspec.serve.lengths import PoolRefusals, check_length

    _, llm, _, _ = small
    engine, ctx = llm.engine, llm.engine.worker.max_context_len
    with pytest.raises(FastspecError, match=rf"^prompt \(1 token\) \+ max_new_tokens \({ctx}\) exceeds"):
        engine.request(0, [1], fastspec.SamplingParams(max_new_tokens=ctx))
    parsed = SimpleNamespace(chat=False, max_tokens_field="max_tokens")
    with pytest.raises(APIError, match=rf"^prompt \(1 token\) \+ max_tokens \({ctx}\) exceeds"):
        check_length(engine, PoolRefusals(), parsed, 1, ctx, None)


@pytest.mark.commands
def test_a_command_names_the_length_by_its_flags(small):
    """Past the context or the KV pool, generate, chat and bench name the length by the flags typed
    (--max-new-tokens, --max-total-tokens), where a Python caller reads max_new_tokens and max_total_tokens."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    _, llm, _, _ = small
    ctx, model = llm.engine.worker.max_context_len, ["--model", str(llm.sources.model_dir), "--max-total-tokens", "64"]
    past = f"+ --max-new-tokens ({ctx}) exceeds the context length {ctx}\n"
    cases = [(["generate", "--input-ids", "5", "--max-new-tokens", "63"], None, "does not fit in the KV pool of 64 "
              "tokens (it needs 65: a decode round's headroom; raise --max-total-tokens)\n"),
             (["generate", "--input-ids", "5", "--max-new-tokens", f"{ctx}"], None, past),
             (["chat", "--max-new-tokens", f"{ctx}"], "hi\n", past),
             (["bench", "--max-new-tokens", f"{ctx}", "--num-prompts", "1", "--batch-sizes", "1", "--trials", "1",
               "--warmup", "0"], None, past)]
    for args, stdin, says in cases:
        result = CliRunner().invoke(app, args + model, input=stdin)
        assert result.exit_code == 2 and result.stderr.endswith(says), (args, result.output)


@pytest.mark.commands
def test_chat_saves_a_refused_messages_error_as_it_showed_it(small, tmp_path, monkeypatch):
    """A message chat refuses (too long for the context) is kept in the saved conversation with the error chat
    showed, naming --max-new-tokens (it kept the engine's words, max_new_tokens, before chat renamed them)."""
    from typer.testing import CliRunner

    from fastspec.cli import app

    _, llm, _, _ = small
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    ctx = llm.engine.worker.max_context_len
    args = ["chat", "--max-new-tokens", f"{ctx}", "--model", str(llm.sources.model_dir), "--max-total-tokens", "64"]
    result = CliRunner().invoke(app, args, input="hi\n")
    (saved,) = (tmp_path / "chats").iterdir()
    (refused,) = json.loads(saved.read_text())["refused"]
    assert refused["content"] == "hi" and f"+ --max-new-tokens ({ctx}) exceeds" in refused["error"]
    assert f"error: {refused['error']}\n" in result.stderr
