"""A quantised checkpoint's tensors read into quant_weights' exact forms: `decode_state` splits a checkpoint's
state dict into its float tensors and the forms of its quantised linears. Layouts, as their writers pack them:

  AWQ (GEMM)  qweight int32 [K, N/8]: output column 8 c + ORDER[i] in bits 4 i..4 i+3 of word c (ORDER =
              0 2 4 6 1 3 5 7); qzeros int32 [K/g, N/8] likewise; scales [K/g, N]; w = (q - z) * s
  GPTQ        qweight int32 [K * bits / 32, N]: input 32 / bits * r + i in bits bits * i.. of row r; qzeros int32
              [G, N * bits / 32] packed the same way along outputs, stored minus one in v1; scales [G, N]; g_idx [K]
              the group of each input (desc_act: not in order)
  compressed-tensors pack-quantized: weight_packed int32 [N, K * bits / 32] along inputs, value + 2^(bits-1)
              stored; weight_scale [N, K/g]; asymmetric: weight_zero_point int32 [N * bits / 32, K/g] packed the
              same way along outputs; w = (q - z) * s
  compressed-tensors int-quantized: weight int8 [N, K] as is; weight_scale [N, K/g], [N, 1] or one per tensor;
              asymmetric: weight_zero_point int8 of the scale's shape
Does not build modules (quant_layers) nor read files (loader).
"""

from __future__ import annotations

import torch

from fastspec.errors import FastspecError
from fastspec.kernels.fp8_block import FP8
from fastspec.models.gguf_blocks import Blocks
from fastspec.models.quant_config import QuantScheme
from fastspec.models.quant_weights import Fp8Weight, IntWeight, QuantWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i of an AWQ word


def decode_state(state: dict[str, torch.Tensor], scheme: QuantScheme, source: str
                 ) -> tuple[dict[str, torch.Tensor], dict[str, QuantWeight]]:
    """(the float tensors, {linear name: its quantised weight}) of a checkpoint's state dict, which it consumes (each
    linear's stored tensors leave `state` as they are decoded, so a large checkpoint is not held twice; the float
    tensors returned are `state` itself). A linear is quantised where its tensors say so (`qweight`,
    `weight_packed`, an e4m3 `weight`); the rest (embeddings, norms, an lm_head or router left in float) stay as
    they are. Every mismatch with `scheme` is one line naming the tensor."""
    floats, forms = state, {}
    by_module: dict[str, list[str]] = {}
    for key in state:
        by_module.setdefault(key.rpartition(".")[0], []).append(key)
    names = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    names += [k.removesuffix(".weight_packed") for k in state if k.endswith(".weight_packed")]
    names += [k.removesuffix(".weight") for k, t in state.items()
              if k.endswith(".weight") and t.dtype in (FP8, torch.int8)]
    for name in names:
        tensors = {k.rpartition(".")[2]: floats.pop(k) for k in by_module[name] if not k.endswith(".bias")}
        forms[name] = _decode(name, tensors, scheme, source)
    stray = [k for k in floats if k.endswith((".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                                              ".weight_zero_point", ".weight_g_idx"))]
    if stray:
        raise FastspecError(f"{source}: {stray[0]} has no quantised weight beside it")
    return floats, forms


def _decode(name: str, t: dict[str, torch.Tensor], scheme: QuantScheme, source: str) -> QuantWeight:
    where = f"{source}: {name}"
    if "qweight" in t:
        if scheme.method not in ("awq", "gptq"):
            raise FastspecError(f"{where}.qweight: a packed int weight in a {scheme.label} checkpoint")
        return (_awq if scheme.method == "awq" else _gptq)(t, scheme, where)
    if "weight_packed" in t:
        if scheme.method != "compressed-tensors" or scheme.kind != "int":
            raise FastspecError(f"{where}.weight_packed: a packed int weight in a {scheme.label} checkpoint")
        return _pack_quantized(t, scheme, where)
    if t["weight"].dtype == torch.int8:
        if scheme.method != "compressed-tensors" or scheme.kind != "int" or scheme.bits != 8:
            raise FastspecError(f"{where}.weight: an int8 weight in a {scheme.label} checkpoint")
        return _int_quantized(t, scheme, where)
    if scheme.kind != "fp8":
        raise FastspecError(f"{where}.weight: an fp8 weight in a {scheme.label} checkpoint")
    return _fp8(t, scheme, where)


def _need(t: dict, key: str, where: str) -> torch.Tensor:
    if key not in t:
        raise FastspecError(f"{where}.{key} is missing")
    return t[key]


def _words(t: dict, key: str, where: str) -> torch.Tensor:
    """A tensor of packed 32-bit words (int32 as every writer stores them; uint32 read as the same bits): another
    dtype packs a different number of values per word (GPTQModel's pack_dtype), so it is one line."""
    words = _need(t, key, where)
    if words.dtype not in (torch.int32, torch.uint32):
        raise FastspecError(f"{where}.{key} is stored as {str(words.dtype).removeprefix('torch.')}; packed weights "
                            "are read as int32 words")
    return words.view(torch.int32)


def _expect(tensor: torch.Tensor, shape: tuple, key: str, where: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise FastspecError(f"{where}.{key} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values along `dim`, value i of a word in bits bits * i.. (uint8)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed if dim == 1 else packed.t()
    values = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)  # [rows, words * 32 / bits]
    return (values if dim == 1 else values.t()).to(torch.uint8)


def _awq(t: dict, scheme: QuantScheme, where: str) -> IntWeight:
    qweight, qzeros, scales = _words(t, "qweight", where), _words(t, "qzeros", where), _need(t, "scales", where)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = scheme.group or k
    if k % group:
        raise FastspecError(f"{where}.qweight: {k} inputs are not a multiple of the group size {group}")
    if scales.dim() != 2 or scales.shape[1] != n:  # (which of the two is wrong only the model's shapes would say)
        raise FastspecError(f"{where}: qweight {tuple(qweight.shape)} holds {n} output columns, scales "
                            f"{tuple(scales.shape)} does not")
    _expect(scales, (k // group, n), "scales", where)
    _expect(qzeros, (k // group, n // 8), "qzeros", where)
    reorder = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j sits in nibble AWQ_ORDER.index(j)

    def columns(packed):  # [rows, N/8] int32 -> [rows, N] uint8, output columns in order
        return unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)[..., reorder].flatten(1)

    return _from_unsigned(columns(qweight).t(), columns(qzeros).t().float(), scales.t().float(), 4)


def _gptq(t: dict, scheme: QuantScheme, where: str) -> IntWeight:
    qweight, qzeros, scales = _words(t, "qweight", where), _words(t, "qzeros", where), _need(t, "scales", where)
    bits, per = scheme.bits, 32 // scheme.bits
    k, n = qweight.shape[0] * per, qweight.shape[1]
    group = scheme.group or k
    if k % group:
        raise FastspecError(f"{where}.qweight: {k} inputs are not a multiple of the group size {group}")
    groups = k // group
    _expect(scales, (groups, n), "scales", where)
    _expect(qzeros, (groups, n // per), "qzeros", where)
    q = unpack_int32(qweight, bits, 0).t()  # [N, K]
    z = unpack_int32(qzeros, bits, 1).t().float() + (1 if scheme.gptq_v1 else 0)  # [N, G]
    if scheme.gptq_v1:
        z = z.remainder(1 << bits)  # v1 stores zero - 1 in `bits` bits (a zero of 0 wrapped around)
    s = scales.t().float()
    g_idx = _need(t, "g_idx", where) if scheme.desc_act else t.get("g_idx")  # desc_act: required
    perm = _group_order(g_idx, k, group, "g_idx", where)
    if perm is not None:
        q = q[:, perm]
    return _from_unsigned(q, z, s, bits, perm)


def _from_unsigned(u: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int,  # [N, K] uint8; [N, K/g] float32
                   perm: torch.Tensor | None = None) -> IntWeight:
    """w = (u - z) * s per group, from unsigned `bits`-bit values u and zero points z in the same unsigned range:
    4-bit values kept as they are, 8-bit ones stored as int8 (u - 128, the offset takes the 128 back)."""
    if bits == 8:
        return IntWeight(Blocks((u.to(torch.int16) - 128).to(torch.int8).contiguous(), s.contiguous(),
                                ((128 - z) * s).contiguous(), 8), perm)
    return IntWeight(Blocks(u.contiguous(), s.contiguous(), (-z * s).contiguous(), 4), perm)


def _group_order(g_idx: torch.Tensor | None, k: int, group: int, key: str, where: str) -> torch.Tensor | None:
    """The input order that makes each group contiguous (None: already in order). desc_act (GPTQ) or actorder
    group (compressed-tensors) quantised the inputs in another order: g_idx names each input's group, `group`
    inputs to a group."""
    if g_idx is None:
        return None
    _expect(g_idx, (k,), key, where)
    g_idx = g_idx.long()
    in_order = torch.arange(k) // group
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], in_order):
        raise FastspecError(f"{where}.{key}: groups do not hold {group} inputs each")
    return perm


def _ct_order(t: dict, scheme: QuantScheme, k: int, group: int, where: str) -> torch.Tensor | None:
    """compressed-tensors' input order (actorder group: weight_g_idx, required where the config declares it)."""
    g_idx = _need(t, "weight_g_idx", where) if scheme.desc_act else t.get("weight_g_idx")
    return _group_order(g_idx, k, group, "weight_g_idx", where)


def _zero_points(t: dict, scheme: QuantScheme, where: str, read=_need) -> torch.Tensor | None:
    """The stored weight_zero_point as `read` takes it (_words: packed int32 words), None where symmetric; one where
    the config does not say so is one line."""
    if scheme.zero_points:
        return read(t, "weight_zero_point", where)
    if "weight_zero_point" in t:
        raise FastspecError(f"{where}.weight_zero_point: zero points in a symmetric compressed-tensors checkpoint")
    return None


def _pack_quantized(t: dict, scheme: QuantScheme, where: str) -> IntWeight:
    packed, scale = _words(t, "weight_packed", where), _need(t, "weight_scale", where)
    zero = _zero_points(t, scheme, where, _words)
    bits = scheme.bits
    n, k = (int(v) for v in t["weight_shape"].tolist()) if "weight_shape" in t else (packed.shape[0],
                                                                                    packed.shape[1] * 32 // bits)
    _expect(packed, (n, -(-k * bits // 32)), "weight_packed", where)
    group = scheme.group or k
    if k % group:
        raise FastspecError(f"{where}.weight_packed: {k} inputs are not a multiple of the group size {group}")
    _expect(scale, (n, k // group), "weight_scale", where)
    u = unpack_int32(packed, bits, 1)[:, :k]  # value + 2^(bits-1)
    perm = _ct_order(t, scheme, k, group, where)
    if perm is not None:
        u = u[:, perm]
    s, mid = scale.float(), 1 << (bits - 1)
    z = torch.full_like(s, mid)  # (the zero point + 2^(bits-1), as the values)
    if zero is not None:
        _expect(zero, (-(-n * bits // 32), k // group), "weight_zero_point", where)
        z = unpack_int32(zero, bits, 0)[:n].float()
    return _from_unsigned(u, z, s, bits, perm)


def _int_quantized(t: dict, scheme: QuantScheme, where: str) -> IntWeight:
    weight, scale = t["weight"], _need(t, "weight_scale", where).float()
    zero = _zero_points(t, scheme, where)
    n, k = weight.shape
    group = scheme.group or k
    if k % group:
        raise FastspecError(f"{where}.weight: {k} inputs are not a multiple of the group size {group}")

    def per_group(x, key):  # a value per tensor spread over the groups, else exactly [N, K/g]
        x = x.reshape(1, 1).expand(n, k // group) if x.numel() == 1 else x
        _expect(x, (n, k // group), key, where)
        return x.float().contiguous()
    scale = per_group(scale, "weight_scale")
    offset = torch.zeros(n, k // group) if zero is None else -per_group(zero, "weight_zero_point") * scale
    perm = _ct_order(t, scheme, k, group, where)
    q = weight if perm is None else weight[:, perm]
    return IntWeight(Blocks(q.contiguous(), scale, offset.contiguous(), 8), perm)


def _fp8(t: dict, scheme: QuantScheme, where: str) -> Fp8Weight:
    weight = t["weight"]
    n, k = weight.shape
    inverse = "weight_scale_inv" in t or (scheme.method == "fp8" and scheme.block is not None)  # (HF's block fp8)
    key = "weight_scale_inv" if inverse else "weight_scale"
    scale = _need(t, key, where).float()
    if scheme.block is not None:
        rows, cols = scheme.block
        _expect(scale, (-(-n // rows), -(-k // cols)), key, where)
        return Fp8Weight(weight, scale.repeat_interleave(rows, 0)[:n].contiguous(), cols)
    if scale.numel() == 1:
        return Fp8Weight(weight, scale.reshape(1, 1).expand(n, 1).contiguous(), k)
    if scale.numel() != n:
        raise FastspecError(f"{where}.{key} has {scale.numel()} values: neither one per tensor nor one per output "
                            f"channel ({n})")
    return Fp8Weight(weight, scale.reshape(n, 1).contiguous(), k)
