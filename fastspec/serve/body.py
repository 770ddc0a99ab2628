"""A request body as JSON: a dict, or a 400 (fastspec.serve.api_error) saying why not. Does not own the fields
(fastspec.serve.protocol checks each)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from fastspec.serve.api_error import APIError


def parse_body(raw: bytes) -> dict:
    """The body as a dict. A number no field takes (NaN, Infinity, 1e999 past a float's range, an integer longer than
    Python reads) is a 400 naming the field that holds it: json.loads reads the first three as a float a range check
    may let through (a json_schema's "maximum"), the last as a 500."""
    numbers = _Numbers()
    try:
        try:
            body = json.loads(raw, parse_float=numbers.real, parse_constant=numbers.unread)
        except ValueError as e:  # (an integer past int's digit limit: read it again, to name its field)
            if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            body = json.loads(raw, parse_float=numbers.real, parse_constant=numbers.unread,
                              parse_int=numbers.integer)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # (json reads nesting only as deep as Python's recursion limit)
        raise APIError("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items() if numbers.seen else ():
        number = _unread_in(value)
        if number is not None:
            rule = f"be {number.one}" if number is value else f"hold only {number.many}"
            raise APIError(f"{name} must {rule}, got {number.text}", param=name)
    return body


@dataclass(frozen=True)
class _Unread:
    """A number of a request body that no field takes, in its place: its text as sent (a long one: its length) and
    what a field's number must be (one, many)."""

    text: str
    one: str = "a finite number"
    many: str = "finite numbers"


class _Numbers:
    """json.loads' hooks for the numbers a float or an int cannot hold; `seen`: whether one was met."""

    seen = False

    def real(self, text: str) -> float | _Unread:
        value = float(text)
        return value if math.isfinite(value) else self.unread(text)

    def unread(self, text: str) -> _Unread:
        self.seen = True
        return _Unread(text if len(text) <= 24 else f"a number of {len(text)} characters")

    def integer(self, text: str) -> int | _Unread:
        try:
            return int(text)
        except ValueError:
            self.seen = True
            most = f"of at most {sys.get_int_max_str_digits()} digits"
            return _Unread(f"an integer of {len(text.lstrip('-'))} digits", f"an integer {most}", f"integers {most}")


def _unread_in(value) -> _Unread | None:
    """The first _Unread `value` holds at any depth (walked with a stack: the body may nest as deep as json read)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Unread):
            return item
        stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())
    return None
