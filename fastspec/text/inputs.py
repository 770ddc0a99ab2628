"""LLM's prompts as given -> a list of prompts, each text or a list of token ids: a string, a list of strings or of
token-id lists (Python's ints or numpy's), and numpy / torch integer arrays (1-D: one prompt's ids, as a string is
one prompt; 2-D: a batch, as a list of lists is). Checks kinds and shapes only: tokenisation is the LLM's, and
whether an id fits the vocabulary the engine's.
"""

from __future__ import annotations

import sys
from numbers import Integral

from fastspec.errors import FastspecError, first_line

PROMPTS = "prompts must be a string, a list of strings or a list of token-id lists"


def as_prompts(prompts) -> list[str | list[int]]:
    """Each prompt as text or a list of ints; anything else a one-line FastspecError naming what it is."""
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        ids = _array_ids(prompts, "prompts", max_dims=2)
        return [ids] if prompts.ndim == 1 else ids
    if isinstance(prompts, (list, tuple)):
        out = [_prompt(p) for p in prompts]
        if all(p is not None for p in out):
            return out
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
    if isinstance(p, (list, tuple)) and all(isinstance(t, Integral) and not isinstance(t, bool) for t in p):
        return [int(t) for t in p]
    return None


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
