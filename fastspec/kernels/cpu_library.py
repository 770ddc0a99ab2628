"""fastspec's CPU kernels in C (cpu_fused.c: a decoder layer's work between its GEMMs, and a whole layer stack;
cpu_attention.c: attention over a dense plan; cpu_q4.c and cpu_q8.c: the 4- to 8-bit GEMMs on int16 activations;
cpu_amx.c: the 4-bit one on AMX tiles; cpu_row_gemm.c: a row-invariant float GEMM; cpu_tree.c: a speculative
round's tree building and greedy walk) as one library: built on first use with the system C compiler (`cc -O3
-march=native -ffast-math -fopenmp`, seconds to tens of seconds; without OpenMP, single-threaded) into the cache
(`cache_root()/kernels`, keyed by the sources, the flags and the CPU) and loaded through ctypes. Without a compiler,
or with FASTSPEC_FUSED_CPU=0, `library()` is None and the callers run their torch twins. Knows nothing about what
the kernels compute.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fastspec.utils.shared_dirs import staging
from fastspec.utils.cache import cache_root

log = logging.getLogger(__name__)
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_fused.c", "cpu_attention.c", "cpu_q4.c", "cpu_q8.c", "cpu_amx.c", "cpu_row_gemm.c",
                             "cpu_tree.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_q4.h", "cpu_rows.h", "cpu_vec.h"))
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC")
THREADS = (("-fopenmp",), ("-fopenmp-simd",))  # OpenMP threads, else (a compiler without it) the calling thread
COMPILE_SECONDS = 900  # a command's limit, for a hung compiler: a busy machine takes minutes over one file
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # name -> (argument types, result type)
    "add_rms_norm": ((_P, _P, _C, _P, _F, _I, _I, _P, _P, _C), None),
    "silu_mul": ((_P, _C, _I, _I, _P, _C), None),
    "rope_write": ((_P, _C, _I, _I, _I, _I, _P, _P, _P, _P, _P, _C, _P, _P), None),
    "head_norms": ((_P, _C, _I, _I, _I, _I, _P, _P, _F), None),
    "attend": ((_P, _P, _P, _C, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _F, _F, _P, _C), None),
    "paged_dense_plan": ((_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _C, _P, _P), None),
    "top_k": ((_P, _I, _I, _I, _I, _P), None),
    "argmax_rows": ((_P, _I, _I, _I, _P), None),
    "rescore": ((_P, _P, _P, _I, _I, _P, _I, _I, _P, _P), None),
    "block_gemm": ((_P, _I, _I, _P, _P, _I, _P, _I, _I, _P), _C),
    "amx_q4_enable": ((_C,), _C),
    "row_gemm": ((_P, _I, _I, _P, _I, _C, _P), None),
    "row_dots": ((_P, _I, _I, _P, _P, _I, _C, _P), None),
    "eagle_tree": ((_P, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P), None),
    "greedy_walk": ((_P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P), None),
    "decoder_stack": ((_I, _P, _P, _P, _C, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _P, _P, _I, _I, _F,
                       _P, _P, _P), _C),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("FASTSPEC_FUSED_CPU") == "0":
        return None
    key = hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"cpu_fused-{key}.so"
    try:
        if not path.exists():
            log.info("building fastspec's CPU kernels into %s (once)", path.parent)
            _build(path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged library in the cache: built again
            _build(path)
            lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("fused CPU kernels unavailable (%s); running their torch twins", _why(e))
        return None
    return _typed(lib)


def build_for(march: str, path: Path) -> ctypes.CDLL:
    """The library built for another instruction-set level (`-march=march`, e.g. x86-64-v3: AVX2) at `path`: how the
    tests reach the paths this CPU's own build does not take."""
    _build(path, tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS))
    return _typed(ctypes.CDLL(str(path)))


def _why(e: OSError | subprocess.SubprocessError) -> str:
    """A failed build in one line: the file and the compiler's first error, not its whole command line."""
    if not isinstance(e, subprocess.CalledProcessError | subprocess.TimeoutExpired):
        return str(e).splitlines()[0]
    step = next((Path(arg).name for arg in e.cmd if arg.endswith(".c")), "linking")
    if isinstance(e, subprocess.TimeoutExpired):
        return f"{e.cmd[0]} took over {e.timeout:g} s on {step}"
    said = (e.stderr or b"").decode(errors="replace").splitlines()
    return f"{e.cmd[0]} failed on {step}: " + next((line for line in said if "error" in line), said[0] if said else
                                                   f"exit status {e.returncode}")


def _compile_all(commands: list[list[str]]) -> None:
    """Run the compiler commands side by side, one per core (cpu_attention.c's 20 specialisations take most of the
    time: the library is ready about when it is). Raises the first failure (CalledProcessError, or
    TimeoutExpired past COMPILE_SECONDS) once every command has ended."""
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        runs = [pool.submit(subprocess.run, command, check=True, capture_output=True, timeout=COMPILE_SECONDS)
                for command in commands]
    for run in runs:
        run.result()


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (argtypes, restype) in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    return lib


def _build(path: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile and link in a private directory beside `path` (shared_dirs.staging: held while this process builds, so
    what a build killed midway left is removed by the next), then rename the library in place (a reader never sees
    half a library)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with staging(path) as work:
        objects = [str(work / f"{source.stem}.o") for source in SOURCES]
        library = work / path.name
        cc = os.environ.get("CC", "cc")
        for threads in THREADS:
            # compiled and linked apart: -ffast-math at link time would add crtfastmath, whose constructor turns on
            # flush-to-zero for the whole process (every subnormal float in torch would become 0)
            try:
                _compile_all([[cc, *flags, *threads, "-c", str(s), "-o", o] for s, o in zip(SOURCES, objects)])
                subprocess.run([cc, "-shared", *threads, *objects, "-o", str(library), "-lm"], check=True,
                               capture_output=True, timeout=COMPILE_SECONDS)
                break
            except subprocess.CalledProcessError:
                if threads == THREADS[-1]:
                    raise
        library.chmod(0o755)
        os.replace(library, path)


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "\n".join(dict.fromkeys(lines))


def has_bf16_dot() -> bool:
    """Whether the library multiplies bfloat16 weights with the CPU's bfloat16 dot products (AVX512-BF16's
    VDPBF16PS; AMX CPUs have it too): there a bfloat16 decode step reads half float32's bytes at no widening cost."""
    return available() and any(line.startswith("flags") and " avx512_bf16" in line
                               for line in _cpu_signature().splitlines())


def call(kernel, *args):
    """kernel(*args); under torch's profiler also an operator `cpu_fused::<name>`, so `fastspec bench --profile`
    sees the kernels (a ctypes call is otherwise host time to it)."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"cpu_fused::{kernel.__name__}"):
            return kernel(*args)
    return kernel(*args)


def available() -> bool:
    return library() is not None
