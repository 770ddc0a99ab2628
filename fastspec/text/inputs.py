"""LLM's prompts as given -> a list of prompts, each text or a list of token ids: a string, a list of ints (one
prompt's ids, as vLLM reads it), a list of strings or of token-id lists (Python's ints or numpy's), and numpy / torch
integer arrays (1-D: one prompt's ids, as a list of ints is; 2-D: a batch, as a list of lists is). Checks kinds and
shapes only: tokenisation is the LLM's, and whether an id fits the vocabulary the engine's.
"""

from __future__ import annotations

import sys
from numbers import Integral

from fastspec.errors import FastspecError, first_line

PROMPTS = ("prompts must be a string, a list of token ids (one prompt), a list of strings or a list of token-id "
           "lists")


def as_prompts(prompts) -> list[str | list[int]]:
    """Each prompt as text or a list of ints; anything else a one-line FastspecError naming what it is. A non-empty
    list of ints is one prompt's ids ([1, 2, 3]: one prompt; [[1, 2], [3]]: two); an empty list, no prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        ids = _array_ids(prompts, "prompts", max_dims=2)
        return [ids] if prompts.ndim == 1 else ids
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_id(t) for t in prompts):
            return [[int(t) for t in prompts]]
        out = [_prompt(p) for p in prompts]
        if all(p is not None for p in out):
            return out
        _refuse_mixed(prompts, out)
    listed = isinstance(prompts, (list, tuple))
    dicts = isinstance(prompts, dict) or listed and any(isinstance(p, dict) for p in prompts)
    hint = " (not vLLM's {'prompt': text} / {'prompt_token_ids': ids} dicts: give the text or the ids)"
    raise FastspecError(PROMPTS + (hint if dicts else ""))


def _prompt(p) -> str | list[int] | None:
    """One prompt of a list: text, or its token ids (None: neither)."""
    if isinstance(p, str):
        return p
    if _is_array(p):
        return _array_ids(p, "a prompt", max_dims=1)
    if isinstance(p, (list, tuple)) and all(_is_id(t) for t in p):
        return [int(t) for t in p]
    return None


def _is_id(value) -> bool:
    """A token id: an int (Python's or numpy's), never a bool (True would read as id 1; numpy's is no Integral)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_bool(value) -> bool:
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or numpy is not None and isinstance(value, numpy.bool_)


def _refuse_mixed(prompts, read: list) -> None:
    """A list that is neither one prompt's ids nor a list of prompts (`read`: each entry as _prompt reads it), for a
    reason one line can name: bools among ids, or ids beside prompts (a FastspecError); returns otherwise."""
    items = [t for p in prompts for t in (p if isinstance(p, (list, tuple)) else [p])]
    if any(_is_bool(t) for t in items):
        raise FastspecError("prompts: token ids must be ints, got a bool (True / False are no token ids)")
    if any(_is_id(p) for p in prompts) and all(_is_id(p) or r is not None for p, r in zip(prompts, read)):
        raise FastspecError("prompts mixes token ids with other prompts: give one prompt's ids as a list of ints, "
                            "or several prompts as a list of strings or of token-id lists")


def _is_array(value) -> bool:
    """A numpy array or a torch tensor (neither library is imported for this: without it, no such value exists)."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (numpy is not None and isinstance(value, numpy.ndarray)
            or torch is not None and isinstance(value, torch.Tensor))


def _array_ids(array, what: str, max_dims: int) -> list:
    """An integer array's ids as Python ints (nested per row for 2-D); a bool / float array, one of more dimensions
    than `max_dims`, or one whose values cannot all be read (masked, on the meta device) is a FastspecError."""
    kind = str(array.dtype).removeprefix("torch.")
    if not (kind.startswith("int") or kind.startswith("uint")):  # (numpy's and torch's names alike: int64, uint8)
        raise FastspecError(f"{what} as an array must hold integer token ids, got {kind}")
    if not 1 <= array.ndim <= max_dims:
        shapes = "1-D (one prompt's ids)" + (" or 2-D (a batch of prompts)" if max_dims == 2 else "")
        raise FastspecError(f"{what} as an array must be {shapes}, got {array.ndim}-D")
    try:
        ids = array.tolist()
    except (NotImplementedError, RuntimeError) as e:  # (a meta tensor: no data to read)
        raise FastspecError(f"{what} as an array cannot be read ({first_line(e, None)})") from None
    if any(not isinstance(t, int) for row in (ids if array.ndim == 2 else [ids]) for t in row):
        raise FastspecError(f"{what} as an array must hold integer token ids, got masked values")  # (numpy.ma: None)
    return ids
