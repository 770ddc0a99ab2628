"""Lossy acceptance thresholds (below 1) where decoding is greedy: the CLI refuses them before loading (test_generate),
the engine per request with the same check, so LLM.generate / stream / chat and serve's HTTP requests refuse a greedy
request in one line naming them (serve: a 400 naming the request's temperature or top_k) and run sampled ones."""

import json

import pytest
from serve_helpers import engine_settled, raw, start_server
from tiny_models import make_hf_model, write_word_tokenizer

import fastspec
from fastspec import SamplingParams
from fastspec.errors import FastspecError
from fastspec.text.conversation import ChatSession

REFUSED = (r"^accept_threshold_single is not used: the request decodes greedily \({}\), where acceptance is exact "
           "whatever the thresholds$")
SAMPLED = SamplingParams(temperature=0.8, seed=1, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def lossy(tmp_path_factory):
    """A tiny llama with a word-level tokenizer, NGRAM-drafted with accept_threshold_single 0.5."""
    directory = tmp_path_factory.mktemp("lossy")
    make_hf_model("llama").save_pretrained(directory)
    write_word_tokenizer(directory)
    return fastspec.LLM(str(directory), speculative_algorithm="NGRAM", accept_threshold_single=0.5,
                        max_total_tokens=1024, max_running_requests=4)


def test_the_api_refuses_a_greedy_request_with_lossy_thresholds(lossy):
    """Temperature 0 (SamplingParams' default) or top_k 1: generate, stream and chat each refuse it in one line naming
    the threshold and the request's field; a sampled request runs, batched beside nothing refused, and a chat
    session's warm-up draws as its answers do (it was greedy: refused under a sampled session)."""
    for params, field in ((None, "temperature 0.0"), (SamplingParams(max_new_tokens=4), "temperature 0.0"),
                          (SamplingParams(temperature=0.8, top_k=1, max_new_tokens=4), "top_k 1")):
        with pytest.raises(FastspecError, match=REFUSED.format(field)):
            lossy.generate([[3, 4, 5]], params)
        with pytest.raises(FastspecError, match=REFUSED.format(field)):
            next(lossy.stream("w3 w4", params))
        with pytest.raises(FastspecError, match=REFUSED.format(field)):
            lossy.chat([{"role": "user", "content": "w3"}], params)
    with pytest.raises(FastspecError, match=REFUSED.format("temperature 0.0")):  # (one greedy among sampled ones)
        lossy.generate([[3, 4, 5], [6, 7]], [SAMPLED, SamplingParams(max_new_tokens=4)])
    done = lossy.generate([[3, 4, 5], [6, 7]], SAMPLED)
    assert [len(c.output_ids) for c in done] == [6, 6]
    assert done[0].output_ids == lossy.generate([[3, 4, 5]], SAMPLED)[0].output_ids  # (seeded: batched or alone)
    ChatSession(lossy, SamplingParams(temperature=0.7, max_new_tokens=4)).warm_up()
    lossy.engine.check_kv()


def test_serve_answers_a_greedy_request_with_lossy_thresholds_by_a_400_naming_its_field(lossy):
    """Serve's requests default to temperature 1 (OpenAI's): those run, n choices too (the server's own request that
    caches their prompt draws as they do); temperature 0 or top_k 1 is a 400 naming that param."""
    server, thread, service, url, _ = start_server(lossy, "lossy", max_queued=8)
    try:
        body = {"prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}
        chat = {"messages": [{"role": "user", "content": "w3 w4"}], "max_tokens": 4}
        for path, ask, param, field in (("/v1/completions", body | {"temperature": 0}, "temperature", "temperature 0"),
                                        ("/v1/completions", body | {"top_k": 1}, "top_k", "top_k 1"),
                                        ("/v1/chat/completions", chat | {"temperature": 0}, "temperature",
                                         "temperature 0")):
            status, data = raw(url, "POST", path, json.dumps(ask).encode())
            assert status == 400 and data["error"]["param"] == param, data
            assert data["error"]["message"].startswith(f"accept_threshold_single is not used: the request decodes "
                                                       f"greedily ({field}"), data
        for ask in (body, body | {"n": 2, "seed": 3, "temperature": 0.7}):
            status, data = raw(url, "POST", "/v1/completions", json.dumps(ask).encode())
            assert status == 200 and len(data["choices"]) == ask.get("n", 1), data
        assert engine_settled(service)
    finally:
        server.should_exit = True
        thread.join(10)
        service.stop()
