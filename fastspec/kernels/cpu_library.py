"""fastspec's CPU kernels in C (cpu_fused.c: a decoder layer's work between its GEMMs, and a whole layer stack;
cpu_attention.c: attention over a dense plan; cpu_q4.c and cpu_q8.c: the 4- to 8-bit GEMMs on int16 activations;
cpu_amx.c: the 4-bit one on AMX tiles; cpu_row_gemm.c: a row-invariant float GEMM; cpu_tree.c: a speculative
round's tree building and greedy walk) as one library: built by `make setup` (`python -m
fastspec.kernels.cpu_library`), else on first use, with the system C compiler (`cc -O3 -march=native -ffast-math
-fopenmp`, seconds to minutes; without OpenMP, single-threaded) into the cache (`cache_root()/kernels`, keyed by the
sources, the flags and the CPU) and loaded through ctypes. Without a compiler, or with FASTSPEC_FUSED_CPU=0,
`library()` is None and the callers run their torch twins. Knows nothing about what the kernels compute.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import signal
import subprocess
import tempfile
import time
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
    try:
        return _typed(_built(library_path()))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("fused CPU kernels unavailable (%s); running their torch twins", _why(e))
        return None


def library_path() -> Path:
    key = hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"cpu_fused-{key}.so"


def _built(path: Path) -> ctypes.CDLL:
    """The library at `path` loaded, built first where it is missing or damaged."""
    if not path.exists():
        log.info("building fastspec's CPU kernels into %s (once)", path.parent)
        _build(path)
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged library in the cache: built again
        _build(path)
        return ctypes.CDLL(str(path))


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
    TimeoutExpired past COMPILE_SECONDS) once every command has ended. Interrupted (KeyboardInterrupt, or any
    exception here), it kills the commands still running and what they started before it returns; a process killed
    outright (SIGKILL) leaves them to finish on their own."""
    pending, running, ended = list(commands), [], []
    try:
        while pending or running:
            while pending and len(running) < max(1, os.cpu_count() or 1):
                running.append(_Command(pending.pop(0)))
            time.sleep(0.02)
            ended += [c for c in running if not c.running()]
            running = [c for c in running if c not in ended]
    finally:
        for command in running:
            command.kill()
        for command in ended + running:
            command.stderr.close()
    failures = [c.error for c in sorted(ended, key=lambda c: commands.index(c.argv)) if c.error is not None]
    if failures:
        raise failures[0]


class _Command:
    """One command running in a session of its own (its process group: killing it kills what it started, cc1 and
    as), past COMPILE_SECONDS killed; its stderr in a file (a pipe nobody reads while it runs could fill and stall
    it). `error`: None, or once it has ended badly, the CalledProcessError / TimeoutExpired subprocess.run raises."""

    def __init__(self, argv: list[str]):
        self.argv, self.error = argv, None
        self.deadline = time.monotonic() + COMPILE_SECONDS
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.stderr, start_new_session=True)

    def running(self) -> bool:
        if self.process.poll() is None:
            if time.monotonic() < self.deadline:
                return True
            self.kill()
            self.error = subprocess.TimeoutExpired(self.argv, COMPILE_SECONDS)
        elif self.process.returncode:
            self.stderr.seek(0)
            self.error = subprocess.CalledProcessError(self.process.returncode, self.argv, stderr=self.stderr.read())
        return False

    def kill(self) -> None:
        with contextlib.suppress(OSError):  # (its group gone already)
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


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
        cc = _compiler()
        for threads in THREADS:
            # compiled and linked apart: -ffast-math at link time would add crtfastmath, whose constructor turns on
            # flush-to-zero for the whole process (every subnormal float in torch would become 0)
            try:
                _compile_all([[*cc, *flags, *threads, "-c", str(s), "-o", o] for s, o in zip(SOURCES, objects)])
                _compile_all([[*cc, "-shared", *threads, *objects, "-o", str(library), "-lm"]])
                break
            except subprocess.CalledProcessError:
                if threads == THREADS[-1]:
                    raise
        library.chmod(0o755)
        os.replace(library, path)


def _compiler() -> list[str]:
    """$CC as make and setuptools read it, a command and its arguments ("ccache gcc", "gcc -pthread"); cc when unset
    or blank. Unbalanced quotes: the value as one name (which then fails to run, in one line)."""
    value = os.environ.get("CC", "").strip() or "cc"
    try:
        return shlex.split(value)
    except ValueError:
        return [value]


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


def main() -> None:
    """`python -m fastspec.kernels.cpu_library` (make setup): build the library now, not in the middle of a first
    command's load; one line either way, and exit status 0 where it cannot be built (the torch twins run)."""
    if os.environ.get("FASTSPEC_FUSED_CPU") == "0":
        print("fastspec's CPU kernels: off (FASTSPEC_FUSED_CPU=0); the torch twins run")
        return
    path = library_path()
    try:
        _typed(_built(path))
    except (OSError, subprocess.SubprocessError) as e:
        print(f"fastspec's CPU kernels: not built ({_why(e)}); the torch twins run")
        return
    print(f"fastspec's CPU kernels: {path}")


if __name__ == "__main__":
    main()
