"""Fused CPU kernels for the work of a decoder layer between its GEMMs: residual add + RMSNorm (+ the cast its GEMM
wants), SiLU-and-multiply, rope + the KV write, and attention over a dense padded plan.

Why: on CPU a packed 4-bit layer's GEMMs are a third of a decode step; the rest was ~80 torch ops per layer, each a
few microseconds of dispatch. `cpu_fused.c` does that work in four calls (built and loaded by cpu_library). Without
a compiler, or with FASTSPEC_FUSED_CPU=0, `available()` is False and every function runs its torch twin, which is
also what the tests compare the kernels against.
Knows nothing about models: tensors in, tensors out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastspec.attention.paged import PagedPlan, twin_plan
from fastspec.attention.torch_backend import TorchAttnBackend, TorchAttnPlan
from fastspec.kernels import cpu_library
from fastspec.memory.kv_pool import store_rows

ACT = {torch.float32: 0, torch.bfloat16: 1}  # the C code's `act` codes (cpu_rows.h) of the activations it takes
KV = {**ACT, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}  # ... and of the KV caches


def available() -> bool:
    return cpu_library.available()


def _rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:  # the twins' RMS normalisation over the last dim
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor,         # float32 [T, H]  the residual stream
                 y: torch.Tensor | None,  # [T, H]  added to it first (a GEMM's output, float32 or bf16), or None
                 weight: torch.Tensor,    # float32 [H]
                 eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, RMSNorm(x + y) in out_dtype): the residual stream and what the next GEMM reads."""
    lib = cpu_library.library()
    if lib is None:
        x = x if y is None else x + y
        return x, (weight * _rms_normed(x, eps)).to(out_dtype)
    T, H = x.shape
    x_out, normed = (x if y is None else torch.empty_like(x)), x.new_empty(T, H, dtype=out_dtype)
    cpu_library.call(lib.add_rms_norm, x.data_ptr(), _ptr(y), ACT[y.dtype] if y is not None else 0, weight.data_ptr(),
                     eps, T, H, x_out.data_ptr(), normed.data_ptr(), ACT[out_dtype])
    return x_out, normed


def silu_mul(gate_up: torch.Tensor,  # [T, 2I]  [gate | up], float32 or bf16
             out_dtype: torch.dtype) -> torch.Tensor:  # [T, I]
    lib = cpu_library.library()
    if lib is None:
        gate, up = gate_up.float().chunk(2, -1)
        return (F.silu(gate) * up).to(out_dtype)
    T, width = gate_up.shape
    out = gate_up.new_empty(T, width // 2, dtype=out_dtype)
    cpu_library.call(lib.silu_mul, gate_up.data_ptr(), ACT[gate_up.dtype], T, width // 2, out.data_ptr(),
                     ACT[out_dtype])
    return out


def head_norms(qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]  float32 or bf16, normed in place
               q_weight: torch.Tensor, k_weight: torch.Tensor,  # float32 [D] each
               num_heads: int, num_kv_heads: int, eps: float) -> torch.Tensor:
    """RMSNorm of each q and k head (Qwen3's q_norm / k_norm) in qkv, in place; returns qkv."""
    T, d = qkv.shape[0], q_weight.shape[0]
    lib = cpu_library.library()
    if lib is None:
        heads = qkv.view(T, -1, d)[:, :num_heads + num_kv_heads]
        weight = torch.cat([q_weight.expand(num_heads, d), k_weight.expand(num_kv_heads, d)])
        heads.copy_(weight * _rms_normed(heads.float(), eps))
        return qkv
    cpu_library.call(lib.head_norms, qkv.data_ptr(), ACT[qkv.dtype], T, num_heads, num_kv_heads, d,
                     q_weight.data_ptr(), k_weight.data_ptr(), eps)
    return qkv


def rope_write(qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]  float32 or bf16
               cos: torch.Tensor, sin: torch.Tensor,  # float32 [T, 1, D]  (sin's first half negated)
               slots: torch.Tensor,  # int64 [T]  KV slots of the T tokens
               k_cache: torch.Tensor, v_cache: torch.Tensor,  # [num_slots, Hkv, D]  one layer's, a KV dtype
               num_heads: int,
               kv_mul: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # q float32 [T, Hq, D], rotated
    """Rope on q and k, then K and V written to the cache at `slots` (times kv_mul: 1 / an fp8 cache's scales, then
    rounded to its dtype); returns q."""
    T, (hkv, d) = qkv.shape[0], k_cache.shape[1:]
    lib = cpu_library.library()
    if lib is None:
        q, k, v = qkv.float().view(T, -1, d).split([num_heads, hkv, hkv], 1)
        q, k = (z * cos + z.roll(d // 2, -1) * sin for z in (q, k))
        store_rows(k_cache, slots, k if kv_mul[0] == 1 else k * kv_mul[0])
        store_rows(v_cache, slots, v if kv_mul[1] == 1 else v * kv_mul[1])
        return q
    q = qkv.new_empty(T, num_heads, d, dtype=torch.float32)
    mul = None if kv_mul == (1.0, 1.0) else torch.tensor(kv_mul, dtype=torch.float32)
    cpu_library.call(lib.rope_write, qkv.data_ptr(), ACT[qkv.dtype], T, num_heads, hkv, d, cos.data_ptr(),
                     sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV[k_cache.dtype],
                     _ptr(mul), q.data_ptr())
    return q


def attend(plan: TorchAttnPlan, q: torch.Tensor,  # float32 [T, Hq, D]
           k_cache: torch.Tensor,  # [num_slots, Hkv, D]  one layer's, a KV dtype
           v_cache: torch.Tensor,  # [num_slots, Hkv, Dv]  K's strides: its own cache, or K's first Dv values (MLA)
           scale: float, out_dtype: torch.dtype, out_mul: float = 1.0) -> torch.Tensor:  # [T, Hq * Dv]
    """The torch backend's attention (TorchAttnBackend.run) over its dense plan, times out_mul (an fp8 cache's V
    scale), output in out_dtype."""
    T, hq, d = q.shape
    dv = v_cache.shape[-1]
    lib = cpu_library.library()
    if lib is None:
        o = TorchAttnBackend().run(plan, q, k_cache, v_cache, scale).reshape(T, hq * dv)
        return (o if out_mul == 1 else o * out_mul).to(out_dtype)
    max_qo = plan.q_index.shape[1]
    mask = None if plan.mask is None else plan.mask.contiguous()
    out = q.new_empty(T, hq * dv, dtype=out_dtype)
    cpu_library.call(lib.attend, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV[k_cache.dtype], T, hq,
                     k_cache.shape[1], d, dv, plan.out_index.data_ptr(), plan.kv_slots.data_ptr(), _ptr(mask), max_qo,
                     plan.kv_slots.shape[1], scale, out_mul, out.data_ptr(), ACT[out_dtype])
    return out


def paged_dense_plan(plan: PagedPlan) -> TorchAttnPlan:
    """attention.paged.twin_plan(plan's fields) in one C call where the library takes them (int32 table, CPU), else
    the twin itself: the dense padded plan the fused layers attend through, built once per forward."""
    lib = cpu_library.library()
    table, rows, prefix_lens = plan.table, plan.rows, plan.prefix_lens
    if (lib is None or table.device.type != "cpu" or table.dtype != torch.int32 or table.stride(1) != 1
            or (rows.dtype, prefix_lens.dtype, plan.block_slots.dtype, plan.block_mask.dtype)
            != (torch.int64, torch.int64, torch.int64, torch.bool)):
        return twin_plan(table, rows, prefix_lens, plan.block_slots, plan.block_mask, plan.self_visible)
    bs, q_rows, x = plan.block_mask.shape
    width = int(prefix_lens.max()) if bs else 0
    kv_slots = torch.empty(bs, width + x, dtype=torch.int64)
    mask = torch.empty(bs, 1, q_rows, width + x, dtype=torch.bool)
    rows, prefix_lens = rows.contiguous(), prefix_lens.contiguous()
    block_slots, block_mask = plan.block_slots.contiguous(), plan.block_mask.contiguous()
    cpu_library.call(lib.paged_dense_plan, table.data_ptr(), table.stride(0), rows.data_ptr(), prefix_lens.data_ptr(),
                     block_slots.data_ptr(), block_mask.data_ptr(), bs, q_rows, x, width, int(plan.self_visible),
                     kv_slots.data_ptr(), mask.data_ptr())
    index = torch.arange(bs * q_rows)
    return TorchAttnPlan(q_index=index.view(bs, q_rows), kv_slots=kv_slots, mask=mask, out_index=index,
                         out_cache_loc=index, uniform_qo=True)


def top_k(x: torch.Tensor,  # float32 [M, V]  (rows may be a slice of wider ones)
          k: int) -> torch.Tensor:  # int64 [M, k]
    """The indices of each row's k largest values, in no particular order (torch.topk's set; a tie may pick
    another index of the same value)."""
    lib = cpu_library.library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1
            or not 0 < k <= x.shape[-1]):
        return x.topk(k, -1).indices
    out = torch.empty(x.shape[0], k, dtype=torch.int64)
    cpu_library.call(lib.top_k, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:  # [..., V] -> int64 [...]
    """x.argmax(-1) (the first of equal values; the first NaN where there is one), over float32 CPU rows in one C
    pass (torch's takes ~80 us over a 49k vocabulary on CPU); anything else, or inside a compiled graph, torch's."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace library()
        return x.argmax(-1)
    lib = cpu_library.library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1
            or x.shape[-1] == 0):
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    cpu_library.call(lib.argmax_rows, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def rescore(q: torch.Tensor,  # int8 [V, H]  a table's values
            scale: torch.Tensor, offset: torch.Tensor,  # float32 [V, H / g] each
            ids: torch.Tensor,  # int64 [M, k]
            x: torch.Tensor,  # float32 [M, H]
            ) -> torch.Tensor | None:  # float32 [M, k]
    """x's dot products with the table rows `ids` names, each dequantised (q * scale + offset per group of g); None
    where the C kernels cannot take these tensors."""
    lib = cpu_library.library()
    tensors = (q, scale, offset, ids, x)
    if lib is None or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or (
            q.dtype, scale.dtype, offset.dtype, ids.dtype, x.dtype) != (
            torch.int8, torch.float32, torch.float32, torch.int64, torch.float32):
        return None
    out = x.new_empty(ids.shape)
    cpu_library.call(lib.rescore, q.data_ptr(), scale.data_ptr(), offset.data_ptr(), q.shape[1],
                     q.shape[1] // scale.shape[1], ids.data_ptr(), ids.shape[0], ids.shape[1], x.data_ptr(),
                     out.data_ptr())
    return out


def decoder_stack(layers: torch.Tensor,           # int64 [L, 29]  each layer's weights, widths, ... (cpu_fused.c)
                  k: torch.Tensor, v: torch.Tensor,  # [L, num_slots, Hkv, D]  the KV pool, a KV dtype
                  x: torch.Tensor,                # float32 [T, H]  the residual stream entering layer 0
                  h: torch.Tensor,                # float32 [T, H]  layer 0's normed input
                  num_heads: int, intermediate: int, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,  # as rope_write takes them
                  plan: TorchAttnPlan, scale: float,
                  capture: tuple[int, ...],
                  kv_scales: torch.Tensor | None = None,  # float32 [L, 4]  a scaled fp8 cache's (cpu_fused.c)
                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A layer stack on 4- to 8-bit weights (cpu_q4) in one C call: (the last layer's output, {layer id: the residual
    stream entering it} for the `capture` ids in 1..L-1). Its twin is the Python loop of
    fastspec.models.fused_cpu.fused_layers over the same kernels; only called where the library is built."""
    lib = cpu_library.library()
    L, T, (hkv, d) = layers.shape[0], x.shape[0], k.shape[2:]
    ids = [i for i in capture if 0 < i < L]
    capture_at = torch.full((L,), -1, dtype=torch.int64)
    capture_at[ids] = torch.arange(len(ids))
    captured = x.new_empty(len(ids), *x.shape)
    out = x.clone(memory_format=torch.contiguous_format)
    mask = None if plan.mask is None else plan.mask.contiguous()
    status = cpu_library.call(
        lib.decoder_stack, L, layers.data_ptr(), k.data_ptr(), v.data_ptr(), KV[k.dtype], k[0].numel(), out.data_ptr(),
        h.data_ptr(), T, x.shape[1], num_heads, hkv, d, intermediate, eps, cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), plan.out_index.data_ptr(), plan.kv_slots.data_ptr(), _ptr(mask), plan.q_index.shape[1],
        plan.kv_slots.shape[1], scale, _ptr(kv_scales), capture_at.data_ptr(), captured.data_ptr())
    if status:
        raise MemoryError("the fused layer stack's buffers")
    return out, dict(zip(ids, captured))
