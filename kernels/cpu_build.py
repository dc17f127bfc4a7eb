"""Build and load the C++ CPU kernels once per process, cached on disk across processes and runs.

The build directory is keyed by a hash of the source, the compiler flags, the torch version, the
Python ABI and the CPU's instruction-set flags (the code is compiled with ``-march=native``, or the
target ``$KVPILOT_CPU_MARCH`` names, so a cache shared between different machines never hands one a
binary it cannot run). A directory whose build finished holds a ``complete`` marker; loading from it
needs neither a compiler nor ninja.

Where: ``$KVPILOT_KERNEL_CACHE`` or ``~/.cache/kvpilot/kernels``. If the compiler or ninja is
missing or the build fails, ``load_extension()`` logs one line and returns None; it never raises.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("kvpilot.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "paged_attention_cpu.cpp"
SOURCES = (SOURCE, CSRC / "fused_cpu.cpp", CSRC / "linear_cpu.cpp")
# -fopenmp-simd: the `omp simd` loops may reassociate their reductions; nothing else is relaxed
# (no -ffast-math: results must stay within the reference's tolerance).
CFLAGS = ("-O3", "-mprefer-vector-width=512", "-fopenmp-simd", "-fno-math-errno")
# The instruction set the kernels are built for: this CPU's, unless ``$KVPILOT_CPU_MARCH`` names a
# target (``x86-64-v3``: AVX2 and FMA without AVX-512), so that one machine can build and test the
# code paths another CPU would take (``make test-isa``).
MARCH_ENV = "KVPILOT_CPU_MARCH"
# ATen's parallel_for is a header template: without -fopenmp it runs its range on the calling thread.
# The extension then links the libgomp that torch has already loaded (one OpenMP runtime, one pool).
OPENMP_FLAGS = ("-fopenmp",)


def _cflags(openmp: bool, target: tuple[str, ...] | None = None) -> list[str]:
    # A fresh list each time: torch's cpp_extension appends to the lists it is handed.
    target = target or (f"-march={os.environ.get(MARCH_ENV) or 'native'}",)
    return [*target, *CFLAGS, *(OPENMP_FLAGS if openmp else ())]


@dataclass(frozen=True)
class IsaLevel:
    """One x86 instruction-set level the kernels have code paths for (``make test`` builds and tests
    each level this CPU can run; see ``isa_levels``)."""

    name: str
    target: tuple[str, ...]  # compiler flags that select it
    needs: frozenset[str]  # /proc/cpuinfo flags a CPU must have to run the build
    paths: str  # the code paths the level enables, for the report of what ran and what did not


_V3 = frozenset({"sse4_2", "avx2", "fma", "f16c"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ISA_LEVELS = (
    IsaLevel("portable", ("-march=x86-64-v2",), frozenset({"sse4_2"}), "the portable omp-simd loops"),
    IsaLevel(
        "avx2",
        ("-march=x86-64-v3",),
        _V3,
        "AVX2+FMA attention (8-key scores, exp, PV rows) and fused ops",
    ),
    IsaLevel(
        "avx512",
        ("-march=x86-64-v4",),
        _V4,
        "AVX-512 fp32 attention (scores_16, softmax_step_16, pv_rows)",
    ),
    IsaLevel(
        "avx512_bf16",
        ("-march=x86-64-v4", "-mavx512bf16"),
        _V4 | {"avx512_bf16"},
        "AVX512-BF16 decode attention (attend_bf16_rows) and the bfloat16 fused ops",
    ),
    IsaLevel(
        "amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
        "AMX bfloat16 prefill tiles (attend_amx)",
    ),
)


def isa_levels(flags: frozenset[str] | None = None) -> tuple[list[IsaLevel], list[IsaLevel]]:
    """The levels this CPU can run and those it cannot (empty lists off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [], []
    from kvpilot.kernels import isa

    flags = isa.cpu_flags() if flags is None else flags
    runnable = [level for level in ISA_LEVELS if level.needs <= flags]
    return runnable, [level for level in ISA_LEVELS if not level.needs <= flags]


_MARKER = "complete"
_FAILED = "failed"
_BUILD_LOCK = ".build.flock"
_TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


def cache_root() -> Path:
    """Where built kernels are kept."""
    env = os.environ.get("KVPILOT_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvpilot" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(openmp: bool = True, target: tuple[str, ...] | None = None) -> str:
    """The hash that names the build directory (sources and headers, flags, torch, Python, CPU)."""
    import torch

    h = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in sorted(CSRC.glob("*.[ch]*"))),
        " ".join(_cflags(openmp, target)).encode(),
        torch.__version__.encode(),
        sysconfig.get_config_var("SOABI").encode() if sysconfig.get_config_var("SOABI") else b"",
        _cpu_flags().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _import_built(name: str, directory: Path) -> ModuleType | None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for path in (directory / f"{name}.so", directory / f"{name}{suffix}"):
        if path.exists():
            import torch  # noqa: F401  (the extension links against libtorch, loaded by this import)

            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            return module
    return None


def _ninja_path() -> str:
    """PATH with the ninja of the ``ninja`` package and this interpreter's scripts folder added: a
    venv's executables are not on PATH unless it is activated."""
    extra = [os.path.dirname(sys.executable)]
    try:
        import ninja

        extra.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return os.pathsep.join([*extra, os.environ.get("PATH", "")])


def _build(name: str, directory: Path, openmp: bool, target: tuple[str, ...] | None = None) -> ModuleType:
    """Build (or, if another process built it meanwhile, import) the extension in ``directory``.

    Builds of one directory are serialised by an ``flock`` of our own, which the OS releases when
    its holder dies. torch's own build lock is a plain file that a killed build (a pod OOM-killed or
    a server stopped mid-build) leaves behind, after which every later start would wait on it
    forever; holding the ``flock``, any such file is stale and is removed first."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / _BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / _MARKER).exists():
            module = _import_built(name, directory)
            if module is not None:
                return module
        (directory / _TORCH_LOCK).unlink(missing_ok=True)
        return _run_build(name, directory, openmp, target)


def _run_build(name: str, directory: Path, openmp: bool, target: tuple[str, ...] | None) -> ModuleType:
    from torch.utils import cpp_extension

    old_path = os.environ.get("PATH")
    os.environ["PATH"] = _ninja_path()
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=_cflags(openmp, target),
            extra_ldflags=list(OPENMP_FLAGS) if openmp else [],
            build_directory=str(directory),
            verbose=False,
        )
    finally:
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path
    (directory / _MARKER).write_text("ok\n")
    return module


def _load(openmp: bool, level: IsaLevel | None = None) -> ModuleType:
    """The build for these flags (``level`` None: this CPU's own), from the cache or built now."""
    target = level.target if level is not None else None
    name = f"kvpilot_cpu_attention_{build_key(openmp, target)}"
    directory = cache_root() / name
    if (directory / _MARKER).exists():
        module = _import_built(name, directory)
        if module is not None:
            return module
    if (directory / _FAILED).exists():
        raise RuntimeError(f"an earlier build failed (remove {directory} to retry)")
    what = "the CPU kernels" + (f" for ISA level {level.name}" if level is not None else "")
    logger.info("building %s once (cached in %s)", what, directory)
    try:
        return _build(name, directory, openmp, target)
    except Exception:
        # Remembered for the default OpenMP build only, which has a fallback: a start then goes
        # straight to it. The last resort is tried again on every start (a compiler may have been
        # installed), and so is a level's build, which a test asks for.
        if openmp and level is None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / _FAILED).write_text("the build with these flags failed\n")
        raise


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


@functools.cache
def load_extension() -> ModuleType | None:
    """The compiled kernel module, built on first use; None (after one log line) if it cannot be.

    Built with OpenMP (the kernels' ``at::parallel_for`` then runs on ATen's threads); where that
    build fails (a compiler without libgomp) it is built once more without, and runs on one thread.
    """
    try:
        return _load(openmp=True)
    except Exception as exc:  # any failure means "try without OpenMP", then "use the torch path"
        first = _reason(exc)
    try:
        module = _load(openmp=False)
        logger.warning("CPU kernels built without OpenMP (%s); they run on one thread", first)
        return module
    except Exception as exc:
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", _reason(exc))
        return None


@functools.cache
def load_level(level: IsaLevel) -> ModuleType:
    """The kernels built for ``level`` (OpenMP on, cached like the default build), to test that
    level's code paths in this process; raises when the build fails. The CPU must be able to run it
    (``isa_levels``)."""
    return _load(True, level)


def compile_level(level: IsaLevel) -> None:
    """Compile every source for ``level`` without loading the result (a CPU that cannot run a level
    still checks that its code builds); remembered in the cache once it has succeeded. Raises
    ``subprocess.CalledProcessError`` with the compiler's output when it fails."""
    from torch.utils import cpp_extension

    marker = cache_root() / f"compiled-{level.name}-{build_key(True, level.target)}"
    if marker.exists():
        return
    compiler = os.environ.get("CXX") or "c++"
    flags = [
        *_cflags(True, level.target),
        "-std=c++17",
        "-fPIC",
        "-DTORCH_EXTENSION_NAME=kvpilot_compile_check",
        f"-I{sysconfig.get_paths()['include']}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
    ]
    for source in SOURCES:
        subprocess.run(
            [compiler, *flags, "-c", str(source), "-o", os.devnull],
            check=True,
            capture_output=True,
            text=True,
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("ok\n")
