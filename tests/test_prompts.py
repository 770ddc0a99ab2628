"""Tests for fastspec.prompts: the packaged prompt sets (sizes, splits, no overlap) and the JSONL reader's errors.

The built-in files are re-read here with plain `json` as an independent oracle for `load_prompts`; the reader's
line numbers are checked against hand-written files and against hypothesis-generated ones.
"""

import json
import re
from importlib import resources

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastspec.prompts as prompts_mod
from fastspec.errors import FastspecError
from fastspec.prompts import PROMPT_SETS, load_prompts, read_jsonl_prompts

MIN_SIZE = {"chat": 120, "code": 100, "writing": 100, "explain": 200, "lists": 200, "rewrite": 200, "stories": 200}


def raw_lines(name):
    """Every line of the packaged `<name>.jsonl`, decoded with plain json (the oracle)."""
    text = resources.files("fastspec.prompts").joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    assert text.endswith("\n") and "\n\n" not in text, "built-in files: one object per line, no blank lines"
    return [json.loads(line) for line in text.splitlines()]


def normalise(prompt):
    return re.sub(r"\s+", " ", prompt).strip().casefold()


# ---- built-in sets ----

def test_prompt_sets_are_the_documented_files():
    assert PROMPT_SETS == ("chat", "code", "writing", "explain", "lists", "rewrite", "stories")


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_builtin_file_schema_and_size(name):
    records = raw_lines(name)
    assert len(records) >= MIN_SIZE[name]
    for i, record in enumerate(records, start=1):
        assert set(record) == {"prompt", "split"}, f"{name}.jsonl:{i}"
        assert record["split"] in ("train", "heldout"), f"{name}.jsonl:{i}"
        assert isinstance(record["prompt"], str) and record["prompt"] == record["prompt"].strip() != ""
    path = resources.files("fastspec.prompts").joinpath(f"{name}.jsonl")
    assert read_jsonl_prompts(path) == [r["prompt"] for r in records]


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_load_prompts_matches_oracle_per_split(name):
    records = raw_lines(name)
    for split in ("train", "heldout"):
        assert load_prompts(name, split) == [r["prompt"] for r in records if r["split"] == split]
    assert load_prompts(name, None) == [r["prompt"] for r in records]
    assert load_prompts(name) == load_prompts(name, "heldout")


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_heldout_is_about_15_percent_and_spread_evenly(name):
    heldout = [i for i, r in enumerate(raw_lines(name)) if r["split"] == "heldout"]
    n = len(raw_lines(name))
    assert 0.12 <= len(heldout) / n <= 0.18
    # no long run of train-only lines anywhere: at start, between held-out lines, or at the end
    gaps = [b - a for a, b in zip([-1] + heldout, heldout + [n])]
    assert max(gaps) <= 10, gaps


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_prompt_lengths_vary(name):
    words = sorted(len(p.split()) for p in load_prompts(name, None))
    assert words[len(words) // 10] * 2 <= words[9 * len(words) // 10], "short and long requests"
    assert words[0] <= 12 and words[-1] >= 40, "from one-liners to paragraph-length requests"


def test_no_duplicate_prompts_across_sets_or_splits():
    everything = load_prompts("all", None)
    seen = {}
    for prompt in everything:
        key = normalise(prompt)
        assert key not in seen, f"duplicate prompt: {prompt[:60]!r}"
        seen[key] = prompt
    assert len(everything) == sum(len(raw_lines(n)) for n in PROMPT_SETS)


def test_heldout_never_in_train():
    train = {normalise(p) for p in load_prompts("all", "train")}
    heldout = {normalise(p) for p in load_prompts("all", "heldout")}
    assert heldout and train and not (heldout & train)


def test_all_concatenates_sets_in_order():
    for split in ("train", "heldout", None):
        assert load_prompts("all", split) == [p for n in PROMPT_SETS for p in load_prompts(n, split)]


def test_load_prompts_returns_a_fresh_list():
    first = load_prompts("chat", "heldout")
    first.clear()
    assert load_prompts("chat", "heldout")


@pytest.mark.parametrize("name, split", [("poems", "heldout"), ("", None), ("chat", "test"), ("all", "Train")])
def test_load_prompts_rejects_unknown_name_or_split(name, split):
    with pytest.raises(FastspecError):
        load_prompts(name, split)


def test_builtin_loader_rejects_bad_split(tmp_path, monkeypatch):
    (tmp_path / "chat.jsonl").write_text('{"prompt": "a", "split": "train"}\n{"prompt": "b", "split": "dev"}\n')

    class FakeResources:
        @staticmethod
        def files(package):
            return tmp_path

    monkeypatch.setattr(prompts_mod, "resources", FakeResources)
    prompts_mod._builtin_records.cache_clear()
    try:
        with pytest.raises(FastspecError, match=r"^chat\.jsonl:2: .*split"):
            load_prompts("chat", None)
    finally:
        prompts_mod._builtin_records.cache_clear()


# ---- read_jsonl_prompts ----

def test_read_good_file(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = ['{"prompt": "first", "id": 7}', "", "   ", '{"split": "x", "prompt": "second\\nline"}',
             '{"prompt": "caf\u00e9 \u2028 separator"}', ""]
    path.write_text("\r\n".join(lines), encoding="utf-8")
    assert read_jsonl_prompts(path) == ["first", "second\nline", "caf\u00e9 \u2028 separator"]
    assert read_jsonl_prompts(str(path)) == read_jsonl_prompts(path)


def test_conversation_files_give_their_first_user_message(tmp_path):
    """A SpecForge / ShareGPT training file (`conversations`) or an OpenAI one (`messages`) as --prompts: each line's
    first user message is its prompt (was 'missing "prompt"'), OpenAI's text content parts joined as the server joins
    them; a line with `prompt` keeps it."""
    path = tmp_path / "sharegpt.jsonl"
    lines = [{"id": "a", "conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "x"},
                                           {"from": "human", "value": "later"}]},
             {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "second"},
                                {"role": "assistant", "content": "y"}]},
             {"messages": [{"role": "user", "content": "third"}]},
             {"prompt": "fourth", "messages": [{"role": "user", "content": "not this"}]},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "fif"},
                                                         {"type": "text", "text": "th"}]}]}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert read_jsonl_prompts(path) == ["first", "second", "third", "fourth", "fifth"]


def test_read_file_with_bom(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n')
    assert read_jsonl_prompts(path) == ["hi"]


BAD_LINES = [
    ("{not json}", "invalid JSON"),
    ('{"prompt": "unterminated', "invalid JSON"),
    ('["a list"]', "expected a JSON object, got array"),
    ('"just a string"', "expected a JSON object, got string"),
    ("42", "expected a JSON object, got number"),
    ("null", "expected a JSON object, got null"),
    ('{"text": "no prompt key"}', 'missing "prompt"'),
    ('{"prompt": ""}', '"prompt" is empty'),
    ('{"prompt": "  \\n\\t "}', '"prompt" is empty'),
    ('{"prompt": 3}', '"prompt" must be a string, got number'),
    ('{"prompt": null}', '"prompt" must be a string, got null'),
    ('{"prompt": ["a", "b"]}', '"prompt" must be a string, got array'),
    ('{"conversations": [{"from": "gpt", "value": "hi"}]}', "the conversation has no user message"),
    ('{"messages": []}', "the conversation has no user message"),
    ('{"messages": [{"role": "user", "content": ""}]}', '"prompt" is empty'),
    ('{"conversations": [{"role": "user", "content": 7}]}', "the first user message must be text (a string or a "
                                                             'list of {"type": "text"} parts), got number'),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "the first user message must be text (a string or a list of {\"type\": \"text\"} parts), got array holding "
     "a part that is not text"),
]


@pytest.mark.parametrize("bad, what", BAD_LINES)
def test_bad_line_reports_file_and_line(tmp_path, bad, what):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "fine"}\n' + bad + '\n{"prompt": "after"}\n')
    with pytest.raises(FastspecError) as info:
        read_jsonl_prompts(path)
    assert str(info.value).startswith(f"{path}:4: ")
    assert what in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(FastspecError, match="not found"):
        read_jsonl_prompts(tmp_path / "nope.jsonl")


def test_directory_and_undecodable_file(tmp_path):
    with pytest.raises(FastspecError):
        read_jsonl_prompts(tmp_path)
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(FastspecError):
        read_jsonl_prompts(path)


@pytest.mark.parametrize("content", ["", "\n", "  \n\n\t\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(FastspecError, match=f"^no prompts in {re.escape(str(path))}$"):
        read_jsonl_prompts(path)


prompt_text = st.text(min_size=1, max_size=30).filter(lambda s: s.strip())
line_items = st.lists(st.one_of(prompt_text, st.just(None)), min_size=1, max_size=12)  # None = blank line


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=line_items, data=st.data())
def test_reader_roundtrip_and_line_numbers(tmp_path, items, data):
    path = tmp_path / "gen.jsonl"
    lines = ["" if p is None else json.dumps({"prompt": p, "n": i}, ensure_ascii=False) for i, p in enumerate(items)]
    expected = [p for p in items if p is not None]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if expected:
        assert read_jsonl_prompts(path) == expected
    bad_at = data.draw(st.integers(0, len(lines)), label="bad line index")
    bad, what = data.draw(st.sampled_from(BAD_LINES), label="bad line")
    path.write_text("\n".join(lines[:bad_at] + [bad] + lines[bad_at:]) + "\n", encoding="utf-8")
    with pytest.raises(FastspecError) as info:
        read_jsonl_prompts(path)
    assert str(info.value).startswith(f"{path}:{bad_at + 1}: ") and what in str(info.value)
