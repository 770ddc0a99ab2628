"""What the serve tests share: a tiny Llama with a character tokenizer and a random EAGLE-3 head, served on
127.0.0.1 at a free port by a uvicorn thread (the `served` fixture: overlap off and on, one server per test module;
`twin`: the same LLM again, not served, for direct calls), plain HTTP requests, and the checks that the engine
settled with every KV slot free."""

import http.client
import json
import shutil
import threading
import time
import urllib.request

import openai
import pytest
from conftest import all_slots_free
from tiny_models import write_char_tokenizer

import fastspec
from fastspec.sampling import SamplingParams
from fastspec.serve import bind, make_server

MODEL = "tiny-served"
PROMPTS = ["Hello!", "abc", "[x]{y}", "What?", "1+1=2", "zz", "~!~", "Q"]


def start_server(llm, model_name: str, max_queued: int):
    """(uvicorn server, its thread, EngineService, base URL, openai client) serving `llm` on a free local port."""
    sock = bind("127.0.0.1", 0)
    server, service = make_server(llm, model_name, max_queued=max_queued)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    return server, thread, service, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                        timeout=60)


@pytest.fixture(scope="module", params=["off", "on"], ids=["serial", "overlap"])
def served(tiny_dirs, draft_dirs, tmp_path_factory, request):
    model_dir = tmp_path_factory.mktemp("served") / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    llm = _served_llm(model_dir, draft_dirs, request.param)
    server, thread, service, url, client = start_server(llm, MODEL, max_queued=64)
    yield client, url, llm, service
    server.should_exit = True
    thread.join(10)
    service.stop()


@pytest.fixture(scope="module")
def twin(served, draft_dirs):
    """An LLM as the served one is, not served: what a direct generate answers (the served LLM refuses one)."""
    config = served[2].engine.config
    return _served_llm(served[2].engine.model_dir, draft_dirs, config.overlap_schedule)


def plain_char_llm(tiny_dirs, tmp_path_factory):
    """A tiny Llama of its own with a character tokenizer and a chat template, decoding plainly without overlap (a
    server the test starts and stops; the modules that serve it share one per module)."""
    model_dir = tmp_path_factory.mktemp("plain") / "llama"
    shutil.copytree(tiny_dirs["llama"][0], model_dir)
    write_char_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    return fastspec.LLM(str(model_dir), max_total_tokens=4096, max_running_requests=16, overlap_schedule="off")


def _served_llm(model_dir, draft_dirs, overlap: str):
    return fastspec.LLM(str(model_dir), speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"]),
                        num_steps=3, topk=2, num_draft_tokens=4, max_total_tokens=4096, max_running_requests=16,
                        overlap_schedule=overlap)


def raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """A plain HTTP request (what a non-OpenAI client may send): (status, JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body, {"content-type": "application/json"} if body is not None else {})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read() or b"null")
    conn.close()
    return status, data


def engine_settled(service, timeout: float = 10.0) -> bool:
    """No open request, then every slot free after a cache flush (checked by the engine thread itself)."""
    deadline = time.monotonic() + timeout
    while service.open_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    service.call(lambda: None)  # one more step boundary: aborts seen after the last hand-out are applied
    return service.open_requests == 0 and service.call(lambda: all_slots_free(service.engine))


def greedy(llm, prompt: str, n: int, chat: bool, **extra):
    return llm.generate([prompt], SamplingParams(max_new_tokens=n, **extra), chat=chat)[0]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed by prometheus_client's own text parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
