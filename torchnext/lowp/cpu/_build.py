"""Build and load the C++ CPU kernels: compiler lookup, the cache key, a parallel compile, one lock per build.

Decision (docs/lowp_mm.md, "The compiled CPU kernels"): the sources in ``csrc/`` are compiled on first use with the
system C++ compiler straight into a shared library that registers ``torch.ops.torchnext_cpu`` (``TORCH_LIBRARY``)
and is loaded with ``torch.ops.load_library``. No ninja, no pybind11, no Python headers: torch's own headers and
libraries only (``torch.utils.cpp_extension.include_paths()`` / ``library_paths()``), so a machine with a compiler
is enough. Threads come from ``at::parallel_for`` (torch's intra-op pool, ``torch.set_num_threads`` applies).

Cache: ``<TORCHNEXT_KERNEL_CACHE>/torchnext_cpu-<key>/torchnext_cpu.so`` where ``key`` hashes the sources, the
flags, torch's version, the compiler's ``--version`` and, because the code is compiled for this CPU
(``-march=native`` on x86-64), the CPU's model and flags. A second process (or a second test) loads the cached
library in milliseconds; concurrent first builds serialize on a file lock and the library appears atomically
(``os.replace``). The lock, the compiler runs (one translation unit per core at most), the start/end lines on stderr
and the pruning of builds unused for ``TORCHNEXT_KERNEL_CACHE_KEEP_DAYS`` are :mod:`torchnext._build`'s; each wait
and each compiler run is bounded by ``TORCHNEXT_BUILD_TIMEOUT`` (a hung compiler means the pure-torch paths, with a
warning, never a blocked rank).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchnext import _build as common

__all__ = ["BuildResult", "build", "compiler_command", "cpu_signature", "sources"]

LIBRARY_NAME = "torchnext_cpu"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("register.cpp", "gemv.cpp", "quantize.cpp")

_BASE_FLAGS = [
    "-O3",
    "-std=c++20",
    "-fPIC",
    "-fvisibility=hidden",
    "-ffp-contract=off",  # the quantizer's bit-exactness needs every multiply and add rounded as written
    "-fno-math-errno",
    "-DNDEBUG",
    "-w",
]


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    """Where the library is and how it got there."""

    library: Path
    compiler: str
    """The compiler's first ``--version`` line."""
    built: bool
    """True if this call compiled it, False if it came from the cache."""
    seconds: float
    """Compile + link time of this call (0 for a cache hit)."""


def sources() -> list[Path]:
    """Every file the build depends on (sources and headers), sorted."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def compiler_command(override: str | None) -> str | None:
    """The compiler to run: ``override`` (TORCHNEXT_CXX), else torch's choice (``$CXX``, else ``c++``), if found."""
    if override:
        return shutil.which(override)
    from torch.utils.cpp_extension import get_cxx_compiler

    return shutil.which(get_cxx_compiler())


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU model and feature flags."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    parts.append(line.strip())
                if len(parts) >= 3:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _arch_flags() -> list[str]:
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64", "i686") else []


def _version_line(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the compiler {cxx}: {exc}") from None
    line = (out.stdout or out.stderr).splitlines()
    return line[0].strip() if line else cxx


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths

    flags = ["-shared"]
    for p in library_paths():
        flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    flags += ["-lc10", "-ltorch_cpu"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    return flags


def _compile_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [*_BASE_FLAGS, *_arch_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths())]


def cache_key(cxx_version: str) -> str:
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(json.dumps([_BASE_FLAGS, _arch_flags(), torch.__version__, cxx_version, cpu_signature()]).encode())
    return h.hexdigest()[:16]


TYPICAL_SECONDS = 60.0
"""A first build's duration on a 2-core machine (what the start line says before any build here was timed)."""


def build(cache_dir: Path, cxx: str, *, timeout_s: float = 600.0, keep_days: int = 30) -> BuildResult:
    """The library for this environment: from the cache, or compiled now (under a file lock).

    Raises:
        torchnext._build.BuildTimeout: the lock or a compiler run took longer than ``timeout_s``.
        RuntimeError: the compiler failed (its output's tail in the message).
    """
    version = _version_line(cxx)
    key = cache_key(version)
    folder = cache_dir / f"{LIBRARY_NAME}-{key}"
    lib = folder / f"{LIBRARY_NAME}.so"
    if lib.exists():
        common.touch(folder)
        return BuildResult(library=lib, compiler=version, built=False, seconds=0.0)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with common.build_lock(cache_dir / f".{LIBRARY_NAME}-{key}.lock", timeout_s=timeout_s):
        if lib.exists():  # another process built it while we waited
            return BuildResult(library=lib, compiler=version, built=False, seconds=0.0)
        with common.announced("torchnext's C++ CPU kernels",
                              f"first use with torch {torch.__version__}, this compiler and CPU", folder,
                              common.typical_seconds(cache_dir, LIBRARY_NAME, TYPICAL_SECONDS)):
            t0 = time.perf_counter()
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
                flags = _compile_flags()
                objs = [Path(tmp) / (Path(s).stem + ".o") for s in SOURCES]
                common.run_commands([[cxx, *flags, "-c", str(CSRC / s), "-o", str(o)]
                                     for s, o in zip(SOURCES, objs, strict=True)], timeout_s=timeout_s)
                tmp_lib = Path(tmp) / lib.name
                common.run_commands([[cxx, *(str(o) for o in objs), *_link_flags(), "-o", str(tmp_lib)]],
                                    timeout_s=timeout_s)
                seconds = time.perf_counter() - t0
                meta = {"compiler": version, "seconds": round(seconds, 2), "torch": torch.__version__, "key": key}
                os.replace(tmp_lib, lib)
                (folder / common.BUILD_MARKER).write_text(json.dumps(meta, indent=1))
    common.prune(cache_dir, keep=folder, days=keep_days)
    return BuildResult(library=lib, compiler=version, built=True, seconds=seconds)
