"""Structured output (JSON schema, regex, EBNF): masks per tree path equal fresh matchers and hand-worked
cases; greedy output under a grammar equals an independent reference (transformers' logits masked by a fresh
llguidance matcher, token by token) with and without speculation over every algorithm, chains and trees; EAGLE
drafts are grammatical; sampled speculation follows the masked target (chi-square); bad grammars are one-line
errors. The tiny target gets a character tokenizer (one token per printable ASCII character)."""

import json
import re
import shutil

import llguidance
import pytest
import torch
from conftest import all_slots_free
from test_hybrid import oracle_drafter
from tiny_models import write_char_tokenizer

import fastspec
from fastspec.errors import FastspecError
from fastspec.sampling import SamplingParams
from fastspec.sampling.grammar import GrammarCompiler, tree_paths

ids = lambda text: [ord(c) - 30 for c in text]  # noqa: E731  the character tokenizer's ids
text = lambda tokens: "".join(chr(t + 30) for t in tokens if t > 2)  # noqa: E731

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
REGEX = r'\{"[a-z]{1,6}":(true|false|[0-9]{1,3})(,"[a-z]{1,6}":(true|false|[0-9]{1,3})){0,3}\}'
EBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-e]+ | "nil"'
GRAMMARS = [dict(json_schema=SCHEMA), dict(regex=REGEX), dict(ebnf=EBNF), {}]
PROMPTS = [ids("abc"), ids("json:{"), ids("x"), ids("qrstuv")]


@pytest.fixture(scope="module")
def char_target(tiny_dirs, tmp_path_factory):
    """The tiny llama target (so draft_dirs' heads fit it) with the character tokenizer."""
    directory, hf = tiny_dirs["llama"]
    d = tmp_path_factory.mktemp("char-target") / "target"
    shutil.copytree(directory, d)
    return write_char_tokenizer(d), hf


def fresh_matcher(directory, params):
    """An llguidance matcher built here, independently of fastspec.sampling.grammar."""
    tok = llguidance.LLTokenizer((directory / "tokenizer.json").read_text(), n_vocab=97, eos_token=[2])
    if "json_schema" in params:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(params["json_schema"])
    elif "regex" in params:
        grammar = llguidance.LLMatcher.grammar_from_regex(params["regex"])
    else:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(params["ebnf"]))
    return llguidance.LLMatcher(tok, grammar)


def allowed_now(matcher) -> torch.Tensor:
    mask = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)  # one bit per token, little-endian
    bits = (mask[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[:97].bool()


def reference_greedy(hf, directory, prompt, params, n):
    """Greedy under the grammar by hand: transformers' logits, a fresh matcher's mask, argmax, until EOS / n."""
    matcher = fresh_matcher(directory, params) if params else None
    out = []
    with torch.no_grad():
        while len(out) < n:
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            if matcher is not None:
                logits = logits.masked_fill(~allowed_now(matcher), -torch.inf)
            out.append(int(logits.argmax()))
            if out[-1] == 2:
                break
            if matcher is not None:
                assert matcher.consume_token(out[-1])
    return out


def test_masks_along_tree_paths(char_target):
    directory, _ = char_target
    grammar = GrammarCompiler(directory, 97, [2]).compile(SamplingParams(regex="(ab|ac)d"))
    # root -> a -> {b -> d, c, x (ungrammatical) -> d}
    tokens, parents = ids("?abcxd") + ids("d"), [-1, 0, 1, 1, 1, 2, 4]
    paths = tree_paths(tokens, parents)
    assert paths[5] == ids("abd") and paths[6] == ids("axd")
    masks = grammar.masks(paths)
    allowed = [set(row.nonzero().flatten().tolist()) for row in masks]
    assert allowed[0] == set(ids("a"))  # the root: only 'a' may start
    assert allowed[1] == set(ids("bc"))
    assert allowed[2] == allowed[3] == set(ids("d"))
    assert allowed[5] == {2}  # complete: only EOS
    assert allowed[4] == allowed[6] == set(range(97))  # a path the grammar rejects: never accepted, unmasked
    for p in (dict(json_schema=SCHEMA), dict(regex=REGEX), dict(ebnf=EBNF)):  # the walk == a matcher per path
        grammar = GrammarCompiler(directory, 97, [2]).compile(SamplingParams(**p))
        paths = [[], ids('{"'), ids('{"ok":t'), ids('["ab",'), ids("[nil,a"), ids('{"n":12'), ids("]]")]
        for path, row in zip(paths, grammar.masks(paths)):
            matcher = fresh_matcher(directory, p)
            if matcher.validate_tokens(path) == len(path):
                assert matcher.consume_tokens(path)
                assert torch.equal(row, allowed_now(matcher)), path
            else:
                assert bool(row.all())


def check_valid(params, output_ids, finish):
    if finish != "stop":
        return
    out = text(output_ids)
    if "json_schema" in params:
        value = json.loads(out)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    elif "regex" in params:
        assert re.fullmatch(params["regex"], out)
    elif "ebnf" in params:
        assert re.fullmatch(r"\[([a-e]+|nil)(,([a-e]+|nil))*\]", out)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_under_grammars_equals_reference_and_speculation(char_target, draft_dirs, page_size):
    directory, hf = char_target
    params = [SamplingParams(max_new_tokens=40, **g) for g in GRAMMARS]
    reference = [reference_greedy(hf, directory, p, g, 40) for p, g in zip(PROMPTS, GRAMMARS)]
    plain = fastspec.LLM(str(directory), max_total_tokens=4096, page_size=page_size).engine.generate(PROMPTS, params)
    assert [o.output_ids for o in plain] == reference
    finished = 0
    for g, o in zip(GRAMMARS, plain):
        check_valid(g, o.output_ids, o.finish_reason)
        finished += bool(g) and o.finish_reason == "stop"
    assert finished >= 2  # the grammars end the output (EOS once complete) within 40 tokens
    drafts = draft_dirs["llama"]
    for algorithm, draft, steps, topk, n in (("EAGLE", drafts["eagle"], 3, 1, 4), ("EAGLE", drafts["eagle"], 3, 4, 8),
                                             ("EAGLE3", drafts["eagle3"], 4, 2, 6),
                                             ("STANDALONE", drafts["standalone"], 4, 3, 8),
                                             ("NGRAM", None, None, None, 8)):
        llm = fastspec.LLM(str(directory), speculative_algorithm=algorithm, draft_model=draft and str(draft),
                           num_steps=steps, topk=topk, num_draft_tokens=n, max_total_tokens=4096,
                           page_size=page_size, speculative_fallback=False)
        if algorithm == "NGRAM":  # the constrained continuation + wrong branches: every node's mask matters
            oracle_drafter(llm.engine, PROMPTS, reference, 97)
        outputs = llm.engine.generate(PROMPTS, params)
        assert [o.output_ids for o in outputs] == reference, (algorithm, topk)
        assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain]
        assert sum(o.metrics.accepted_tokens for o in outputs) > 0
        llm.engine.flush_cache()
        llm.engine.check_kv()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_grammars_survive_preemption_chunked_prefill_and_the_prefix_cache(char_target, draft_dirs, overlap):
    """More work than the pool holds (preempted requests keep their grammar state), prompts prefilled three
    tokens per step, second requests reusing cached prefixes, the overlap schedule on and off."""
    directory, hf = char_target
    prompts = [p + ids("zz") * i for i, p in enumerate(PROMPTS * 2)]
    grammars = GRAMMARS * 2
    params = [SamplingParams(max_new_tokens=30, **g) for g in grammars]
    reference = [reference_greedy(hf, directory, p, g, 30) for p, g in zip(prompts, grammars)]
    llm = fastspec.LLM(str(directory), speculative_algorithm="EAGLE", draft_model=str(draft_dirs["llama"]["eagle"]),
                       num_steps=3, topk=2, num_draft_tokens=5, max_total_tokens=160, chunked_prefill_size=3,
                       overlap_schedule=overlap, radix_cache=True, speculative_fallback=False)
    assert [o.output_ids for o in llm.engine.generate(prompts, params)] == reference
    assert llm.engine.preemptions > 0
    assert [o.output_ids for o in llm.engine.generate(prompts[:4], params[:4])] == reference[:4]
    assert llm.engine.worker.reused_tokens > 0
    llm.engine.flush_cache()
    assert all_slots_free(llm.engine)


def test_eagle_drafts_are_grammatical(char_target, draft_dirs):
    """Every drafted node of every round is a grammatical continuation of its path (the grammar allows 26
    tokens at each position, more than top-k: the masked top-k never has to pad with forbidden tokens)."""
    directory, _ = char_target
    params = SamplingParams(max_new_tokens=30, regex="[a-z]{40}")
    llm = fastspec.LLM(str(directory), speculative_algorithm="EAGLE", draft_model=str(draft_dirs["llama"]["eagle"]),
                       num_steps=3, topk=3, num_draft_tokens=8, max_total_tokens=4096, speculative_fallback=False)
    trees = capture_trees(llm)
    outputs = llm.engine.generate(PROMPTS[:2], [params] * 2)
    assert trees and all(re.fullmatch("[a-z]{30}", text(o.output_ids)) for o in outputs)
    letters = set(ids("abcdefghijklmnopqrstuvwxyz"))
    assert set(torch.cat([t.draft_tokens[:, 1:].flatten() for t in trees]).tolist()) <= letters
    trees.clear()  # the same head without a grammar drafts other tokens: the mask is what made them letters
    llm.engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=30)] * 2)
    assert set(torch.cat([t.draft_tokens[:, 1:].flatten() for t in trees]).tolist()) - letters


def capture_trees(llm) -> list:
    drafter, trees = llm.engine.drafter, []
    draft = drafter.draft
    drafter.draft = lambda batch: trees.append(draft(batch)) or trees[-1]
    return trees


VOCAB_CHARS, SAMPLES = "abcd", 2400


def test_sampled_speculation_follows_the_masked_target(char_target, draft_dirs):
    """Two tokens from [a-d]{2}: the pair's frequency over seeds against the target's masked distribution."""
    directory, hf = char_target
    prompt, temperature = ids("go"), 1.3
    allowed = torch.tensor(ids(VOCAB_CHARS))

    def dist(logits):
        return torch.softmax(logits[allowed].double() / temperature, -1)

    with torch.no_grad():
        first = dist(hf(torch.tensor([prompt])).logits[0, -1])
        rows = hf(torch.tensor([prompt + [t] for t in allowed.tolist()])).logits[:, -1]
        second = torch.stack([dist(r) for r in rows])
    expected = (first[:, None] * second).flatten() * SAMPLES
    llm = fastspec.LLM(str(directory), speculative_algorithm="STANDALONE",
                       draft_model=str(draft_dirs["llama"]["standalone"]), num_steps=2, topk=2, num_draft_tokens=4,
                       max_total_tokens=40000, max_running_requests=256, speculative_fallback=False)
    params = [SamplingParams(temperature=temperature, seed=s, max_new_tokens=3, regex="[a-d]{2}")
              for s in range(SAMPLES)]
    outputs = llm.engine.generate([prompt] * SAMPLES, params)
    assert all(o.output_ids[2:] == [2] for o in outputs)  # complete after two: EOS
    index = {t: i for i, t in enumerate(allowed.tolist())}
    pairs = torch.tensor([index[o.output_ids[0]] * 4 + index[o.output_ids[1]] for o in outputs])
    observed = torch.bincount(pairs, minlength=16).double()
    cells = expected > 5
    chi2 = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((int(cells.sum()) - 1) / 2.0), chi2 / 2))
    assert sum(o.metrics.accepted_tokens for o in outputs) > 0
    assert p_value > 1e-3, f"chi2={float(chi2):.1f}"


def test_a_grammar_the_model_cannot_finish_ends_by_length(char_target):
    directory, _ = char_target
    llm = fastspec.LLM(str(directory), max_total_tokens=4096)
    [out] = llm.engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=5, regex="[a-z]{50}")])
    assert out.finish_reason == "length" and re.fullmatch("[a-z]{5}", text(out.output_ids))


def test_a_grammar_no_token_can_go_on_with_ends_the_output_at_its_dead_end(char_target, draft_dirs):
    """`ab c`: after "ab" the grammar wants a space, which this tokenizer cannot write. The output ends there (EOS,
    reason stop) instead of failing the engine, target-only and speculative alike."""
    directory, _ = char_target
    for kw in ({}, dict(speculative_algorithm="EAGLE3", draft_model=str(draft_dirs["llama"]["eagle3"]), num_steps=2,
                        topk=2, num_draft_tokens=3)):
        llm = fastspec.LLM(str(directory), max_total_tokens=4096, **kw)
        [out] = llm.engine.generate([PROMPTS[0]], [SamplingParams(max_new_tokens=8, regex="ab c")])
        assert out.finish_reason == "stop" and out.output_ids == [*llm.tokenizer.encode("ab", False), 2]


@pytest.mark.parametrize("grammar, message", [
    (dict(json_schema='{"type": "object"'), "invalid json schema: not JSON"),
    (dict(json_schema='/no/such/schema.json'), "'/no/such/schema.json' is neither a file nor JSON"),
    (dict(json_schema="[1, 2]"), "invalid json schema: it must be a JSON object"),
    (dict(json_schema={"type": "nonsense"}), "invalid json schema"),
    (dict(regex="a("), "invalid regex"),
    (dict(ebnf="root ::= missing"), "invalid ebnf: Rule .missing. not found"),
    (dict(regex=r"\s+"), "allows no token to start"),  # the tokenizer has no whitespace
    (dict(ebnf="root ::= "), "the ebnf matches only the empty output"),
    (dict(regex=""), "the regex matches only the empty output"),
    (dict(regex="a", ebnf='root ::= "a"'), "one grammar per request: regex and ebnf"),
])
def test_bad_grammars_are_one_line_errors(char_target, grammar, message):
    directory, _ = char_target
    llm = fastspec.LLM(str(directory), max_total_tokens=512)
    with pytest.raises(FastspecError, match=message) as e:
        llm.engine.generate([PROMPTS[0]], [SamplingParams(**grammar)])
    assert "\n" not in str(e.value)


def test_grammar_needs_a_tokenizer_and_eos(tiny_dirs, char_target):
    for grammar, words in (("regex", "a regex"), ("json_schema", "a JSON schema"), ("ebnf", "an EBNF grammar")):
        with pytest.raises(FastspecError) as e:  # (its keyword first: a command says --ignore-eos, a server's param)
            SamplingParams(ignore_eos=True, **{grammar: "{}" if grammar == "json_schema" else "a"})
        assert str(e.value) == f"ignore_eos must be off with {words}: the grammar ends the output at EOS"
    llm = fastspec.LLM(str(tiny_dirs["llama"][0]), max_total_tokens=512)  # no tokenizer.json
    with pytest.raises(FastspecError, match="structured output needs the model's tokenizer"):
        llm.engine.generate([PROMPTS[0]], [SamplingParams(regex="a")])


@pytest.mark.commands
def test_cli_structured_output(char_target, tmp_path):
    from typer.testing import CliRunner

    from fastspec.cli import app

    directory, hf = char_target
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    args = ["generate", "--model", str(directory), "--max-new-tokens", "30", "--max-total-tokens", "512", "--json"]
    result = CliRunner().invoke(app, args + ["--json-schema", str(schema), "--prompt", "json:{"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["output_ids"] == reference_greedy(hf, directory, ids("json:{"), dict(json_schema=SCHEMA), 30)
    bad = CliRunner().invoke(app, args + ["--regex", "a(", "--prompt", "x"])
    assert bad.exit_code == 2 and "invalid regex" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    bad = CliRunner().invoke(app, args + ["--regex", "a", "--ignore-eos", "--prompt", "x"])
    assert (bad.exit_code, bad.stderr) == (2, "error: --ignore-eos must be off with a regex: the grammar ends the "
                                              "output at EOS\n"), bad.output
