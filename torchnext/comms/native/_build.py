"""Build and load the native process-group extension with ``torch.utils.cpp_extension``: cache key, one file lock.

``torch.utils.cpp_extension.load`` compiles ``csrc/native.cpp`` against the installed torch (its headers, libtorch,
libtorch_python and pybind11: the extension takes and returns torch's own ``c10d::Backend``/``Work`` objects) with
ninja, into ``<TORCHNEXT_KERNEL_CACHE>/torchnext_native-<key>/``; ``key`` hashes the sources, the flags and torch's
version, so a new torch builds anew and an unchanged one loads in milliseconds. Concurrent first builds (every rank of
a job starting at once) serialize on ``fcntl.flock`` of ``.torchnext_native-<key>.lock`` next to the folder: the
first builds, the others wait and load what it built (``build.json`` marks a finished build).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchnext._config import env_config

__all__ = ["BuildResult", "build", "cache_folder", "missing_tools"]

NAME = "torchnext_native"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("native.cpp",)
FLAGS = ("-O2", "-std=c++17", "-fvisibility=hidden")


@dataclass(frozen=True, kw_only=True)
class BuildResult:
    """The loaded module and where it came from."""

    module: Any
    folder: Path
    built: bool
    """True if this call compiled it, False if it came from the cache."""
    seconds: float
    """Compile time of this call (0 for a cache hit)."""


def missing_tools() -> str | None:
    """What is missing to build the extension (a C++ compiler, ninja), or None when everything is there."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    cfg = env_config()
    cxx = cfg.cxx or get_cxx_compiler()
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx} not found on PATH; set TORCHNEXT_CXX or CXX)"
    if not is_ninja_available():
        return "ninja not found (torch.utils.cpp_extension needs it to build the extension)"
    return None


def cache_key() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(json.dumps([FLAGS, torch.__version__, str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))]).encode())
    return h.hexdigest()[:16]


def cache_folder() -> Path:
    """The folder this environment's extension is (or will be) built in."""
    return Path(env_config().kernel_cache) / f"{NAME}-{cache_key()}"


def build() -> BuildResult:
    """The extension for this environment: from the cache, or compiled now (under a file lock)."""
    import torch.distributed as dist
    from torch.utils import cpp_extension

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")

    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "build.json"
    cfg = env_config()
    if cfg.cxx:
        os.environ.setdefault("CXX", cfg.cxx)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while building *and* loading: ninja is not run twice at once
        built = not marker.exists()
        t0 = time.perf_counter()
        module = cpp_extension.load(
            name=f"{NAME}_{cache_key()}",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(FLAGS),
            build_directory=str(folder),
            verbose=False,
        )
        seconds = time.perf_counter() - t0
        if built:
            marker.write_text(json.dumps({"torch": torch.__version__, "seconds": round(seconds, 2)}, indent=1))
    return BuildResult(module=module, folder=folder, built=built, seconds=seconds if built else 0.0)
