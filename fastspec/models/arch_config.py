"""Architecture-specific parts of a model's configuration: MLA (DeepSeek), MoE (DeepSeek, Qwen3-Next, Qwen3-MoE,
Mixtral), recurrent layers (Qwen3-Next's gated delta nets, Bamba's Mamba2 mixers), and the config.json parsers that
fill them (fastspec.models.model_config's ModelConfig.from_hf calls these). Nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastspec.errors import FastspecError


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
    """A mixture of experts: `top_k` of `num_experts` routed experts per token, plus shared experts that always run
    (DeepSeek's; Qwen3-Next's one gated shared expert; none in Qwen3-MoE and Mixtral)."""

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
    sparse_step: int = 1  # Qwen3-Next / Qwen3-MoE: layer i is MoE when (i + 1) % sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def validate(self, source: str) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise FastspecError(f"{source}: num_experts_per_tok {self.top_k} must be between 1 and the "
                                f"{self.num_experts} routed experts")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise FastspecError(f"{source}: inconsistent MoE routing (n_routed_experts {self.num_experts}, n_group "
                                f"{self.n_group}, topk_group {self.topk_group})")
        if self.scoring == "sigmoid" and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise FastspecError(f"{source}: num_experts_per_tok {self.top_k} exceeds the experts of topk_group groups")
        if self.sparse_step < 1:
            raise FastspecError(f"{source}: decoder_sparse_step {self.sparse_step} must be positive")
        if self.intermediate_size < 1:
            raise FastspecError(f"{source}: the experts' intermediate size {self.intermediate_size} must be positive")

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


def deepseek_fields(hf: dict, arch: str) -> dict:
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


def qwen3_next_fields(hf: dict) -> dict:
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


def sparse_moe_fields(hf: dict, arch: str) -> dict:
    """Qwen3-MoE and Mixtral: a Llama-family attention beside softmax-routed experts and no shared expert. Qwen3-MoE's
    experts have their own width, its routed weights are renormalised where norm_topk_prob says so (transformers'
    default: not), and decoder_sparse_step / mlp_only_layers leave some layers dense (intermediate_size); every
    Mixtral layer is MoE, its experts intermediate_size wide, its top-k weights always renormalised."""
    _check_silu(hf)
    qwen = arch == "Qwen3MoeForCausalLM"
    key = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 5 writes the latter
    experts = int(hf.get(key, 128 if qwen else 8))  # (absent: transformers' defaults)
    if qwen and experts == 0:
        return {"moe": None}  # every layer dense
    moe = MoEConfig(num_experts=experts, num_shared_experts=0,
                    intermediate_size=int(hf["moe_intermediate_size"] if qwen else hf["intermediate_size"]),
                    top_k=int(hf.get("num_experts_per_tok", 8 if qwen else 2)), n_group=1, topk_group=1,
                    scoring="softmax", topk_method="greedy",
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if qwen else True,
                    routed_scaling_factor=1.0, first_k_dense_replace=0,
                    sparse_step=int(hf.get("decoder_sparse_step", 1)) if qwen else 1,
                    mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()) if qwen else ())
    return {"moe": moe}


def bamba_fields(hf: dict) -> dict:
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


