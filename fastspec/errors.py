"""User-facing errors: one class whose message is printed as a single line by the CLI (no traceback)."""

import difflib
import re
from collections.abc import Callable


class FastspecError(Exception):
    """A problem the user can fix (bad flag, bad model directory, missing package...).

    The message must be one line that names the problem; the CLI prints `error: <message>` and exits 2.
    """


class BadField(FastspecError):
    """A request refused for one of its fields, which `field` names as the engine's request has it: "prompt", or
    the SamplingParams field ("logit_bias", "stop_token_ids", a grammar's "json_schema" / "regex" / "ebnf" /
    "lark"); a chat's as LLM.chat names it ("messages", "add_generation_prompt", "continue_final_message"). A front
    end names its own field by it, never by the message's words (a server: OpenAI's param)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class OptionError(FastspecError):
    """An option of LLM refused (an engine option, a model's quantisation...). `values` holds each option it names
    (keyword: the value given) and any other value the user gave that it quotes (a path: `model_dir`); `words` names
    them by placeholders only, never by pasting a value in (its braces would be read as a placeholder): `{page_size}`
    the option, `{page_size=}` the option and its value, `{graphs=cuda}` the option and that value, `{device!r}` the
    value as Python writes it and `{model_dir!s}` as text, however the message is told; a name not in `values` (other
    braces) stays as it is. Its message names the options as LLM's keywords ("max_total_tokens must be >=
    page_size=16"; "quantization='gguf' runs on the CPU"), a command's by its flags (`told`: "--page-size 16",
    "--quantization gguf")."""

    def __init__(self, words: str, **values):
        self.words, self.values = words, values
        super().__init__(self.told(self.keyword))

    @staticmethod
    def keyword(name: str) -> str:
        """How LLM names option `name`: the keyword itself (a subclass's options may be keys of one: NgramError)."""
        return name

    def told(self, flag: Callable[[str], str]) -> str:
        """The message, each option named `flag(name)`: as LLM names it (`keyword`; its value as Python writes it)
        or the command's flag (its value as typed). A value's own braces are never read again."""
        def said(m: re.Match) -> str:
            name, conversion, equals, literal = m.group(1, 2, 3, 4)
            if name not in self.values:
                return m.group(0)
            value = self.values[name]
            if conversion:
                return repr(value) if conversion == "r" else str(value)
            if not equals:
                return flag(name)
            value = literal if literal else value
            if flag(name) == self.keyword(name):
                return f"{flag(name)}={value!r}"
            return f"{flag(name)} {'none' if value is None else value}"

        return re.sub(r"\{([a-z_]+)(?:!([rs])|(=?)([\w:.-]*))\}", said, self.words)


class RequestTooLong(OptionError):
    """A request that can never run: its prompt + max_new_tokens past `limit` ("context": the context length;
    "kv_pool": what the KV pool ever holds) of `capacity` tokens. `room`: the most new tokens its prompt leaves
    under both limits (< 1: the prompt alone fills one); `need`: the KV tokens it would hold ("kv_pool"), in whole
    pages of `page_size`. Its words name the length and the pool's size as options (`{max_new_tokens}`,
    `{max_total_tokens}`), which a command names by its flags (`told`); a server names its own request fields from
    the numbers (Engine.check_length)."""

    def __init__(self, limit: str, capacity: int, prompt_len: int, max_new_tokens: int, room: int, need: int = 0,
                 page_size: int = 1):
        self.limit, self.capacity, self.room = limit, capacity, room
        self.prompt_len, self.max_new_tokens, self.need, self.page_size = prompt_len, max_new_tokens, need, page_size
        if limit == "context":
            words = (f"prompt ({tokens(prompt_len)}) + {{max_new_tokens}} ({max_new_tokens}) exceeds the context "
                     f"length {capacity}")
        else:  # (a speculative round's headroom can be most of `need`)
            pages = f"whole pages of {page_size} and " if page_size > 1 else ""
            words = (f"a request of {prompt_len} prompt + {max_new_tokens} new tokens does not fit in the KV pool of "
                     f"{tokens(capacity)} (it needs {need}: {pages}a decode round's headroom; raise "
                     "{max_total_tokens})")
        super().__init__(words, max_new_tokens=max_new_tokens, max_total_tokens=capacity)


def tokens(count: int) -> str:
    """"1 token", "5 tokens": a count of tokens as a message prints it."""
    return f"{count} token{'' if count == 1 else 's'}"


class RunEnded(FastspecError):
    """A call another thread routed to a server's engine thread (Engine.call) that the server's run ended before
    running: the server stopped. A server answers it as a 503."""


def first_line(error: BaseException, limit: int | None = 120) -> str:
    """The first non-blank line of `error`'s message (its type name if it has none), cut to `limit` (None: whole):
    what a one-line FastspecError quotes of an exception from a library."""
    line = next((s.strip() for s in str(error).splitlines() if s.strip()), "") or type(error).__name__
    return line[:limit]


def name_hint(key: str, names: list[str], foreign: dict[str, str], listing: str) -> str:
    """What to tell of a keyword `key` that is none of `names`: `foreign`'s line for it (another project's name),
    else the closest of `names`, else `listing` and every name."""
    close = difflib.get_close_matches(key, names, n=1)
    return foreign.get(key) or (f"did you mean {close[0]}?" if close else f"{listing} {', '.join(names)}")


def no_attribute(obj: object, name: str, foreign: dict[str, str]) -> AttributeError:
    """What `obj.__getattr__` raises for a `name` it lacks: Python's AttributeError (hasattr, copy and pickle rely on
    its type), with `foreign`'s line for another project's name (vLLM's `.outputs`) added to its one line."""
    hint = foreign.get(name)
    return AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}" + (f"; {hint}" if hint else ""))
