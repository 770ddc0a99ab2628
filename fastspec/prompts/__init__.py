"""Built-in prompt sets (hand-written, one JSON object per line) and a JSONL reader.

Sets: chat, code, writing, explain, lists, rewrite, stories. Each built-in line is `{"prompt": "...", "split": "train" | "heldout"}`; `train` feeds `fastspec train-draft`,
`heldout` feeds `fastspec bench`, and no prompt is in both. This module only reads and validates prompt text:
it knows nothing about tokenizers, chat templates or models.
"""

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from fastspec.errors import FastspecError

PROMPT_SETS = ("chat", "code", "writing", "explain", "lists", "rewrite", "stories")
SPLITS = ("train", "heldout")
USER_ROLES = ("user", "human")  # a conversation turn's role (OpenAI, SpecForge) or `from` (ShareGPT)


def read_jsonl_prompts(path) -> list[str]:
    """The prompt of every non-blank line of a JSONL file, in file order: its `prompt`, or the first user message of
    its `conversations` (ShareGPT's {"from": "human", "value": ...}, SpecForge's {"role": "user", "content": ...})
    or `messages` (OpenAI's); other keys ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise FastspecError(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FastspecError(f"cannot read prompt file {path}: {exc}") from None
    return [record["prompt"] for _, record in _parse_records(text, str(path))]


def load_prompts(name: str = "chat", split: str | None = "heldout") -> list[str]:
    """Prompts of one built-in set (or every set, for name="all") in one split (both for split=None)."""
    if name != "all" and name not in PROMPT_SETS:
        raise FastspecError(f"unknown prompt set {name!r}; choose one of {', '.join(PROMPT_SETS)} or all")
    if split is not None and split not in SPLITS:
        raise FastspecError(f"unknown prompt split {split!r}; choose train or heldout (or None for both)")
    names = PROMPT_SETS if name == "all" else (name,)
    return [prompt for n in names for prompt, s in _builtin_records(n) if split is None or s == split]


@lru_cache(maxsize=None)
def _builtin_records(name: str) -> tuple[tuple[str, str], ...]:
    """(prompt, split) for every line of the packaged `<name>.jsonl`, split checked per line."""
    filename = f"{name}.jsonl"
    text = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    records = []
    for lineno, record in _parse_records(text, filename):
        if record.get("split") not in SPLITS:
            raise FastspecError(f"{filename}:{lineno}: \"split\" must be \"train\" or \"heldout\"")
        records.append((record["prompt"], record["split"]))
    return tuple(records)


def _parse_records(text: str, source: str) -> list[tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line; raises naming SOURCE:LINE on a bad one."""
    # split on "\n" only: str.splitlines() would also break on U+2028, which JSON allows unescaped in strings.
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        records.append((lineno, _parse_line(line, f"{source}:{lineno}")))
    if not records:
        raise FastspecError(f"no prompts in {source}")
    return records


def _parse_line(line: str, where: str) -> dict:
    """One JSON object with a non-empty string `prompt`, else FastspecError("WHERE: <what is wrong>")."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise FastspecError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise FastspecError(f"{where}: expected a JSON object, got {_json_type(record)}")
    if "prompt" not in record and isinstance(record.get("conversations", record.get("messages")), list):
        record = {**record, "prompt": _first_user_message(record.get("conversations", record.get("messages")), where)}
    if "prompt" not in record:
        raise FastspecError(f"{where}: missing \"prompt\" (or \"conversations\" / \"messages\")")
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise FastspecError(f"{where}: \"prompt\" must be a string, got {_json_type(prompt)}")
    if not prompt.strip():
        raise FastspecError(f"{where}: \"prompt\" is empty")
    return record


def _first_user_message(turns: list, where: str):
    """The text of the first user turn of a ShareGPT / SpecForge / OpenAI conversation (checked as a prompt)."""
    for turn in turns:
        if isinstance(turn, dict) and (turn.get("role") or turn.get("from")) in USER_ROLES:
            return _message_text(turn.get("content", turn.get("value")), where)
    raise FastspecError(f"{where}: the conversation has no user message (a \"role\": \"user\" or \"from\": "
                        "\"human\" turn)")


def _message_text(content, where: str) -> str:
    """A user turn's text: a string, or OpenAI's list of content parts ([{"type": "text", "text": ...}], joined
    as the server joins them)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise FastspecError(f"{where}: the first user message must be text (a string or a list of "
                            f"{{\"type\": \"text\"}} parts), got {_json_type(content)}"
                            + (" holding a part that is not text" if isinstance(content, list) else ""))
    return content


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names[type(value)]
