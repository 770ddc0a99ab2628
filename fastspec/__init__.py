"""fastspec: EAGLE / EAGLE-3 speculative decoding inference. `fastspec.LLM` is the Python entry point."""

from fastspec.errors import FastspecError  # noqa: F401  (what every user-fixable failure raises)

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy, so `import fastspec.errors` (and the CLI's --help) do not pay for importing torch
    if name == "LLM":
        from fastspec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fastspec.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fastspec' has no attribute {name!r}")
