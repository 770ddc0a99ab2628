"""A model's configuration: the Hugging Face config.json normalised once into a frozen value.

`ModelConfig.from_hf` reads the old (`rope_theta` / `rope_scaling`) and new (`rope_parameters`) rope spellings,
the Llama / Qwen / Mistral differences, DeepSeek-V2 / V3's MLA, MoE and MTP fields, Qwen3-MoE's and Mixtral's
experts, and EAGLE-3 draft fields.
Every unsupported value (architecture, rope type, quantisation) is a one-line FastspecError here, before any
weight is read. Nothing here touches tensors. The MLA / MoE / hybrid parts and their parsers: arch_config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastspec.errors import FastspecError, OptionError
from fastspec.models.arch_config import (
    HybridConfig,
    MLAConfig,
    MoEConfig,
    bamba_fields,
    deepseek_fields,
    qwen3_next_fields,
    sparse_moe_fields,
)
from fastspec.models.quant_config import read_scheme

__all__ = ["HybridConfig", "MLAConfig", "MoEConfig", "ModelConfig", "RopeScaling"]

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
MOE_FAMILY = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")  # Llama-family attention, a sparse MoE MLP
_NO_ATTENTION_BIAS = ("MistralForCausalLM", "MixtralForCausalLM")  # transformers' take no attention_bias
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
HYBRID_FAMILY = ("Qwen3NextForCausalLM", "BambaForCausalLM")
TARGET_ARCHITECTURES = LLAMA_FAMILY + MOE_FAMILY + DEEPSEEK_FAMILY + HYBRID_FAMILY
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLMEagle3")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "qwen3_next": "Qwen3NextForCausalLM", "bamba": "BambaForCausalLM"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (`llama3`), linear position scaling (`linear`) or YaRN (`yarn`, DeepSeek)."""

    rope_type: str  # "llama3" | "linear" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # cos/sin multiplier; None: derived from factor and the mscales
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # MLA: the rope head dim (qk_rope_head_dim), as transformers sets it
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None  # each query sees its last W keys (Mistral v0.1): contexts capped at W
    attention_bias: bool = False  # q/k/v projection bias (Qwen2; else config.json's, where transformers reads it)
    o_proj_bias: bool = False  # the output projection's (Llama / Qwen3 / Bamba with attention_bias, as transformers)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    initializer_range: float = 0.02  # std of random weights (--load-format dummy)
    mla: MLAConfig | None = None  # DeepSeek targets
    moe: MoEConfig | None = None
    hybrid: HybridConfig | None = None  # Qwen3-Next
    partial_rotary_factor: float = 1.0  # rope turns only the first head_dim * factor dims
    norm_offset: bool = False  # RMSNorm scales by (1 + weight) (Qwen3-Next)
    attn_output_gate: bool = False  # q_proj also yields a per-head gate; attention output * sigmoid(gate)
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last decoder layer (DeepSeek-V3)
    # EAGLE / EAGLE-3 draft heads only
    draft_vocab_size: int | None = None  # EAGLE-3 lm_head rows (None: the full vocabulary)
    target_hidden_size: int | None = None  # width of one target feature (EAGLE-3 fc input is 3x this)
    fc_bias: bool = False
    aux_layer_ids: tuple[int, ...] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's: the
    use_aux_hidden_state: bool = True              # residual stream entering layer id + 1 is captured)
    norm_before_residual: bool = False  # EAGLE-3: the midlayer's residual is hidden_norm(fc output), not the output
    fc_norm: bool = False  # EAGLE-3: an RMSNorm over the three target features before fc (`norm_before_fc`)

    @property
    def positions(self) -> int:
        """The positions the model's rope covers: max_position_embeddings, or a YaRN rope's original length x factor
        where that is longer (vLLM's derived length: Qwen's YaRN leaves max_position_embeddings at its pretrained
        value)."""
        s = self.rope_scaling
        yarn = 0 if s is None or s.rope_type != "yarn" else int(s.original_max_position_embeddings * s.factor)
        return max(self.max_position_embeddings, yarn)

    @property
    def context_limit(self) -> int:
        """The longest context served exactly: the rope's positions, or a sliding window's width where that is
        shorter (fastspec attends to the whole context; within W tokens that is what the window sees)."""
        return min(self.positions, self.sliding_window or self.positions)

    def context_len(self, requested: int | None) -> int:
        """The context an engine serves: `requested` (None: context_limit); past the trained positions or a sliding
        window, a one-line error naming the option (as SGLang and vLLM refuse a context length past
        max_position_embeddings)."""
        length = requested or self.context_limit
        if length > self.positions > self.max_position_embeddings:
            s = self.rope_scaling
            raise OptionError(f"{{max_context_len=}} exceeds the {self.positions} positions the model's YaRN rope "
                              f"covers (original_max_position_embeddings {s.original_max_position_embeddings} x "
                              f"factor {s.factor:g})", max_context_len=length)
        if length > self.positions:
            raise OptionError(f"{{max_context_len=}} exceeds the model's max_position_embeddings "
                              f"{self.max_position_embeddings}: positions past it were never trained (a longer "
                              "context needs the checkpoint's config.json to declare rope_scaling for it)",
                              max_context_len=length)
        if self.sliding_window and length > self.sliding_window:
            raise OptionError(f"{{max_context_len=}} exceeds the model's sliding attention window of "
                              f"{self.sliding_window} tokens, which fastspec does not implement (it attends to the "
                              "whole context, the same within the window)", max_context_len=length)
        return length

    @property
    def is_draft(self) -> bool:
        return self.architecture in DRAFT_ARCHITECTURES

    @property
    def is_eagle3(self) -> bool:
        return self.architecture == "LlamaForCausalLMEagle3"

    @property
    def load_lm_head_from_target(self) -> bool:
        """EAGLE-3 rule: an untied head without its own `draft_vocab_size` shares the target's lm_head."""
        return not self.tie_word_embeddings and self.draft_vocab_size is None

    @property
    def kv_layout(self) -> tuple[int, int, int, bool]:
        """(KV layers, KV heads, head dim, separate V) of the KV cache. MLA caches one latent "head" per token and
        reads V from its first kv_lora_rank dims, so it stores no separate V; a hybrid model caches KV only for
        its full-attention layers."""
        if self.mla is not None:
            return self.num_layers, 1, self.mla.latent_dim, False
        layers = self.num_layers - len(self.hybrid.linear_layers) if self.hybrid else self.num_layers
        return layers, self.num_kv_heads, self.head_dim, True

    @classmethod
    def from_hf(cls, hf: dict, *, source: str = "config.json") -> ModelConfig:
        arch = _architecture(hf, source)
        read_scheme(hf, source=source)  # an unsupported quantisation: refused here, before any weight is read
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            vocab = int(hf["vocab_size"])
            fields = dict(
                architecture=arch,
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=int(hf.get("intermediate_size_mlp") or hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("qk_rope_head_dim") if arch in DEEPSEEK_FAMILY else
                             hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                sliding_window=_sliding_window(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or (arch not in _NO_ATTENTION_BIAS
                                                             and bool(hf.get("attention_bias", False))),
                o_proj_bias=arch not in _NO_ATTENTION_BIAS + ("Qwen2ForCausalLM",)
                and bool(hf.get("attention_bias", False)),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_int_tuple(hf.get("eos_token_id")),
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                initializer_range=float(hf.get("initializer_range") or 0.02),
                **_rope_fields(hf),
                **_draft_fields(hf, arch),
                **(deepseek_fields(hf, arch) if arch in DEEPSEEK_FAMILY else {}),
                **(sparse_moe_fields(hf, arch) if arch in MOE_FAMILY else {}),
                **(qwen3_next_fields(hf) if arch == "Qwen3NextForCausalLM" else {}),
                **(bamba_fields(hf) if arch == "BambaForCausalLM" else {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            nulls = ", ".join(k for k, v in hf.items() if v is None)  # (int(None): the error names no field)
            what = f"{e}" if isinstance(e, KeyError) or not nulls else f"{e} (null fields: {nulls})"
            raise FastspecError(f"{source}: missing or malformed field {what}") from None
        config = cls(**fields)
        config.validate(source)
        return config

    def validate(self, source: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise FastspecError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                                f"num_key_value_heads {self.num_kv_heads}")
        if self.is_draft and self.num_layers != 1 and self.is_eagle3:
            raise FastspecError(f"{source}: an EAGLE-3 head has exactly one layer, not {self.num_layers}")
        for field in ("vocab_size", "hidden_size", "num_layers", "head_dim"):
            if getattr(self, field) <= 0:
                raise FastspecError(f"{source}: {field} must be positive")
        if self.moe is not None:
            self.moe.validate(source)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _architecture(hf: dict, source: str) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type", ""), "")
    if arch == "LlamaForCausalLMEagle3" or arch == "Eagle3LlamaForCausalLM":
        return "LlamaForCausalLMEagle3"
    if arch not in TARGET_ARCHITECTURES + DRAFT_ARCHITECTURES:
        known = ", ".join(TARGET_ARCHITECTURES + DRAFT_ARCHITECTURES)
        raise FastspecError(f"{source}: unsupported architecture {arch or '(none)'!r}; supported: {known}")
    return arch


def _sliding_window(hf: dict) -> int | None:
    """The attention window, where the config uses one (Qwen2 / Qwen3 configs carry a `sliding_window` they switch
    off with use_sliding_window false)."""
    window = hf.get("sliding_window")
    if window is None or hf.get("use_sliding_window") is False:
        return None
    return int(window)


def _int_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


ROPE_TYPES = ("llama3", "linear", "yarn")
_ROPE_FLOATS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor")


def _rope_fields(hf: dict) -> dict:
    """Old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) spellings of the same thing."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return {"rope_theta": theta, "rope_scaling": None}
    if kind not in ROPE_TYPES:
        raise FastspecError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    extra = {k: float(scaling[k]) for k in _ROPE_FLOATS if scaling.get(k) is not None}
    # unstated: a top-level one (Phi-3's spelling), else max_position_embeddings (transformers' defaults)
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or \
        hf.get("max_position_embeddings")
    if original is not None:
        extra["original_max_position_embeddings"] = int(original)
    if "truncate" in scaling:
        extra["truncate"] = bool(scaling["truncate"])
    factor = scaling.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek's rule: the context extension over the pretrained length
        factor = int(hf["max_position_embeddings"]) / extra["original_max_position_embeddings"]
    return {"rope_theta": theta, "rope_scaling": RopeScaling(kind, float(factor), **extra)}


def _draft_fields(hf: dict, arch: str) -> dict:
    if arch != "LlamaForCausalLMEagle3":  # EAGLE-2: fc has a bias unless the config says `"bias": false`
        return {"draft_vocab_size": hf.get("hot_vocab_size"), "fc_bias": bool(hf.get("bias", True))}
    eagle = hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return {
        "draft_vocab_size": int(hf["draft_vocab_size"]) if hf.get("draft_vocab_size") else None,
        "target_hidden_size": int(hf.get("target_hidden_size") or hf["hidden_size"]),
        "fc_bias": bool(hf.get("bias", False)),
        "aux_layer_ids": tuple(int(i) for i in ids) if ids is not None else None,
        "use_aux_hidden_state": bool(eagle.get("use_aux_hidden_state", True)),
        "norm_before_residual": bool(hf.get("norm_before_residual", False)),
        "fc_norm": bool(hf.get("norm_before_fc", False)),
    }
