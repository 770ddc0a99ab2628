"""A packed Llama-family layer stack run eagerly on CPU with the fused kernels between its GEMMs
(fastspec.kernels.cpu_fused): per layer the four GEMMs and four calls (norm, rope + KV write, attention, SiLU-and-mul)
instead of ~80 torch ops, and the whole stack as one C call where every GEMM is fastspec's own (BlockLinear). The
same math as DecoderLayer's enter / hand_over / leave around Attention.attend, to float32 rounding (sums in another
order); CausalLM runs it where `fused_activation` says it applies, else the layers. An EAGLE-3 head's midlayer likewise
(`eagle3_midlayer`, where `eagle3_fused` says so).
Does not plan attention (the AttentionContext's plan is read as the torch backend's dense one) nor compile.
"""

from __future__ import annotations

import weakref

import torch

from fastspec.attention.context import AttentionContext
from fastspec.attention.paged import PagedAttnBackend, PagedPlan, kernel_for
from fastspec.attention.torch_backend import TorchAttnPlan
from fastspec.kernels import cpu_fused, cpu_q4
from fastspec.models.gguf_blocks import BLOCK
from fastspec.models.layers import MLP, DecoderLayer, RMSNorm
from fastspec.models.packed_layers import BlockLinear, Int4Linear
from fastspec.models.quant_layers import PermutedLinear

INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def fused_activation(model, x: torch.Tensor, attn) -> torch.dtype | None:
    """The dtype the fused stack feeds its GEMMs (an Int4Linear's activation; float32 for a BlockLinear, which rounds
    its input itself), or None where it does not apply: compiled code;
    not a packed float32 Llama-family stack on CPU (partial rope, offset norms, MoE layers excluded); attention
    that is not a float32 KV pool read through a dense plan; no C compiler (the twins are the layers' own ops)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    if model not in _ACTIVATIONS:  # the model's part of the answer, once per model (as its stack table)
        _ACTIVATIONS[model] = _stack_activation(model)
    act = _ACTIVATIONS[model]
    return act if act is not None and _fused_attention(attn) else None


_ACTIVATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _stack_activation(model)


def _stack_activation(model) -> torch.dtype | None:
    first = model.model.layers[0]
    if not (model.between_attention and all(type(layer.mlp) is MLP for layer in model.model.layers)  # no MoE
            and type(first) is DecoderLayer and type(first.input_layernorm) is RMSNorm
            and type(first.post_attention_layernorm) is RMSNorm
            and type(first.self_attn.q_norm) in (type(None), RMSNorm) and first.self_attn.qkv_proj is not None
            and first.mlp.gate_up_proj is not None
            and model.rope.rotary_dim == first.self_attn.head_dim):
        return None
    packed = [m for m in first.modules() if isinstance(m, Int4Linear | BlockLinear)]
    if not packed:
        return None
    return torch.float32 if isinstance(packed[0], BlockLinear) else packed[0].activation


def _fused_attention(attn) -> bool:
    """Whether cpu_fused's rope_write / attend can serve `attn`: a KV pool in a dtype they take read through a dense
    plan, and the C library built."""
    pool = attn.pool if isinstance(attn, AttentionContext) else None
    if pool is None or pool.k.dtype not in cpu_fused.KV or pool.v is None or not pool.k.is_contiguous():
        return False
    return dense_plan(attn) is not None and cpu_fused.available()


def dense_plan(attn) -> TorchAttnPlan | None:
    """The attention plan as the torch backend's dense padded one, or None (another backend's)."""
    if isinstance(attn.plan, TorchAttnPlan):
        return attn.plan
    if (isinstance(attn.plan, PagedPlan) and isinstance(attn.backend, PagedAttnBackend)
            and kernel_for(attn.plan.rows.device) == "torch"):
        return attn.backend.dense(attn.plan, cpu_fused.paged_dense_plan)
    return None


def _gemm(linear, h: torch.Tensor) -> torch.Tensor:
    """linear(h) for h [T, K] already in the activation dtype: a packed linear's kernel called directly (its forward's
    reshapes and casts would be four no-op dispatches per GEMM); a padded one's forward drops its zero rows."""
    if type(linear) is Int4Linear and linear.bias is None and not linear.padded and h.dtype == linear.activation:
        return INT4_MM(h, linear.packed, BLOCK, linear.scale_zero)
    if type(linear) is BlockLinear and linear.bias is None and not linear.padded and h.dtype == torch.float32:
        return cpu_q4.matmul(h, linear.packed, linear.scales, linear.levels)
    return linear(h)


def fused_layers(model, x: torch.Tensor, positions: torch.Tensor, attn, act: torch.dtype,
                 capture: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
    """x [T, H] float32 embeddings -> (the last layer's output, {layer id: residual stream entering it} for the
    `capture` layers)."""
    layers, pool, plan = model.model.layers, attn.pool, dense_plan(attn)
    cos, sin = model.rope.cos_sin(positions, torch.float32)
    slots = attn.plan.out_cache_loc  # the context's own plan names them (a paged plan's dense twin does not)
    states = {0: x} if 0 in capture else {}
    norm = layers[0].input_layernorm
    x, h = cpu_fused.add_rms_norm(x, None, norm.weight, norm.eps, act)
    # the whole stack in one C call; under torch's profiler the loop below (the same kernels, bit for bit), so that
    # `fastspec bench --profile` still sees each GEMM, attention and norm
    profiling = torch.autograd.profiler._is_profiler_enabled
    table = _stack_table(model) if cpu_fused.available() and not profiling else None
    if table is not None and pool.k.is_contiguous() and pool.v.is_contiguous():
        a = layers[0].self_attn
        x, captured = cpu_fused.decoder_stack(table, pool.k, pool.v, x, h, a.num_heads,
                                              layers[0].mlp.down_proj.in_features, norm.eps, cos, sin, slots, plan,
                                              a.scale, capture, _stack_scales(pool, len(layers), a.scale))
        return x, states | captured
    for i, layer in enumerate(layers):
        a, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        k_cache, v_cache = pool.k[a.layer_id], pool.v[a.layer_id]
        score_scale, kv_mul, out_mul = kv_scaled(pool, a.layer_id, a.scale)
        qkv = _gemm(a.qkv_proj, h)
        if a.q_norm is not None:
            qkv = cpu_fused.head_norms(qkv, a.q_norm.weight, a.k_norm.weight, a.num_heads, a.num_kv_heads, a.q_norm.eps)
        q = cpu_fused.rope_write(qkv, cos, sin, slots, k_cache, v_cache, a.num_heads, kv_mul)
        o = cpu_fused.attend(plan, q, k_cache, v_cache, score_scale, act, out_mul)
        x, h = cpu_fused.add_rms_norm(x, _gemm(a.o_proj, o), norm.weight, norm.eps, act)
        y = _gemm(mlp.down_proj, cpu_fused.silu_mul(_gemm(mlp.gate_up_proj, h), act))
        if i + 1 == len(layers):
            return x + y, states
        norm = layers[i + 1].input_layernorm
        x, h = cpu_fused.add_rms_norm(x, y, norm.weight, norm.eps, act)
        if i + 1 in capture:
            states[i + 1] = x
    raise AssertionError("unreachable: a model has at least one layer")


_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> its decoder_stack kv_scales


def _stack_scales(pool, num_layers: int, scale: float) -> torch.Tensor | None:
    """decoder_stack's kv_scales (float32 [L, 4], cpu_fused.c) of a pool with KV scales, else None; built once per
    pool (its scales and the model's softmax scale do not change)."""
    if pool.scales is None:
        return None
    if pool not in _SCALES:
        rows = [(s, *mul, out) for s, mul, out in (kv_scaled(pool, i, scale) for i in range(num_layers))]
        _SCALES[pool] = torch.tensor(rows, dtype=torch.float32)
    return _SCALES[pool]


def kv_scaled(pool, layer: int, scale: float) -> tuple[float, tuple[float, float], float]:
    """(attend's scale, rope_write's kv_mul, attend's out_mul) for `layer` of `pool`: its KV scales folded in as
    AttentionContext.attend folds them (scale, (1, 1), 1 where it has none)."""
    k_scale, v_scale = pool.scale(layer)
    return scale * k_scale, (1 / k_scale, 1 / v_scale), v_scale


def final_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """A fused stack's final norm over its output x [T, H]: a plain float32 RMSNorm as one cpu_fused call (five
    torch ops otherwise), any other norm as it is."""
    if type(norm) is RMSNorm and norm.weight.dtype == x.dtype == torch.float32 and cpu_fused.available():
        return cpu_fused.add_rms_norm(x.contiguous(), None, norm.weight, norm.eps, torch.float32)[1]
    return norm(x)


def eagle3_fused(layer, rope, embeds: torch.Tensor, hidden: torch.Tensor, attn) -> bool:
    """Whether eagle3_midlayer applies to an EAGLE-3 midlayer: float32 inputs on CPU, eager, its four linears
    fastspec's BlockLinears, plain RMSNorms, full rope, and attention cpu_fused serves."""
    a, mlp = layer.self_attn, layer.mlp
    if (torch.compiler.is_compiling() or hidden.device.type != "cpu"
            or not hidden.dtype == embeds.dtype == torch.float32):
        return False
    linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm)
    return (all(type(m) is BlockLinear for m in linears) and all(type(n) is RMSNorm for n in norms)
            and a.q_norm is None and rope.rotary_dim == a.head_dim and _fused_attention(attn))


def eagle3_midlayer(layer, rope, head_norm: RMSNorm, positions: torch.Tensor,
                    embeds: torch.Tensor,  # float32 [T, H]  the draft tokens' embeddings
                    hidden: torch.Tensor,  # float32 [T, H]  the fc'd target features or the previous step's carry
                    attn) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagle3Layer's forward and the head's final norm on the fused kernels: (carry [T, H], normed [T, H]), the
    same math as Eagle3Layer to float32 rounding (the C kernels sum in another order)."""
    a, mlp, f32 = layer.self_attn, layer.mlp, torch.float32
    k_cache, v_cache = attn.pool.k[a.layer_id], attn.pool.v[a.layer_id]
    cos, sin = rope.cos_sin(positions, f32)
    embeds, hidden = embeds.contiguous(), hidden.contiguous()  # the kernels read rows H floats apart
    _, e = cpu_fused.add_rms_norm(embeds, None, layer.input_layernorm.weight, layer.input_layernorm.eps, f32)
    _, hn = cpu_fused.add_rms_norm(hidden, None, layer.hidden_norm.weight, layer.hidden_norm.eps, f32)
    qkv = _gemm(a.qkv_proj, torch.cat([e, hn], -1))  # [T, 2H] in
    score_scale, kv_mul, out_mul = kv_scaled(attn.pool, a.layer_id, a.scale)
    q = cpu_fused.rope_write(qkv, cos, sin, attn.plan.out_cache_loc, k_cache, v_cache, a.num_heads, kv_mul)
    o = cpu_fused.attend(dense_plan(attn), q, k_cache, v_cache, score_scale, f32, out_mul)
    post = layer.post_attention_layernorm
    h, normed = cpu_fused.add_rms_norm(hn if layer.norm_before_residual else hidden, _gemm(a.o_proj, o),
                                       post.weight, post.eps, f32)
    y = _gemm(mlp.down_proj, cpu_fused.silu_mul(_gemm(mlp.gate_up_proj, normed), f32))
    return cpu_fused.add_rms_norm(h, y, head_norm.weight, head_norm.eps, f32)


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its decoder_stack table, or None)


def _stack_table(model) -> torch.Tensor | None:
    """int64 [L, 29]: the addresses cpu_fused.decoder_stack reads each layer's weights from (its four BlockLinears'
    packed weights and scales, its post-attention norm, the next layer's input norm), its linears' bit widths, their
    input orders (a PermutedLinear's; 0: none), 4-bit levels (0: none), QKV's bias and the q / k head norms' weights
    (0: none) and the linears' weight groups (values per scale), or None where a layer is not that (another kernel,
    a padded linear, a bias beside another GEMM than QKV, norms with different eps, KV not at the layer's own index).
    Built once per model: a loaded model's tensors do not move."""
    if model not in _TABLES:
        layers, rows = model.model.layers, []
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            linears = [a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj]
            perms = [m.perm if type(m) is PermutedLinear else None for m in linears]
            linears = [m.inner if type(m) is PermutedLinear else m for m in linears]
            norms = (layer.post_attention_layernorm, layers[i + 1].input_layernorm if i + 1 < len(layers) else None)
            heads = (a.q_norm, a.k_norm)  # Qwen3's, or None
            bias = linears[0].bias
            if (any(type(m) is not BlockLinear or m.padded for m in linears)
                    or any(m.bias is not None for m in linears[1:])
                    or (bias is not None and bias.dtype != torch.float32)
                    or a.layer_id != i
                    or any(n is not None and n.eps != layers[0].input_layernorm.eps for n in norms + heads)):
                _TABLES[model] = None
                break
            rows.append([t.data_ptr() for m in linears for t in (m.packed, m.scales)]
                        + [0 if n is None else n.weight.data_ptr() for n in norms]
                        + [cpu_q4.bits(m.packed) for m in linears]
                        + [0 if p is None else p.data_ptr() for p in perms]
                        + [0 if m.levels is None else m.levels.data_ptr() for m in linears]
                        + [0 if bias is None else bias.data_ptr()]
                        + [0 if n is None else n.weight.data_ptr() for n in heads]
                        + [cpu_q4.weight_group(m.packed, m.scales) for m in linears])
        else:
            _TABLES[model] = torch.tensor(rows, dtype=torch.int64)
    return _TABLES[model]
