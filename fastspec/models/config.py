"""A model's configuration: the Hugging Face config.json normalised once into a frozen value.

`ModelConfig.from_hf` reads the old (`rope_theta` / `rope_scaling`) and new (`rope_parameters`) rope spellings,
the Llama / Qwen / Mistral differences, DeepSeek-V2 / V3's MLA, MoE and MTP fields, and EAGLE-3 draft fields.
Every unsupported value (architecture, rope type, quantisation) is a one-line FastspecError here, before any
weight is read. Nothing here touches tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastspec.errors import FastspecError

LLAMA_FAMILY = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
HYBRID_FAMILY = ("Qwen3NextForCausalLM", "BambaForCausalLM")
TARGET_ARCHITECTURES = LLAMA_FAMILY + DEEPSEEK_FAMILY + HYBRID_FAMILY
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLMEagle3")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
               "bamba": "BambaForCausalLM"}


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
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2 / V3): K and V are made from one compressed latent per token."""

    q_lora_rank: int | None  # None: a plain q_proj (V2-Lite)
    kv_lora_rank: int  # width of the compressed KV latent (what the KV pool stores, plus the rope key)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rope over interleaved pairs (DeepSeek's layout) rather than rotate-half

    @property
    def latent_dim(self) -> int:
        """Per token and layer, the pool stores [compressed KV (kv_lora_rank) | rope key (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek's mixture of experts: shared experts always run, `top_k` of `num_experts` routed ones per token."""

    num_experts: int
    num_shared_experts: int
    intermediate_size: int  # of each expert (shared experts: times num_shared_experts)
    top_k: int
    n_group: int  # routed experts fall in n_group groups; a token picks from its best topk_group groups
    topk_group: int
    scoring: str  # "softmax" (V2) | "sigmoid" (V3: + e_score_correction_bias, groups ranked by their top-2 sum)
    topk_method: str  # V2: "greedy" | "group_limited_greedy"; V3: "noaux_tc"
    norm_topk_prob: bool  # V3: the chosen weights are renormalised to sum to 1
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers below this one have a dense MLP instead
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert's output is scaled by sigmoid(gate(x))
    shared_intermediate_size: int | None = None  # None: intermediate_size * num_shared_experts
    sparse_step: int = 1  # Qwen3-Next: layer i is MoE when (i + 1) % sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def is_moe_layer(self, layer_id: int) -> bool:
        return (layer_id >= self.first_k_dense_replace and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.sparse_step == 0)


@dataclass(frozen=True)
class HybridConfig:
    """Recurrent layers beside full attention: gated delta nets (Qwen3-Next: heads of k / v) or Mamba2 mixers
    (Bamba: heads of head_dim channels, a d_state-wide state, B / C shared by groups of heads)."""

    layer_types: tuple[str, ...]  # per layer: "linear_attention" (recurrent) | "full_attention"
    mixer: str  # "gated_delta" | "mamba2"
    num_k_heads: int  # gated delta: q / k heads; mamba2: B / C groups
    num_v_heads: int  # gated delta: v heads; mamba2: heads
    k_head_dim: int  # gated delta: q / k head dim; mamba2: d_state
    v_head_dim: int  # gated delta: v head dim; mamba2: head dim
    conv_kernel: int
    conv_bias: bool = False
    proj_bias: bool = False  # mamba2 in_proj / out_proj
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # mamba2: clamp of the softplus time step

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k, v (gated delta); x, B, C (mamba2)."""
        if self.mixer == "mamba2":
            return self.num_v_heads * self.v_head_dim + 2 * self.num_k_heads * self.k_head_dim
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """One layer's recurrent state: [Hv, Dk, Dv] (gated delta) or [heads, head_dim, d_state] (mamba2)."""
        if self.mixer == "mamba2":
            return self.num_v_heads, self.v_head_dim, self.k_head_dim
        return self.num_v_heads, self.k_head_dim, self.v_head_dim


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
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
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
    aux_layer_ids: tuple[int, ...] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids
    use_aux_hidden_state: bool = True

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
        _check_quantization(hf, source)
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
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3NextForCausalLM"),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_int_tuple(hf.get("eos_token_id")),
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                **_rope_fields(hf),
                **_draft_fields(hf, arch),
                **(_deepseek_fields(hf, arch) if arch in DEEPSEEK_FAMILY else {}),
                **(_qwen3_next_fields(hf) if arch == "Qwen3NextForCausalLM" else {}),
                **(_bamba_fields(hf) if arch == "BambaForCausalLM" else {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FastspecError(f"{source}: missing or malformed field {e}") from None
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
        m = self.moe
        if m is not None and (m.num_experts % m.n_group or not 1 <= m.topk_group <= m.n_group
                              or not 1 <= m.top_k <= m.num_experts):
            raise FastspecError(f"{source}: inconsistent MoE routing (n_routed_experts {m.num_experts}, n_group "
                                f"{m.n_group}, topk_group {m.topk_group}, num_experts_per_tok {m.top_k})")
        if m is not None and m.scoring == "sigmoid" and m.top_k > m.topk_group * (m.num_experts // m.n_group):
            raise FastspecError(f"{source}: num_experts_per_tok {m.top_k} exceeds the experts of topk_group groups")

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


def _check_quantization(hf: dict, source: str) -> None:
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise FastspecError(f"{source}: quantised checkpoints ({method}) are not supported; use a bf16 / fp16 / "
                            "fp32 copy of the weights")


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
    if "original_max_position_embeddings" in scaling:
        extra["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if "truncate" in scaling:
        extra["truncate"] = bool(scaling["truncate"])
    factor = scaling.get("factor")
    if factor is None and kind == "yarn":  # DeepSeek's rule: the context extension over the pretrained length
        factor = int(hf["max_position_embeddings"]) / extra["original_max_position_embeddings"]
    return {"rope_theta": theta, "rope_scaling": RopeScaling(kind, float(factor), **extra)}


def _deepseek_fields(hf: dict, arch: str) -> dict:
    _check_silu(hf)
    v3 = arch == "DeepseekV3ForCausalLM"
    q_lora = hf.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(hf["kv_lora_rank"]),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"]), rope_interleave=bool(hf.get("rope_interleave", True)) or not v3)
    experts = hf.get("n_routed_experts")
    moe = None
    if experts:
        method = "noaux_tc" if v3 else str(hf.get("topk_method", "greedy"))
        if method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise FastspecError(f"unsupported MoE topk_method {method!r} (supported: greedy, group_limited_greedy)")
        moe = MoEConfig(num_experts=int(experts), num_shared_experts=int(hf.get("n_shared_experts") or 0),
                        intermediate_size=int(hf["moe_intermediate_size"]), top_k=int(hf["num_experts_per_tok"]),
                        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                        scoring="sigmoid" if v3 else "softmax", topk_method=method,
                        norm_topk_prob=v3 and bool(hf.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)))
    return {"mla": mla, "moe": moe, "num_nextn_predict_layers": int(hf.get("num_nextn_predict_layers") or 0)}


def _qwen3_next_fields(hf: dict) -> dict:
    _check_silu(hf)
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0
                                      else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise FastspecError(f"layer_types must name linear_attention / full_attention for each of {n} layers")
    hybrid = HybridConfig(tuple(types), "gated_delta", int(hf["linear_num_key_heads"]),
                          int(hf["linear_num_value_heads"]), int(hf["linear_key_head_dim"]),
                          int(hf["linear_value_head_dim"]), int(hf["linear_conv_kernel_dim"]))
    if hybrid.num_v_heads % hybrid.num_k_heads:
        raise FastspecError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    experts = int(hf.get("num_experts") or 0)
    moe = None if not experts else MoEConfig(
        num_experts=experts, num_shared_experts=1, intermediate_size=int(hf["moe_intermediate_size"]),
        top_k=int(hf["num_experts_per_tok"]), n_group=1, topk_group=1, scoring="softmax", topk_method="greedy",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), routed_scaling_factor=1.0, first_k_dense_replace=0,
        shared_expert_gate=True, shared_intermediate_size=int(hf["shared_expert_intermediate_size"]),
        sparse_step=int(hf.get("decoder_sparse_step", 1)), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    params = dict(hf.get("rope_parameters") or {})
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    return {"hybrid": hybrid, "moe": moe, "partial_rotary_factor": factor, "norm_offset": True,
            "attn_output_gate": True}


def _bamba_fields(hf: dict) -> dict:
    """Bamba: Mamba2 mixers everywhere but `attn_layer_indices` (plain GQA attention, half the head rotated)."""
    _check_silu(hf)
    n, hidden = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    attention = set(hf.get("attn_layer_indices") or ())
    heads, expand = int(hf.get("mamba_n_heads", 128)), int(hf.get("mamba_expand", 2))
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = expand * hidden // heads if head_dim in (None, "auto") else int(head_dim)
    groups = int(hf.get("mamba_n_groups", 1))
    if heads * head_dim != expand * hidden or heads % groups:
        raise FastspecError(f"inconsistent Mamba2 shape: {heads} heads x {head_dim} != {expand} x {hidden}, or "
                            f"{groups} groups do not divide the heads")
    limit = tuple(_json_float(v) for v in (hf.get("time_step_limit") or (0.0, float("inf"))))
    hybrid = HybridConfig(tuple("full_attention" if i in attention else "linear_attention" for i in range(n)),
                          "mamba2", groups, heads, int(hf.get("mamba_d_state", 256)), head_dim,
                          int(hf.get("mamba_d_conv", 4)), conv_bias=bool(hf.get("mamba_conv_bias", True)),
                          proj_bias=bool(hf.get("mamba_proj_bias", False)), dt_limit=limit)
    params = dict(hf.get("rope_parameters") or {})
    return {"hybrid": hybrid, "partial_rotary_factor": float(params.get("partial_rotary_factor", 0.5))}


def _json_float(value) -> float:
    """A float as transformers may write it: plain, or {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _check_silu(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise FastspecError(f"unsupported hidden_act {hf['hidden_act']!r} (supported: silu)")


def _draft_fields(hf: dict, arch: str) -> dict:
    if arch != "LlamaForCausalLMEagle3":
        return {"draft_vocab_size": hf.get("hot_vocab_size")}
    eagle = hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return {
        "draft_vocab_size": int(hf["draft_vocab_size"]) if hf.get("draft_vocab_size") else None,
        "target_hidden_size": int(hf.get("target_hidden_size") or hf["hidden_size"]),
        "fc_bias": bool(hf.get("bias", False)),
        "aux_layer_ids": tuple(int(i) for i in ids) if ids is not None else None,
        "use_aux_hidden_state": bool(eagle.get("use_aux_hidden_state", True)),
    }
