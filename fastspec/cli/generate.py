"""`fastspec generate`: one completion per prompt (or token-id list), as text or one JSON object."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from fastspec.cli.common import (Notes, flag_names, parse_bias, parse_token_ids, prepare_progress,
                                 refuse_lossy_thresholds, stdout_refusals, stop_on_ctrl_c)
from fastspec.cli.options import ModelOptions
from fastspec.errors import FastspecError


def generate(
    options: ModelOptions,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt text (repeat for a batch).")] = None,
    input_ids: Annotated[Optional[str], typer.Option(help="Prompt as comma-separated token ids.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Maximum tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="-1 = off.")] = -1,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    ignore_eos: bool = False,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable); trimmed from the text.")] = None,
    stop_token_ids: Annotated[Optional[str], typer.Option(help="Comma-separated token ids that end generation.")] = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template to --prompt.")] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: the target's logprob of each output token and of its N most likely alternatives (0-20).")] = None,
    repetition_penalty: Annotated[float, typer.Option(help="> 1 discourages prompt and output tokens (1 = off).")] = 1.0,
    frequency_penalty: Annotated[float, typer.Option(help="Subtracted per occurrence in the output, in [-2, 2].")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(help="Subtracted once per token in the output, in [-2, 2].")] = 0.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min-p x the most likely one's probability.")] = 0.0,
    logit_bias: Annotated[Optional[str], typer.Option(help="Comma-separated id:bias pairs added to the logits, e.g. 5:2.5,17:-100.")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="Structured output: the answer is JSON valid under this schema (the schema, or a file holding it).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Structured output: the answer matches this regular expression (or a file's).")] = None,
    ebnf: Annotated[Optional[str], typer.Option(help="Structured output: the answer follows this GBNF grammar, root ::= ... (or a file's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
):
    """Generate a completion (or several, with repeated --prompt)."""
    from fastspec.llm import LLM

    params = sampling_params(**locals())
    if params.greedy:
        refuse_lossy_thresholds(options, "fastspec generate decodes greedily here (--temperature 0 or --top-k 1)")
    prompts = [parse_token_ids(input_ids)] if input_ids is not None else list(prompt)
    notes = Notes()
    kwargs = options.llm_kwargs()
    kwargs["max_running_requests"] = min(kwargs["max_running_requests"], len(prompts))  # the batch is all it runs
    llm = LLM(**kwargs, on_prepare=prepare_progress(), say=notes)
    # the engine's refusal of an id out of the vocabulary names the flag that gave it (a --prompt's ids: no flag)
    id_flags = flag_names({"input_ids", "stop_token_ids", "logit_bias"},
                          {"prompt": "input_ids"} if input_ids else {})
    with stop_on_ctrl_c() as interrupted, id_flags:  # Ctrl-C: what each answer has so far is printed, then exit 130
        outputs = llm.generate(prompts, params, chat=chat, should_stop=interrupted.is_set)
    notes.show()
    if (not chat and input_ids is None and llm.tokenizer.chat_template
            and any(not o.output_ids[:-1] and o.finish_reason == "stop" for o in outputs)):
        typer.echo("note: the model ended at once (a chat model continues raw text; --chat applies its chat "
                   "template to --prompt)", err=True)
    texts = [o.text if o.text is not None else ",".join(map(str, o.output_ids)) for o in outputs]
    result = json.dumps(as_record(outputs)) if as_json else None
    with stdout_refusals(lambda: result or json.dumps(texts, ensure_ascii=False)):
        if as_json:
            typer.echo(result)
        else:
            for i, text in enumerate(texts):
                if len(outputs) > 1:
                    typer.echo(f"--- answer {i + 1} of {len(outputs)} ---")
                typer.echo(text)
        sys.stdout.flush()  # (a refusal surfaces here, not in the interpreter's last flush)
    if interrupted.is_set():
        raise typer.Exit(130)


def as_record(outputs) -> dict:
    """--json's object: one record, or {"outputs": [...]} for several prompts. `plain_tokens`: the output tokens no
    verify round emitted (the prefill's first one and plain decode steps: the measured fallback's, a plain tier's)."""
    records = [{"output_ids": o.output_ids, "text": o.text, "finish_reason": o.finish_reason,
                "num_prompt_tokens": len(o.prompt_ids), **o.metrics.as_dict(),
                "plain_tokens": len(o.output_ids) - o.metrics.emitted_tokens,
                **({} if o.logprobs is None else {"logprobs": [
                    {"token": t.token, "logprob": t.logprob, "top": [[i, v] for i, v in t.top]}
                    for t in o.logprobs]})} for o in outputs]
    return records[0] if len(records) == 1 else {"outputs": records}


def check_flags(prompt, input_ids, chat, as_json, **flags) -> None:
    """generate's own flags, checked with the shared ones (before torch is imported: a bad flag answers at once)."""
    if flags.get("logprobs") is not None and not as_json:
        raise FastspecError("--logprobs is reported in the --json output: give --json too")
    if (prompt is None) == (input_ids is None):
        raise FastspecError("give exactly one of --prompt or --input-ids")
    if chat and input_ids is not None:
        raise FastspecError("--chat applies to --prompt, not to --input-ids")
    if input_ids is None and any(p == "" for p in prompt):
        raise FastspecError("empty prompt")
    if input_ids is not None:  # (each in the vocabulary: checked once the model is read)
        parse_token_ids(input_ids)
    sampling_params(**flags)


def sampling_params(temperature, top_k, top_p, seed, max_new_tokens, ignore_eos, stop, logprobs, repetition_penalty,
                    frequency_penalty, presence_penalty, min_p, logit_bias, stop_token_ids, json_schema, regex, ebnf,
                    **_):
    flags = set(locals())  # (the parameters, each a flag)
    from fastspec.sampling.params import SamplingParams, read_grammar_arg

    with flag_names(flags):
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=tuple(stop or ()),
                              logprobs=logprobs,
                              repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, min_p=min_p, logit_bias=parse_bias(logit_bias),
                              stop_token_ids=tuple(parse_token_ids(stop_token_ids, "--stop-token-ids"))
                              if stop_token_ids else (), json_schema=read_grammar_arg(json_schema),
                              regex=read_grammar_arg(regex), ebnf=read_grammar_arg(ebnf))


generate.check_flags = check_flags
