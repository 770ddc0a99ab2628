"""What a quantised Hugging Face checkpoint says about its weights: `quantization_config` in config.json (or a GPTQ
repo's `quantize_config.json`) read into a frozen QuantScheme, every method or setting fastspec cannot run refused
in one line. Torch-free; does not read tensors (quant_decode) nor build modules (quant_layers).

Methods read:
  fp8                 Hugging Face's fine-grained fp8 (Qwen3-FP8, DeepSeek-V3): e4m3 weights, `weight_scale_inv`
                      per 128 x 128 block; without `weight_block_size`, vLLM's serialised fp8 (`weight_scale` per
                      tensor)
  fbgemm_fp8          e4m3 weights with a `weight_scale` per output channel
  compressed-tensors  `float-quantized` fp8 (per tensor, channel or block), `pack-quantized` int4 / int8
                      (llm-compressor's W4A16 / W8A16: `weight_packed`) and `int-quantized` int8 (W8A8: an int8
                      `weight`; run weight-only, its activations not rounded), a scale (and where asymmetric a
                      `weight_zero_point`) per group, channel or (int8) tensor
  awq                 AutoAWQ's GEMM layout, 4 bits, zero points; declared in config.json or in AutoAWQ's own
                      quant_config.json
  gptq                AutoGPTQ / GPTQModel, 4 or 8 bits, v1 (zeros stored minus one) or v2, desc_act (`g_idx`)
  modelopt            NVIDIA ModelOpt's FP8 (`weight_scale` per tensor, static `input_scale`),
                      FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO (a scale per 128 x 128 block, weight-only); declared in
                      config.json or in its own hf_quant_config.json
A checkpoint's fp8 KV cache scales (`kv_cache_scheme`, ModelOpt's `kv_cache_quant_algo`) are tensors read by
fastspec.models.kv_scales where the KV cache is fp8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fastspec.errors import FastspecError

CHECKPOINT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors", "awq", "gptq", "modelopt")
REFUSED = {  # methods seen in the wild fastspec has no kernels for, with what to use instead
    "bitsandbytes": "bitsandbytes' NF4 / int8 layouts",
    "hqq": "HQQ's layout", "eetq": "EETQ's layout", "exl2": "ExLlamaV2's layout", "aqlm": "AQLM codebooks",
    "quanto": "optimum-quanto's layout", "torchao": "torchao's tensor subclasses", "marlin": "the Marlin layout",
    "gptq_marlin": "the Marlin layout", "awq_marlin": "the Marlin layout", "bitnet": "BitNet's ternary weights",
    "higgs": "HIGGS codebooks", "vptq": "VPTQ codebooks", "spqr": "SpQR", "fp_quant": "FP-Quant's layout",
    "mxfp4": "MXFP4 blocks",
}
SUPPORTED = ("fp8 (per tensor, channel or 128 x 128 block), compressed-tensors fp8 / int4 / int8 (W8A16, W8A8), "
             "AWQ int4, GPTQ int4 / int8, ModelOpt FP8 (per tensor, channel or 128 x 128 block)")
MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")  # ModelOpt's quant_algo values read
SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"), ("hf_quant_config.json", "modelopt"))
MODELOPT_BLOCK = (128, 128)  # FP8_PB_WO's block (rows x input columns); its scale tensors' shapes are checked


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantised linears, as its config declares them (the tensors say which linears are)."""

    method: str  # one of CHECKPOINT_METHODS
    kind: str  # "fp8" (e4m3 values times float scales) | "int" (integers times a scale, minus a zero point)
    bits: int  # 8 for fp8; 4 or 8 for int
    group: int | None = None  # int: input values per scale (None: one per output channel)
    block: tuple[int, int] | None = None  # fp8: output rows x input columns per scale
    fp8_activations: bool = False  # the checkpoint was calibrated for fp8 activations (may run W8A8)
    desc_act: bool = False  # input channels reordered by `g_idx` (GPTQ) or `weight_g_idx` (actorder group)
    gptq_v1: bool = True  # gptq: zero points stored minus one (AutoGPTQ's format)
    zero_points: bool = False  # compressed-tensors int: asymmetric, a `weight_zero_point` beside each scale

    @property
    def label(self) -> str:
        """What banners and `--quantization` errors call it, e.g. "awq int4 g128", "fp8 block 128x128"."""
        if self.kind == "fp8":  # "fp8 block 32x32", not "fp8 fp8 ..."
            name = "fp8" if self.method == "fp8" else f"{self.method} fp8"
            return name + (f" block {self.block[0]}x{self.block[1]}" if self.block else "")
        return f"{self.method} int{self.bits}" + (f" g{self.group}" if self.group else " per channel")


def read_scheme(hf: dict, model_dir: Path | None = None, source: str = "config.json") -> QuantScheme | None:
    """The checkpoint's QuantScheme, or None for a float one. GPTQ repos that keep their settings in
    quantize_config.json beside config.json, AutoAWQ exports in quant_config.json and ModelOpt exports in
    hf_quant_config.json are read too."""
    quant = hf.get("quantization_config")
    for name, method in SIDE_FILES:
        if quant is None and model_dir is not None and (model_dir / name).is_file():
            quant, source = _side_file(model_dir / name, method)
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise FastspecError(f"{source}: quantization_config is not a JSON object")
    method = str(quant.get("quant_method", "")).lower().replace("_", "-") if "quant_method" in quant else ""
    method = {"fbgemm-fp8": "fbgemm_fp8"}.get(method, method)
    try:
        if method == "fp8" or method == "fbgemm_fp8":
            return _fp8(quant, method, source)
        if method == "compressed-tensors":
            return _compressed_tensors(quant, source)
        if method == "awq":
            return _awq(quant, source)
        if method == "gptq":
            return _gptq(quant, source)
        if method == "modelopt":
            return _modelopt(quant, source)
    except (KeyError, TypeError, ValueError) as e:
        raise FastspecError(f"{source}: malformed quantization_config ({type(e).__name__}: {e})") from None
    what = REFUSED.get(method.replace("-", "_"), None)
    raise FastspecError(f"{source}: quantisation method {method or '(none)'!r}"
                        + (f" ({what})" if what else "") + f" is not supported; supported: {SUPPORTED}")


def _side_file(path: Path, method: str) -> tuple[dict | None, str]:
    """A quantisation config kept beside config.json: (its settings with `quant_method` set, the path); None for a
    quant_config.json that is not AutoAWQ's ({"w_bit": 4, "q_group_size": 128, "zero_point": true, "version": ...})."""
    try:
        quant = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FastspecError(f"{path}: cannot read ({e})") from None
    if isinstance(quant, dict) and method == "modelopt":  # {"producer": {...}, "quantization": {"quant_algo": ...}}
        quant = quant.get("quantization", quant)
    if method == "awq" and not (isinstance(quant, dict) and ("w_bit" in quant or quant.get("quant_method") == "awq")):
        return None, str(path)
    if isinstance(quant, dict):
        quant = {"quant_method": method, **quant}
    return quant, str(path)


def _modelopt(quant: dict, source: str) -> QuantScheme | None:
    algo = str(quant.get("quant_algo") or "").upper()
    if not algo:
        return None  # only the KV cache calibrated (kv_cache_quant_algo): float weights
    if algo not in MODELOPT_FP8:
        raise FastspecError(f"{source}: ModelOpt quant_algo {algo!r} is not supported; supported: {SUPPORTED}")
    if algo == "FP8_PB_WO":  # weight-only: calibrated without fp8 activations
        return QuantScheme("modelopt", "fp8", 8, block=MODELOPT_BLOCK)
    return QuantScheme("modelopt", "fp8", 8, fp8_activations=True)


def _fp8(quant: dict, method: str, source: str) -> QuantScheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FastspecError(f"{source}: fp8 format {fmt!r} is not supported (e4m3 only)")
    block = quant.get("weight_block_size")
    if block is not None:
        block = _block(block, source)
    static = quant.get("activation_scheme", "dynamic")
    if static not in ("dynamic", "static"):
        raise FastspecError(f"{source}: fp8 activation_scheme {static!r} is not dynamic or static")
    return QuantScheme(method, "fp8", 8, block=block, fp8_activations=method == "fp8")


def _block(block, source: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise FastspecError(f"{source}: weight block size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def _awq(quant: dict, source: str) -> QuantScheme:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise FastspecError(f"{source}: AWQ version {version!r} is not supported (the GEMM layout only: "
                            "re-export with version gemm)")
    bits = int(quant.get("bits", quant.get("w_bit", 4)))  # (AutoAWQ's own quant_config.json: w_bit, q_group_size)
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits != 4:
        raise FastspecError(f"{source}: AWQ with {bits} bits is not supported (4 bits)")
    if not quant.get("zero_point", True):
        raise FastspecError(f"{source}: AWQ without zero points is not supported")
    return QuantScheme("awq", "int", 4, group=_group(group, source))


def _gptq(quant: dict, source: str) -> QuantScheme:
    fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
    if quant.get("is_marlin_format") or fmt == "marlin":
        raise FastspecError(f"{source}: GPTQ in the Marlin layout is not supported (use the plain gptq format)")
    if fmt not in ("gptq", "gptq_v2"):
        raise FastspecError(f"{source}: GPTQ checkpoint format {fmt!r} is not supported (gptq or gptq_v2)")
    if quant.get("dynamic"):
        raise FastspecError(f"{source}: GPTQ with per-module settings (`dynamic`) is not supported (one bit width "
                            "and group size for every linear)")
    pack = str(quant.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack != "int32":  # GPTQModel can pack into int8 / int16 / int64 words; the readers take int32 ones
        raise FastspecError(f"{source}: GPTQ packed into {pack} words (pack_dtype) is not supported (int32)")
    bits = int(quant.get("bits", 4))
    if bits not in (4, 8):
        raise FastspecError(f"{source}: GPTQ with {bits} bits is not supported (4 or 8 bits)")
    return QuantScheme("gptq", "int", bits, group=_group(int(quant.get("group_size", 128)), source),
                       desc_act=bool(quant.get("desc_act", False)), gptq_v1=fmt == "gptq")


def _group(group: int, source: str) -> int | None:
    if group == -1:
        return None  # one scale per output channel
    if group <= 0 or group % 8:
        raise FastspecError(f"{source}: group size {group} is not supported (-1 or a positive multiple of 8)")
    return group


def _compressed_tensors(quant: dict, source: str) -> QuantScheme:
    fmt = quant.get("format", "")
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise FastspecError(f"{source}: compressed-tensors with {len(groups)} config groups is not supported "
                            "(one scheme for every linear)")
    scheme = next(iter(groups.values()))
    weights, inputs = scheme.get("weights") or {}, scheme.get("input_activations")
    kind, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 8)), weights.get("strategy")
    if kind == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if strategy not in ("tensor", "channel", "block"):
            raise FastspecError(f"{source}: compressed-tensors fp8 strategy {strategy!r} is not supported "
                                "(tensor, channel or block)")
        block = _block(weights.get("block_structure"), source) if strategy == "block" else None
        fp8_in = bool(inputs) and inputs.get("type") == "float" and int(inputs.get("num_bits", 0)) == 8
        return QuantScheme("compressed-tensors", "fp8", 8, block=block, fp8_activations=fp8_in)
    if kind == "int" and bits in (4, 8) and fmt == "pack-quantized":
        if inputs:
            raise FastspecError(f"{source}: compressed-tensors int{bits} with quantised activations is not "
                                "supported (weight-only W4A16 / W8A16)")
        return _ct_int(weights, bits, ("group", "channel"), source)
    if kind == "int" and bits == 8 and fmt in ("int-quantized", "naive-quantized"):
        if inputs and (inputs.get("type") != "int" or int(inputs.get("num_bits", 8)) != 8):
            raise FastspecError(f"{source}: compressed-tensors int8 weights with {inputs.get('type')} "
                                f"{inputs.get('num_bits')}-bit activations are not supported (W8A8 int8 or W8A16)")
        return _ct_int(weights, 8, ("tensor", "channel", "group"), source)
    raise FastspecError(f"{source}: compressed-tensors format {fmt!r} with {kind} {bits}-bit weights is not "
                        f"supported; supported: {SUPPORTED}")


def _ct_int(weights: dict, bits: int, strategies: tuple[str, ...], source: str) -> QuantScheme:
    """compressed-tensors int weights: a scale (and where asymmetric a zero point) per group, channel or tensor;
    actorder `group` (alias `dynamic`) stores each input's group (`weight_g_idx`, as GPTQ's desc_act). W8A8 int8
    (int-quantized) runs weight-only: its activations stay in float (exactly the dequantised model)."""
    strategy, actorder = weights.get("strategy"), weights.get("actorder")
    if strategy not in strategies or actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise FastspecError(f"{source}: compressed-tensors int{bits} strategy {strategy!r} (actorder {actorder!r}) "
                            f"is not supported ({', '.join(strategies)})")
    group = _group(int(weights.get("group_size") or -1), source) if strategy == "group" else None
    return QuantScheme("compressed-tensors", "int", bits, group=group, desc_act=actorder in ("group", "dynamic"),
                       zero_points=not weights.get("symmetric", True))
