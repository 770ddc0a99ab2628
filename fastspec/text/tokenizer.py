"""Text <-> token ids for a model directory: `tokenizer.json` through the `tokenizers` library, chat templates
through a sandboxed jinja2 environment configured like transformers' (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `tojson`).

Why not transformers' AutoTokenizer: importing and building it costs ~6 s of start-up on this CPU, the Rust
tokenizer alone ~0.2 s. tests/test_tokenizer.py checks both agree on the embedded model.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from fastspec.errors import BadField, FastspecError, first_line
from fastspec.models.hub import read_tokenizer


CHAT_SPECIAL_TOKENS = "fastspec_chat_special_tokens"  # tokenizer_config.json: frame a chat prompt as llama.cpp does


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        try:
            self._tok = read_tokenizer(path)
        except Exception as e:
            raise FastspecError(f"{path}: cannot load the tokenizer ({first_line(e, None)})") from None
        self.config = _read_json(Path(model_dir) / "tokenizer_config.json")
        template_file = Path(model_dir) / "chat_template.jinja"
        self.chat_template = (template_file.read_text() if template_file.is_file()
                              else self.config.get("chat_template"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it runs (encode holds it): a long prompt being tokenized does not
        # stop the process's other threads (a server's engine steps and its other clients' streams)
        return self._tok.encode_batch([valid_text(text)], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, int]:
        """The special added tokens (text -> id): what a decode that skips special tokens leaves out."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool | None = None,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> str:
        """`tools`: OpenAI-style function dicts, passed to the template as transformers passes them.
        `continue_final_message`: the text ends inside the last message, right after its content (no end of turn),
        for the model to continue it (transformers' and vLLM's flag); `add_generation_prompt` (None: unless
        continuing) opens a new assistant turn instead, so both at once are refused."""
        if not self.chat_template:
            raise FastspecError("the model's tokenizer has no chat template")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message:
            if add_generation_prompt:
                raise BadField("continue_final_message continues the last message, add_generation_prompt starts a "
                               "new one: give add_generation_prompt=False", "add_generation_prompt")
            messages = _marked_final_message(messages)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **({} if tools is None else {"tools": tools}))
        except Exception as e:  # template errors are the model author's or the user's input, not ours
            raise FastspecError(f"chat template failed: {e}") from None
        return _cut_at_mark(text) if continue_final_message else text

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool | None = None, continue_final_message: bool = False) -> list[int]:
        """The rendered template's tokens as transformers' apply_chat_template gives them (no bos / eos of the
        tokenizer's own); a converted GGUF's (CHAT_SPECIAL_TOKENS) as llama.cpp frames a chat prompt: the tokenizer's
        bos / eos added where it adds them to any text, a bos / eos the template writes at that end dropped (one,
        not two). A continued final message gets no eos after it: that would end the turn it continues."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message)
        if not self.config.get(CHAT_SPECIAL_TOKENS):
            return self.encode(text, add_special_tokens=False)
        if self.config.get("add_bos_token") and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if not self.config.get("add_eos_token") or not self.eos_token:
            return self.encode(text, add_special_tokens=True)
        if not continue_final_message:
            return self.encode(text.removesuffix(self.eos_token), add_special_tokens=True)
        ids = self.encode(text, add_special_tokens=True)  # [bos?, text..., eos]: the text ends at the content
        return ids[:-1] if ids and ids[-1] == self.token_to_id(self.eos_token) else ids

    @cached_property
    def _template(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


# appended to the message to continue: where it lands in the rendered text is where that message's content ends
# (its trailing space is gone where the template trims the content: then so is the content's own trailing space)
CONTINUE_MARK = "<fastspec-continue-here> "


def _marked_final_message(messages: list[dict]) -> list[dict]:
    """`messages` with CONTINUE_MARK after the last message's text (a copy: the caller's are left as they were)."""
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or not isinstance(last.get("content"), str):
        raise BadField("continue_final_message needs a last message whose content is text", "messages")
    return [*messages[:-1], {**last, "content": last["content"] + CONTINUE_MARK}]


def _cut_at_mark(text: str) -> str:
    """The rendered `text` up to the mark: the last message's content, without what the template writes after it."""
    at = text.rfind(CONTINUE_MARK.strip())
    if at < 0:
        raise BadField("continue_final_message: the chat template does not show the last message's content, so "
                       "there is nothing to continue", "continue_final_message")
    return text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FastspecError(f"{path}: malformed JSON ({e})") from None


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def valid_text(text: str) -> str:
    """`text` as valid Unicode: bytes that were not UTF-8 (a terminal's or a file's, kept by Python as surrogate
    escapes) and lone surrogates (JSON's "\\ud800") become U+FFFD, as a UTF-8 decoder's `replace` leaves them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:  # surrogate escapes: the original bytes, decoded again with replacement
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # other lone surrogates
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)

