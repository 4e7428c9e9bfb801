"""Build and load the native process-group extension with ``torch.utils.cpp_extension``: cache key, one file lock.

``torch.utils.cpp_extension.load`` compiles ``csrc/native.cpp`` and ``csrc/ddp.cpp`` against the installed torch
(its headers, libtorch, libtorch_python and pybind11: the extension takes and returns torch's own
``c10d::Backend``/``Work`` objects and registers a comm hook on torch's DDP ``Reducer``) with ninja, into ``<TORCHNEXT_KERNEL_CACHE>/torchnext_native-<key>/``; ``key`` hashes the sources, the flags and torch's
version, so a new torch builds anew and an unchanged one loads in milliseconds. Concurrent first builds (every rank of
a job starting at once) serialize on ``fcntl.flock`` of ``.torchnext_native-<key>.lock`` next to the folder: the
first builds, the others wait and load what it built (``build.json`` marks a finished build).

The compile runs in a child process (``python -c`` of :func:`compile_here`) bounded by ``TORCHNEXT_BUILD_TIMEOUT``,
as is the wait for another process's lock: a hung compiler means the Python path with a warning, never a blocked
rank. The start and end of a build are one line each on stderr; builds unused for
``TORCHNEXT_KERNEL_CACHE_KEEP_DAYS`` are pruned (:mod:`torchnext._build`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchnext import _build as common
from torchnext._config import env_config

__all__ = ["BuildResult", "build", "cache_folder", "compile_here", "load_cached", "missing_tools"]

NAME = "torchnext_native"
CSRC = Path(__file__).with_name("csrc")
SOURCES = ("native.cpp", "ddp.cpp")
FLAGS = ("-O2", "-std=c++17", "-fvisibility=hidden")
TYPICAL_SECONDS = 45.0
"""A first build's duration on a 2-core machine (what the start line says before any build here was timed)."""


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


def _load(folder: Path) -> Any:
    """``cpp_extension.load`` into ``folder`` (called under the build lock). A ``lock`` file there is
    ``cpp_extension``'s own baton left by a process killed mid-build (by the build timeout, or a test's kill): with
    our lock held nobody else is building, and left alone it would make every later load wait forever."""
    from torch.utils import cpp_extension

    with contextlib.suppress(FileNotFoundError):
        (folder / "lock").unlink()

    return cpp_extension.load(name=f"{NAME}_{cache_key()}", sources=[str(CSRC / s) for s in SOURCES],
                              extra_cflags=list(FLAGS), build_directory=str(folder), verbose=False)


def load_cached() -> BuildResult | None:
    """The extension this environment already built, imported straight from its cache folder -- no compiler
    check, no ninja, no lock (a finished build is never written again: its key names its sources, flags and torch)
    -- or None when there is none yet (then :func:`build`)."""
    folder = cache_folder()
    name = f"{NAME}_{cache_key()}"
    path = folder / f"{name}.so"
    if not (folder / common.BUILD_MARKER).exists() or not path.is_file():
        return None
    if name in sys.modules:  # already imported in this process
        return BuildResult(module=sys.modules[name], folder=folder, built=False, seconds=0.0)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    common.touch(folder)
    return BuildResult(module=module, folder=folder, built=False, seconds=0.0)


def compile_here() -> None:
    """Compile the extension into :func:`cache_folder` (what the bounded child process of :func:`build` runs)."""
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    _load(folder)


def build() -> BuildResult:
    """The extension for this environment: from the cache, or compiled now (under a file lock, in a child process
    bounded by ``TORCHNEXT_BUILD_TIMEOUT``).

    Raises:
        torchnext._build.BuildTimeout: the lock or the compile took longer than the timeout.
        RuntimeError: the compile failed (its output's tail in the message).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    cached = load_cached()
    if cached is not None:  # never through ninja: a checkout at another path would recompile the finished build
        return cached
    cfg = env_config()
    folder = cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / common.BUILD_MARKER
    if cfg.cxx:
        os.environ.setdefault("CXX", cfg.cxx)  # cpp_extension's compiler, here and in the child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    timeout_s = float(cfg.build_timeout)
    built = False
    seconds = 0.0
    # held while building *and* loading: ninja is not run twice at once on one folder
    with common.build_lock(folder.parent / f".{folder.name}.lock", timeout_s=timeout_s):
        if not marker.exists():
            with common.announced("torchnext's native process-group extension",
                                  f"first use with torch {torch.__version__}", folder,
                                  common.typical_seconds(folder.parent, NAME, TYPICAL_SECONDS)):
                t0 = time.perf_counter()
                common.run_commands([[sys.executable, "-c",
                                      "from torchnext.comms.native._build import compile_here; compile_here()"]],
                                    timeout_s=timeout_s, env=env)
                seconds = time.perf_counter() - t0
                marker.write_text(json.dumps({"torch": torch.__version__, "seconds": round(seconds, 2)}, indent=1))
            built = True
        else:
            common.touch(folder)
        # the build is finished: import it from its folder (what a crashed earlier load left, ``_load`` repairs)
        cached = load_cached()
        module = cached.module if cached is not None else _load(folder)
    if built:
        common.prune(folder.parent, keep=folder, days=cfg.kernel_cache_keep_days)
    return BuildResult(module=module, folder=folder, built=built, seconds=seconds)
