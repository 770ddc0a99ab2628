"""Logprobs: the target's log-softmax of each output token and its top-n alternatives, equal to transformers'
(teacher-forced over prompt + output), identical with and without speculation, greedy and sampled."""

import pytest
import torch

import fastspec
from fastspec.errors import FastspecError
from fastspec.kernels import cpu_library
from fastspec.sampling import SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [2 + 1], [28, 84, 19, 71]]


def hf_logprobs(hf, prompt, output):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double(), -1)


def check_against_transformers(hf, prompt, output, logprobs, top):
    expected = hf_logprobs(hf, prompt, output)
    assert [lp.token for lp in logprobs] == output
    for i, lp in enumerate(logprobs):
        assert lp.logprob == pytest.approx(float(expected[i, output[i]]), abs=2e-4)
        assert len(lp.top) == top
        values, ids = expected[i].topk(top)
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-4)
        assert all(expected[i, t] == pytest.approx(v, abs=2e-4) for t, v in lp.top)  # (near-)ties may swap ids


@pytest.mark.parametrize("algorithm, draft, steps, topk, n", [("NONE", None, None, None, None),
                                                             ("STANDALONE", "self", 4, 2, 6),
                                                             ("EAGLE", "eagle", 3, 1, 4)])
def test_greedy_logprobs_equal_transformers_with_and_without_speculation(tiny_dirs, draft_dirs, algorithm, draft,
                                                                         steps, topk, n):
    directory, hf = tiny_dirs["llama"]
    draft_path = str(directory) if draft == "self" else str(draft_dirs["llama"][draft]) if draft else None
    llm = fastspec.LLM(str(directory), speculative_algorithm=algorithm, draft_model=draft_path, num_steps=steps,
                       topk=topk, num_draft_tokens=n, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outputs):
        check_against_transformers(hf, prompt, out.output_ids, out.logprobs, 3)
    if draft == "self":
        assert any(len(o.metrics.depth_counts) >= 2 for o in outputs)  # several tokens per round were reported


@pytest.mark.skipif(not cpu_library.available(), reason="without the C kernels float linears are the CPU BLAS's")
@pytest.mark.parametrize("algorithm, draft, quantization, dtype", [("NGRAM", None, None, "float32"),
                                                                   ("EAGLE3", "eagle3", "int4", "float32"),
                                                                   ("STANDALONE", "self", None, "bfloat16")])
def test_speculative_logprobs_are_plain_decodings_bit_for_bit(tiny_dirs, draft_dirs, algorithm, draft, quantization,
                                                              dtype):
    """What docs/sampling.md promises: a speculative run reports exactly what target-only decoding reports. A verify
    row computes its token's decode step bit for bit (attention over exactly its keys; every float linear and the
    refined lm_head's rescoring row-invariant: fastspec.kernels.cpu_row_gemm). With MKL's sgemm, which rounds 1 to 3
    rows otherwise than 4 or more, logprobs differed by ~2e-7 at half the positions (a QA pass)."""
    directory, _ = tiny_dirs["llama"]
    draft_path = str(directory) if draft == "self" else str(draft_dirs["llama"][draft]) if draft else None
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)
    engines = [fastspec.LLM(str(directory), speculative_algorithm=algo, draft_model=path, quantization=quantization,
                            dtype=dtype, max_total_tokens=4096, **extra).engine
               for algo, path, extra in (("NONE", None, {}),
                                         (algorithm, draft_path, dict(speculative_fallback=False)))]
    runs = [[engines[0].generate([p], [params])[0] for p in PROMPTS],  # plain, one row a step
            engines[1].generate(PROMPTS, [params] * len(PROMPTS))]  # speculative, batched
    for plain, spec in zip(*runs):
        assert spec.output_ids == plain.output_ids
        assert [(lp.logprob, lp.top) for lp in spec.logprobs] == [(lp.logprob, lp.top) for lp in plain.logprobs]
    assert sum(o.metrics.verify_rounds for o in runs[1]) > 0


@pytest.mark.skipif(not cpu_library.available(), reason="without the C kernels float linears are the CPU BLAS's")
@pytest.mark.parametrize("qtype, kept_as", [("F32", torch.float32), ("F16", torch.bfloat16)])
def test_a_gguf_of_float_matrices_reports_plain_decodings_logprobs(tmp_path, monkeypatch, qtype, kept_as):
    """A GGUF's float matrices have no packed kernel: they run as CastLinears in the faster float dtype (float32 on a
    CPU without bf16 instructions, as forced here), which must be row-invariant like every other target linear (on
    F.linear, MKL's float32 GEMM made these logprobs differ)."""
    import gguf
    from gguf_writers import TOKENS, tiny_model, write_gguf

    from fastspec.models import gguf_packed

    monkeypatch.setattr(gguf_packed, "float_dtype", lambda activation: kept_as)

    path = str(write_gguf(tmp_path / f"{qtype}.gguf", tiny_model(), qtype=getattr(gguf.GGMLQuantizationType, qtype)))
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 40, 41, 42], [7, 8, 9, 7, 8, 9]]
    assert max(map(max, prompts)) < len(TOKENS)
    plain = fastspec.LLM(path, speculative_algorithm="NONE", max_total_tokens=4096).engine
    spec = fastspec.LLM(path, speculative_algorithm="NGRAM", num_draft_tokens=4, speculative_fallback=False,
                        max_total_tokens=4096).engine
    runs = [[plain.generate([p], [params])[0] for p in prompts], spec.generate(prompts, [params] * len(prompts))]
    for one, batched in zip(*runs):
        assert batched.output_ids == one.output_ids
        assert [(lp.logprob, lp.top) for lp in batched.logprobs] == [(lp.logprob, lp.top) for lp in one.logprobs]
    assert sum(o.metrics.verify_rounds for o in runs[1]) > 0


def test_sampled_logprobs_are_the_targets_and_stop_where_the_output_stops(tiny_dirs):
    directory, hf = tiny_dirs["llama"]
    llm = fastspec.LLM(str(directory), speculative_algorithm="STANDALONE", draft_model=str(directory), num_steps=3,
                       topk=1, num_draft_tokens=4, max_total_tokens=4096)
    params = [SamplingParams(temperature=0.9, seed=s, max_new_tokens=10, ignore_eos=True, logprobs=0,
                             stop_token_ids=(7,)) for s in range(4)]
    for prompt, out in zip(PROMPTS, llm.engine.generate(PROMPTS, params)):
        assert len(out.logprobs) == len(out.output_ids)  # a stop inside an accepted run cuts both
        check_against_transformers(hf, prompt, out.output_ids, out.logprobs, 0)


def test_logprobs_are_the_raw_targets_under_controls_and_temperature(tiny_dirs):
    """As documented: the target's log-softmax before the controls (penalties, bias, min_p) and the sampler's
    temperature / top-k / top-p, what vLLM reports by default, sampled under speculation as target-only."""
    directory, hf = tiny_dirs["llama"]
    params = [SamplingParams(temperature=1.7, top_k=30, min_p=0.02, repetition_penalty=1.5, frequency_penalty=1.0,
                             logit_bias={7: 4.0}, seed=s, max_new_tokens=8, ignore_eos=True, logprobs=3)
              for s in range(4)]
    for kw in ({}, dict(speculative_algorithm="STANDALONE", draft_model=str(directory), num_steps=3, topk=2,
                        num_draft_tokens=5)):
        llm = fastspec.LLM(str(directory), max_total_tokens=4096, **kw)
        for prompt, out in zip(PROMPTS, llm.engine.generate(PROMPTS, params)):
            check_against_transformers(hf, prompt, out.output_ids, out.logprobs, 3)


@pytest.mark.parametrize("algorithm, draft, chunk", [("NONE", None, 8192), ("NONE", None, 3),
                                                     ("EAGLE3", "eagle3", 5)])
def test_prompt_logprobs_equal_transformers_chunked_cached_or_speculative(tiny_dirs, draft_dirs, algorithm, draft,
                                                                         chunk):
    """prompt_logprobs=k: each prompt token after the first, its logprob and top-k given the tokens before it, as
    transformers computes them; across prefill chunks (3 tokens a chunk: a prompt's rows split over steps), with the
    prompt's KV in the prefix cache (computed again: cached rows have no logits) and beside a draft; output logprobs
    and tokens unchanged by asking."""
    directory, hf = tiny_dirs["llama"]
    llm = fastspec.LLM(str(directory), speculative_algorithm=algorithm,
                       draft_model=str(draft_dirs["llama"][draft]) if draft else None, max_total_tokens=4096,
                       chunked_prefill_size=chunk)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    for _ in range(2):  # the second time the prompts are in the prefix cache
        reused = llm.engine.worker.reused_tokens
        outputs = llm.engine.generate(PROMPTS, [params] * len(PROMPTS))
        assert llm.engine.worker.reused_tokens == reused
        for prompt, out in zip(PROMPTS, outputs):
            assert len(out.prompt_logprobs) == len(prompt) - 1
            if len(prompt) > 1:
                check_against_transformers(hf, prompt[:1], prompt[1:], out.prompt_logprobs, 3)
            check_against_transformers(hf, prompt, out.output_ids, out.logprobs, 2)
    plain = llm.engine.generate(PROMPTS, [SamplingParams(max_new_tokens=4, ignore_eos=True)] * len(PROMPTS))
    assert [o.output_ids for o in plain] == [o.output_ids for o in outputs]
    assert all(o.prompt_logprobs is None for o in plain)
    with pytest.raises(FastspecError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_no_logprobs_unless_asked_and_bad_counts_refused(tiny_dirs):
    directory, _ = tiny_dirs["llama"]
    out = fastspec.LLM(str(directory), max_total_tokens=1024).engine.generate(
        [PROMPTS[0]], [SamplingParams(max_new_tokens=3)])[0]
    assert out.logprobs is None
    for bad in (-1, 21):
        with pytest.raises(FastspecError, match="logprobs must be in"):
            SamplingParams(logprobs=bad)


@pytest.mark.commands
def test_text_api_and_cli_report_logprobs(tmp_path):
    """With stop strings the logprobs cover exactly the kept tokens; `generate --json --logprobs N` prints them."""
    import json

    from tiny_models import write_chat_target
    from typer.testing import CliRunner

    from fastspec.cli import app

    target = write_chat_target(tmp_path / "target")
    llm = fastspec.LLM(str(target), max_total_tokens=1024)
    full = llm.generate(["w5 w9 w13"], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1))[0]
    stop = llm.decode(full.output_ids[4:6])
    cut = llm.generate(["w5 w9 w13"], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1,
                                                      stop=(stop,)))[0]
    assert len(cut.logprobs) == len(cut.output_ids) < len(full.output_ids)
    # the second generate starts on the first's cached prompt KV, another computation path: the same tokens, and
    # floats equal to float32 rounding (seen 2.4e-7 apart on an AMX Xeon)
    for a, b in zip(cut.logprobs, full.logprobs):
        assert (a.token, [i for i, _ in a.top]) == (b.token, [i for i, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    result = CliRunner().invoke(app, ["generate", "--model", str(target), "--input-ids", "1,5,9", "--max-new-tokens",
                                      "4", "--logprobs", "2", "--json", "--max-total-tokens", "512"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert [t["token"] for t in record["logprobs"]] == record["output_ids"]
    assert all(len(t["top"]) == 2 and t["top"][0][1] >= t["top"][1][1] for t in record["logprobs"])
    bad = CliRunner().invoke(app, ["generate", "--model", str(target), "--input-ids", "1", "--logprobs", "21",
                                   "--json"])
    assert bad.exit_code == 2 and "logprobs must be in [0, 20]" in bad.stderr
    text = CliRunner().invoke(app, ["generate", "--model", str(target), "--input-ids", "1", "--logprobs", "2"])
    assert text.exit_code == 2 and "--logprobs is reported in the --json output" in text.stderr  # (not ignored)
