"""Attention: metadata builders, the pure-torch reference backend and the per-forward context."""

from fastspec.attention.context import AttentionBackend, AttentionContext, KVPoolLike
from fastspec.attention.flashinfer_backend import make_backend
from fastspec.attention.metadata import (
    AttnMetadata,
    AttnMode,
    decode_metadata,
    draft_decode_metadata,
    draft_extend_metadata,
    extend_metadata,
    verify_metadata,
)
from fastspec.attention.torch_backend import TorchAttnBackend, TorchAttnPlan

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttnMetadata",
    "AttnMode",
    "KVPoolLike",
    "TorchAttnBackend",
    "TorchAttnPlan",
    "decode_metadata",
    "draft_decode_metadata",
    "draft_extend_metadata",
    "extend_metadata",
    "make_backend",
    "verify_metadata",
]
