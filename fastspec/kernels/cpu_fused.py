"""Fused CPU kernels for the work of a decoder layer between its GEMMs: residual add + RMSNorm (+ the cast its GEMM
wants), SiLU-and-multiply, rope + the KV write, and attention over a dense padded plan.

Why: on CPU a packed 4-bit layer's GEMMs are a third of a decode step; the rest was ~80 torch ops per layer, each a
few microseconds of dispatch. `cpu_fused.c` does that work in four calls. It is built on first use with the system
C compiler (`cc -O3 -march=native -ffast-math -fopenmp`, about a second; without OpenMP, single-threaded) into the
cache (`cache_root()/kernels`, keyed by the source, the flags and the CPU) and called through ctypes. Without a
compiler, or with FASTSPEC_FUSED_CPU=0, `available()` is False and every function runs its torch twin, which is also
what the tests compare the kernels against.
Knows nothing about models: tensors in, tensors out.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from fastspec.attention.torch_backend import TorchAttnBackend, TorchAttnPlan

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
THREADS = (("-fopenmp",), ("-fopenmp-simd",))  # OpenMP threads, else (a compiler without it) the calling thread
ACT = {torch.float32: 0, torch.bfloat16: 1}  # the C code's `act` codes
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "add_rms_norm": (_P, _P, ctypes.c_int, _P, _F, _I, _I, _P, _P, ctypes.c_int),
    "silu_mul": (_P, ctypes.c_int, _I, _I, _P, ctypes.c_int),
    "rope_write": (_P, ctypes.c_int, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P),
    "attend": (_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _F, _P, ctypes.c_int),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FASTSPEC_FUSED_CPU") == "0":
        return None
    from fastspec.models.embedded import cache_root

    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_fused-{key}.so"
    try:
        if not path.exists():
            _build(path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged library in the cache: built again
            _build(path)
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("fused CPU kernels unavailable (%s); running their torch twins", str(e).splitlines()[0])
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
    return lib


def _build(path: Path) -> None:
    """Compile into a temporary file beside `path`, then rename it in place (a reader never sees half a library)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".so")
    os.close(fd)
    try:
        cc = os.environ.get("CC", "cc")
        for threads in THREADS:
            # compiled and linked apart: -ffast-math at link time would add crtfastmath, whose constructor turns on
            # flush-to-zero for the whole process (every subnormal float in torch would become 0)
            try:
                subprocess.run([cc, *FLAGS, *threads, "-c", str(SOURCE), "-o", f"{tmp}.o"], check=True,
                               capture_output=True, timeout=120)
                subprocess.run([cc, "-shared", *threads, f"{tmp}.o", "-o", tmp, "-lm"], check=True,
                               capture_output=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if threads == THREADS[-1]:
                    raise
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        Path(f"{tmp}.o").unlink(missing_ok=True)


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n".join(dict.fromkeys(lines))


def _call(kernel, *args) -> None:
    """kernel(*args); under torch's profiler also an operator `cpu_fused::<name>`, so `fastspec bench --profile`
    sees the kernels (a ctypes call is otherwise host time to it)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"cpu_fused::{kernel.__name__}"):
            return kernel(*args)
    return kernel(*args)


def available() -> bool:
    return _library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor,         # float32 [T, H]  the residual stream
                 y: torch.Tensor | None,  # [T, H]  added to it first (a GEMM's output, float32 or bf16), or None
                 weight: torch.Tensor,    # float32 [H]
                 eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, RMSNorm(x + y) in out_dtype): the residual stream and what the next GEMM reads."""
    lib = _library()
    if lib is None:
        x = x if y is None else x + y
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x, (weight * normed).to(out_dtype)
    T, H = x.shape
    x_out, normed = (x if y is None else torch.empty_like(x)), x.new_empty(T, H, dtype=out_dtype)
    _call(lib.add_rms_norm, x.data_ptr(), _ptr(y), ACT[y.dtype] if y is not None else 0, weight.data_ptr(), eps, T,
          H, x_out.data_ptr(), normed.data_ptr(), ACT[out_dtype])
    return x_out, normed


def silu_mul(gate_up: torch.Tensor,  # [T, 2I]  [gate | up], float32 or bf16
             out_dtype: torch.dtype) -> torch.Tensor:  # [T, I]
    lib = _library()
    if lib is None:
        gate, up = gate_up.float().chunk(2, -1)
        return (F.silu(gate) * up).to(out_dtype)
    T, width = gate_up.shape
    out = gate_up.new_empty(T, width // 2, dtype=out_dtype)
    _call(lib.silu_mul, gate_up.data_ptr(), ACT[gate_up.dtype], T, width // 2, out.data_ptr(), ACT[out_dtype])
    return out


def rope_write(qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]  float32 or bf16
               cos: torch.Tensor, sin: torch.Tensor,  # float32 [T, 1, D]  (sin's first half negated)
               slots: torch.Tensor,  # int64 [T]  KV slots of the T tokens
               k_cache: torch.Tensor, v_cache: torch.Tensor,  # float32 [num_slots, Hkv, D]  one layer's
               num_heads: int) -> torch.Tensor:  # q float32 [T, Hq, D], rotated
    """Rope on q and k, then K and V written to the cache at `slots`; returns q."""
    T, (hkv, d) = qkv.shape[0], k_cache.shape[1:]
    lib = _library()
    if lib is None:
        q, k, v = qkv.float().view(T, -1, d).split([num_heads, hkv, hkv], 1)
        q, k = (z * cos + z.roll(d // 2, -1) * sin for z in (q, k))
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        return q
    q = qkv.new_empty(T, num_heads, d, dtype=torch.float32)
    _call(lib.rope_write, qkv.data_ptr(), ACT[qkv.dtype], T, num_heads, hkv, d, cos.data_ptr(), sin.data_ptr(),
          slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr())
    return q


def attend(plan: TorchAttnPlan, q: torch.Tensor,  # float32 [T, Hq, D]
           k_cache: torch.Tensor, v_cache: torch.Tensor,  # float32 [num_slots, Hkv, D]  one layer's
           scale: float, out_dtype: torch.dtype) -> torch.Tensor:  # [T, Hq * D]
    """The torch backend's attention (TorchAttnBackend.run) over its dense plan, output in out_dtype."""
    T, hq, d = q.shape
    lib = _library()
    if lib is None:
        return TorchAttnBackend().run(plan, q, k_cache, v_cache, scale).reshape(T, hq * d).to(out_dtype)
    max_qo = plan.q_index.shape[1]
    mask = None if plan.mask is None else plan.mask.contiguous()
    out = q.new_empty(T, hq * d, dtype=out_dtype)
    _call(lib.attend, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), T, hq, k_cache.shape[1], d,
          plan.out_index.data_ptr(), plan.kv_slots.data_ptr(), _ptr(mask), max_qo, plan.kv_slots.shape[1], scale,
          out.data_ptr(), ACT[out_dtype])
    return out
