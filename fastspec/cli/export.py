"""`fastspec export-draft`: a draft head (any format fastspec reads: SGLang / SpecForge, EAGLE-1, speculators) written
in the SGLang format or in vLLM's speculators format, so a head trained here runs in SGLang and vLLM unchanged.
Registered on the app by fastspec.cli.main; errors become one line through user_errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from fastspec.cli.common import stdout_refusals

FORMATS = ("sglang", "speculators")


def export_draft(
    head: Annotated[str, typer.Argument(help="The head: a directory or a hub id (org/name).")],
    out: Annotated[Path, typer.Argument(help="Directory to write (created; must be empty or absent).")],
    format: Annotated[str, typer.Option(help="sglang (LlamaForCausalLMEagle3, midlayer.*) or speculators "
                                             "(Eagle3DraftModel, layers.0.*, for vLLM).")] = "speculators",
    verifier: Annotated[Optional[str], typer.Option(help="The target, as --model takes it (an embedded model's name, "
                                                         "a directory, a .gguf file or a hub id), recorded by the "
                                                         "speculators format (vLLM reads it).")] = None,
) -> None:
    """Write a draft head in another format (round trip: the same drafts)."""
    from safetensors.torch import save

    from fastspec.errors import FastspecError
    from fastspec.models.draft_formats import from_speculators, is_speculators, to_speculators
    from fastspec.models.draft_loader import draft_key, read_draft_config
    from fastspec.models.loader import read_state_dict, weight_names
    from fastspec.models.hub import check_model_spec
    from fastspec.models.sources import resolve_model_dir
    from fastspec.utils.files import write_directory

    if format not in FORMATS:
        raise FastspecError(f"--format must be {' or '.join(FORMATS)}, got {format!r}")
    if format == "speculators" and not verifier:
        raise FastspecError("--format speculators records the target: give --verifier (the target, as --model "
                            "takes it)")
    if format == "sglang" and verifier:
        raise FastspecError("--verifier is recorded by --format speculators only: the sglang format has no place "
                            "for it")
    if out.exists() and not out.is_dir():
        raise FastspecError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise FastspecError(f"{out} exists and is not empty")
    blocking = next((p for p in out.parents if p.exists()), None)  # (making its parents would say "File exists")
    if blocking is not None and not blocking.is_dir():
        raise FastspecError(f"cannot write {out}: {blocking} is a file, not a directory")
    check_model_spec(head, "draft head", head=True)
    head = resolve_model_dir(head)
    config = read_draft_config(head, "EAGLE")  # every check a load makes (an EAGLE-1 label read as the head it is)
    if not config.is_draft:
        raise FastspecError(f"{head}: {config.architecture} is not a draft head")
    raw = json.loads((head / "config.json").read_text())
    if is_speculators(raw):
        raw = from_speculators(raw, str(head), "fc.bias" in weight_names(head))
    raw["architectures"] = [config.architecture]
    state = {draft_key(k, config): v.contiguous() for k, v in read_state_dict(head).items()}
    if format == "speculators":
        raw, state = to_speculators(raw, state, verifier_record(verifier, config, head), str(head))
    text = json.dumps(raw, indent=1) + "\n"
    try:
        write_directory(out, {"model.safetensors": lambda f: f.write(save(state)),
                              "config.json": lambda f: f.write(text.encode())})
    except OSError as e:
        raise FastspecError(f"cannot write {out}: {e.strerror or e}") from None
    with stdout_refusals(lambda: f"{out} is written"):
        typer.echo(f"wrote {out} ({format})")


def verifier_record(spec: str, head_config, head: Path) -> dict:
    """speculators' `verifier` ({"name_or_path", "architectures"}); `spec` is whatever --model takes, resolved in its
    order (resolve_model_dir: an embedded name, a hub id, a directory or a .gguf file, converted once). A hub id is not
    downloaded: checked where the hub cache holds its config, else kept as given (vLLM resolves it where it runs).
    Recorded as what another engine loads: an embedded model's repository, a hub id as given, else the absolute path
    (a .gguf file's own); the head is checked against the target's config wherever it is on this machine."""
    from fastspec.errors import FastspecError
    from fastspec.models import hub
    from fastspec.models.draft_loader import check_draft_fits
    from fastspec.models.embedded import EMBEDDED_MODELS
    from fastspec.models.loader import read_config
    from fastspec.models.sources import resolve_model_dir

    hub.check_model_spec(spec, "--verifier")
    if spec in EMBEDDED_MODELS:  # its converted directory here; its repository for the engine that loads the head
        directory, name = resolve_model_dir(spec), EMBEDDED_MODELS[spec].hub_id
    elif hub.is_hub_id(spec):
        directory, name = hub.cached_config(spec), spec
        if directory is None:
            return {"name_or_path": spec, "architectures": []}
    else:
        directory, name = resolve_model_dir(spec), str(Path(spec).expanduser().resolve())
    target = read_config(directory)
    if target.is_draft:  # (a head would otherwise be refused for whatever of it fits no target)
        raise FastspecError(f"--verifier {spec}: {target.architecture} is a draft head, not a target model")
    check_draft_fits(head_config, target, f"{head} with --verifier {spec}")
    architectures = json.loads((directory / "config.json").read_text()).get("architectures") or []
    return {"name_or_path": name, "architectures": architectures}
