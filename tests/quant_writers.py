"""Quantised checkpoints of the tiny models, written as each method's own tools write them (packing written here
from the published layouts, independently of fastspec's readers; compressed-tensors' own packer and dequantiser
where the package is installed), each with its oracle: the same transformers model over the exactly dequantised
weights."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order: nibble i of a word holds output column ORDER[i]
GROUP = 32
FP8 = torch.float8_e4m3fn

CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
             "checkpoint_format": "gptq"},
    "gptq8": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq_v2"},
    "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": GROUP}, "input_activations": None}}, "ignore": ["lm_head"]},
    "ct_int4_asym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                           "group_size": GROUP, "actorder": "group"}, "input_activations": None}},
        "ignore": ["lm_head"]},
    "ct_w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}}}, "ignore": ["lm_head"]},
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    "ct_fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}}},
        "ignore": ["lm_head"]},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    # ModelOpt keeps its settings in hf_quant_config.json, not in config.json
    "modelopt": {"producer": {"name": "modelopt", "version": "0.29.0"},
                 "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}},
    "modelopt_pb": {"producer": {"name": "modelopt", "version": "0.35.0"},
                    "quantization": {"quant_algo": "FP8_PB_WO", "kv_cache_quant_algo": None,
                                     "exclude_modules": ["lm_head"]}},
}


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned ints -> int32 [R * bits / 32, C]: row 32 / bits * r + i in bits bits * i.. of word row r."""
    per = 32 // bits
    v = values.to(torch.int64).view(-1, per, values.shape[1])
    word = sum(v[:, i] << (bits * i) for i in range(per))
    return (word - (word >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits as a signed int32


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, N] nibbles -> int32 [R, N / 8] in AutoAWQ's order."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    word = sum(v[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return (word - (word >= 2**31).long() * 2**32).to(torch.int32)


def _asym(w: torch.Tensor, bits: int, groups_of: torch.Tensor):
    """Asymmetric rounding of w [N, K] per group (groups_of [K]: each input's group): q, zero, scale (fp16)."""
    top = (1 << bits) - 1
    n_groups = int(groups_of.max()) + 1
    low = torch.stack([w[:, groups_of == g].amin(1) for g in range(n_groups)], 1).clamp(max=0)
    high = torch.stack([w[:, groups_of == g].amax(1) for g in range(n_groups)], 1).clamp(min=0)
    scale = ((high - low) / top).clamp_min(1e-4).half().float()  # [N, G]
    zero = torch.round(-low / scale).clamp(0, top)
    q = torch.round(w / scale[:, groups_of] + zero[:, groups_of]).clamp(0, top)
    return q, zero, scale


def quantise(w: torch.Tensor, method: str, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the tensors `method` stores for weight w [N, K], keyed by suffix; the dequantised weight). GPTQ's desc_act
    order comes from `gen` (linears over the same input get the same order, as GPTQ's act order does: it follows
    the input's statistics)."""
    n, k = w.shape
    if method == "awq":
        q, zero, scale = _asym(w, 4, torch.arange(k) // GROUP)
        deq = (q - zero.repeat_interleave(GROUP, 1)) * scale.repeat_interleave(GROUP, 1)
        return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zero.t()), "scales": scale.t().half()}, deq
    if method in ("gptq", "gptq8"):
        bits = 4 if method == "gptq" else 8
        g_idx = torch.arange(k) // GROUP
        if method == "gptq":  # desc_act: the groups run over a permutation of the inputs
            g_idx = g_idx[torch.argsort(torch.rand(k, generator=gen))]  # (each input's group)
        q, zero, scale = _asym(w, bits, g_idx)
        if method == "gptq8":  # symmetric: the zero in the middle
            zero = torch.full_like(zero, 128.0)
            scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-4).half().float().expand(-1, k // GROUP)
            q = torch.round(w / scale[:, g_idx] + 128).clamp(0, 255)
        deq = (q - zero[:, g_idx]) * scale[:, g_idx]
        stored_zero = (zero - 1).remainder(1 << bits) if method == "gptq" else zero  # v1: minus one
        return {"qweight": pack_rows(q.t(), bits), "qzeros": pack_rows(stored_zero, bits).t().contiguous(),
                "scales": scale.t().half().contiguous(), "g_idx": g_idx.to(torch.int32)}, deq
    if method == "ct_int4":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        scale = (w.view(n, -1, GROUP).abs().amax(-1) / 7).clamp_min(1e-4).to(torch.bfloat16).float()  # [N, K/g]
        q = torch.round(w / scale.repeat_interleave(GROUP, 1)).clamp(-8, 7)
        return ({"weight_packed": pack_to_int32(q.to(torch.int8), 4), "weight_scale": scale.to(torch.bfloat16),
                 "weight_shape": torch.tensor([n, k])}, q * scale.repeat_interleave(GROUP, 1))
    if method == "ct_int4_asym":  # compressed-tensors' own packer; signed values and zero points, groups in act
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # order (weight_g_idx)

        g_idx = (torch.arange(k) // GROUP)[torch.argsort(torch.rand(k, generator=gen))]  # each input's group
        q, zero, scale = _asym(w, 4, g_idx)  # unsigned 0..15
        q, zero, scale = (q - 8).to(torch.int8), (zero - 8).to(torch.int8), scale.to(torch.bfloat16)
        deq = (q.float() - zero.float()[:, g_idx]) * scale.float()[:, g_idx]
        return ({"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_g_idx": g_idx.to(torch.int32),
                 "weight_zero_point": pack_to_int32(zero, 4, packed_dim=0), "weight_shape": torch.tensor([n, k])}, deq)
    if method == "ct_w8a8":  # compressed-tensors' own rounding and dequantiser
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-4).to(torch.bfloat16)  # [N, 1]
        q = quantize(w, scale.float(), torch.zeros(n, 1, dtype=torch.int8), args, dtype=torch.int8)
        return {"weight": q, "weight_scale": scale}, dequantize(q, scale.float(), None, args)
    if method == "fp8_block":
        blocks = w.view(n // 32, 32, k // 32, 32)
        scale = (blocks.abs().amax((1, 3)) / 448).clamp_min(1e-6)  # [N/32, K/32]
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
        q = (w / full).to(FP8)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full
    if method == "modelopt_pb":  # 128 x 128 blocks, the last ones partial (the tiny models' widths are smaller)
        rows, cols = -(-n // 128), -(-k // 128)
        padded = torch.nn.functional.pad(w, (0, cols * 128 - k, 0, rows * 128 - n))
        scale = (padded.view(rows, 128, cols, 128).abs().amax((1, 3)) / 448).clamp_min(1e-6)  # [N/128, K/128]
        full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        q = (w / full).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * full
    per_tensor = method in ("ct_fp8", "modelopt")  # ModelOpt's scales are 0-d tensors
    scale = (w.abs().amax() / 448).reshape(1) if per_tensor else w.abs().amax(1, keepdim=True) / 448
    q = (w / scale.reshape(-1, 1)).to(FP8)
    extra = {"input_scale": torch.tensor([0.05])} if per_tensor else {}
    if method == "modelopt":
        scale, extra = scale.reshape(()), {"input_scale": torch.tensor(0.05)}
    return {"weight": q, "weight_scale": scale} | extra, q.float() * scale.reshape(-1, 1)


def _takes(method: str, shape: tuple[int, int]) -> bool:
    """Whether `method` quantises a weight of `shape` (the others stay float, as real checkpoints leave them)."""
    n, k = shape
    if method == "fp8_block":
        return n % 32 == 0 and k % 32 == 0
    if method in ("awq", "gptq", "gptq8", "ct_int4", "ct_int4_asym"):
        return k % GROUP == 0 and n % 8 == 0
    return True


def write_quantised(hf_model, directory: Path, method: str, seed: int = 0):
    """`hf_model` (a transformers model) saved in `directory` with its decoder layers' linears (as stored: one per
    MoE expert) quantised by `method` where their shapes allow; returns the oracle: transformers' model loaded from
    the same checkpoint with every quantised weight dequantised exactly (written beside it, `<name>-dequantised`)."""
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(directory)
    dequantised_dir = quantise_dir(directory, method, seed)
    return AutoModelForCausalLM.from_pretrained(str(dequantised_dir), dtype=torch.float32).eval()


def quantise_dir(directory: Path, method: str, seed: int = 0) -> Path:
    """The checkpoint in `directory` quantised in place by `method` (its `.layers.` linears, MTP layers included);
    returns the directory of its exact dequantisation (`<name>-dequantised`, a float checkpoint)."""
    from safetensors.torch import load_file, save_file

    dequantised_dir = directory.parent / f"{directory.name}-dequantised"
    shutil.copytree(directory, dequantised_dir, dirs_exist_ok=True)
    files = sorted(directory.glob("*.safetensors"))
    stored = {k: v for f in files for k, v in load_file(f).items()}
    state, floats = {}, {}
    for name, tensor in stored.items():
        linear = name.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", name)  # (Mixtral's)
        if ".layers." in name and linear and tensor.dim() == 2 and _takes(method, tensor.shape):
            same_input = re.sub(r"((q|k|v|gate|up)_proj|w1|w3)\.weight$", "in_proj", name)  # q / k / v, gate / up
            gen = torch.Generator().manual_seed(seed + zlib.crc32(same_input.encode()))
            parts, deq = quantise(tensor.float(), method, gen)
            prefix = name.removesuffix(".weight")
            state |= {f"{prefix}.{k}": v.contiguous() for k, v in parts.items()}
            floats[name] = deq.to(tensor.dtype)
        else:
            state[name] = floats[name] = tensor
    for d in (directory, dequantised_dir):
        for f in d.glob("*.safetensors"):
            f.unlink()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, dequantised_dir / "model.safetensors", metadata={"format": "pt"})
    if method.startswith("modelopt"):
        (directory / "hf_quant_config.json").write_text(json.dumps(CONFIGS[method]))
    else:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(config | {"quantization_config": CONFIGS[method]}))
    return dequantised_dir


KV_SCALE_NAMES = {  # how each tool names layer i's KV scales
    "compressed-tensors": ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"),
    "modelopt": ("model.layers.{}.self_attn.k_proj.k_scale", "model.layers.{}.self_attn.v_proj.v_scale"),
}


def add_kv_scales(directory: Path, scales: list[tuple[float, float]], style: str) -> None:
    """Layer i's (k_scale, v_scale) = scales[i] written into the checkpoint's model.safetensors as `style` names
    them (0-d float32 tensors, as both tools store them)."""
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    for i, pair in enumerate(scales):
        for name, value in zip(KV_SCALE_NAMES[style], pair):
            state[name.format(i)] = torch.tensor(float(value))
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
