"""The one place where torchnext reads ``TORCHNEXT_*`` environment variables.

Every knob has a field with a docstring in :class:`EnvConfig`; :func:`env_config` reads the environment each time
it is called (cheap), so tests can monkeypatch variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = ["ENV_VARS", "DistEnv", "EnvConfig", "dist_env", "env_config", "relevant_environment"]


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip() not in ("0", "1"):
        raise ValueError(f"environment variable {name}={raw!r}: expected 0 or 1")
    return raw.strip() == "1"


def _str(name: str, default: str | None) -> str | None:
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else raw


@dataclass(kw_only=True, frozen=True)
class EnvConfig:
    """Settings read from the environment."""

    fr_buffer_size: int = 2000
    """``TORCHNEXT_FR_BUFFER_SIZE``: Flight Recorder ring capacity; 0 disables recording."""

    fr_dump_dir: str | None = None
    """``TORCHNEXT_FR_DUMP_DIR``: folder for automatic Flight Recorder dumps (None: no automatic dumps)."""

    autotune: str = "1"
    """``TORCHNEXT_AUTOTUNE``: ``0`` (never time, use the static preference), ``1`` (time and cache, among the
    candidates bitwise equal to the static choice: results never depend on timing), ``readonly``, ``fastest``
    (time every candidate within tolerance: faster, but reruns and ranks may differ in the last bits)."""

    autotune_cache: str = str(Path.home() / ".cache" / "torchnext" / "autotune.json")
    """``TORCHNEXT_AUTOTUNE_CACHE``: path of the on-disk autotuner cache (JSON)."""

    ft_coordinator: str | None = None
    """``TORCHNEXT_FT_COORDINATOR``: ``host:port`` of the fault-tolerance coordinator (``torchnext coordinator``), or
    an ordered list ``host1:port1,host2:port2`` (the first in office is used; the others are standbys to fail over
    to)."""

    ft_token: str | None = None
    """``TORCHNEXT_FT_TOKEN``: the job token members present to the coordinator (a shared secret; a standby
    coordinator reads it too)."""

    ft_replica_group: int = -1
    """``TORCHNEXT_FT_REPLICA_GROUP``: this process's replica group id (-1: none given, a group of its own)."""

    ft_leader_address: str | None = None
    """``TORCHNEXT_FT_LEADER_ADDRESS``: ``host:port`` where rank 0 of this process's replica group holds the group's
    session (``FaultTolerantConfig.leader_address``; unset: derived through the replica group's store)."""

    ft_group_session: bool = True
    """``TORCHNEXT_FT_GROUP_SESSION``: ``1`` (default) -- a replica group of more than one rank holds one group
    session (its rank 0 speaks to the coordinator for it, ``FaultTolerantConfig.group_session``); ``0`` -- every
    rank connects to the coordinator itself (flat)."""

    huge_pages: int = 1
    """``TORCHNEXT_HUGE_PAGES``: ``1`` asks Linux for transparent huge pages on the large CPU outputs torchnext
    allocates itself (``madvise(MADV_HUGEPAGE)``, see :mod:`torchnext.lowp.workspace`); ``0`` never does."""

    cpu_kernels: int = 1
    """``TORCHNEXT_CPU_KERNELS``: ``1`` builds torchnext's C++ CPU kernels on first use (cached, see
    :mod:`torchnext.lowp.cpu`) and lets ``backend="auto"`` pick them; ``0`` never builds or loads them (the pure-torch
    paths run)."""

    kernel_cache: str = str(Path.home() / ".cache" / "torchnext" / "kernels")
    """``TORCHNEXT_KERNEL_CACHE``: folder of the compiled CPU kernels (one subfolder per source/torch/compiler/CPU)."""

    build_timeout: int = 600
    """``TORCHNEXT_BUILD_TIMEOUT``: seconds a kernel build may take -- each compiler or linker run, and the wait for
    another process's build of the same library (its lock) -- before the build is given up with a warning and the
    fallback path runs (:mod:`torchnext._build`)."""

    kernel_cache_keep_days: int = 30
    """``TORCHNEXT_KERNEL_CACHE_KEEP_DAYS``: a build in ``TORCHNEXT_KERNEL_CACHE`` not used for this many days is
    removed when another one is built (0: never remove)."""

    cxx: str | None = None
    """``TORCHNEXT_CXX``: the C++ compiler for the CPU kernels (default: ``$CXX``, else ``c++``, as torch's
    ``cpp_extension``)."""

    pg_cuda_backend: str = "nccl"
    """``TORCHNEXT_PG_CUDA_BACKEND``: the backend of the CUDA Communicator of torchnext process groups,
    ``nccl`` (used when CUDA and NCCL are available) or ``none`` (the groups communicate CPU tensors only)."""

    pg_fr_buffer_size: int = 2000
    """Flight Recorder ring size of the process groups torch creates with ``backend="torchnext"``:
    ``TORCHNEXT_FR_BUFFER_SIZE`` when set, else torch's own ``TORCH_FR_BUFFER_SIZE``, else 2000 (0 disables)."""

    suite_groups: str = "gloo"
    """``TORCHNEXT_SUITE_GROUPS``: which groups :mod:`torchnext.testing.torch_suite` (PyTorch's distributed test
    suite as a harness) gives the suite -- ``gloo`` (torch's own) or ``torchnext``."""

    native_pg: int = 1
    """``TORCHNEXT_NATIVE_PG``: ``1`` (default) runs the ops of torchnext process groups on the native data path (a
    C++ ``c10d::Backend`` over the group's Gloo backend, built on first use: :mod:`torchnext.comms.native`) whenever
    no hook, consistency mode or fault-tolerant staging asks for Python per op -- the Python path where no compiler
    is there (one warning); ``0`` keeps every op on the Python path."""

    check_collectives: bool = False
    """``TORCHNEXT_CHECK_COLLECTIVES``: ``1`` turns the consistency mode on for every Communicator (and the groups
    of ``backend="torchnext"``) built without an explicit ``check_collectives=``, ``0`` off. Unset: on when torch's
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is set (torch's own checker never wraps a Python group), else off."""

    pg_fr_dump_dir: str | None = None
    """Their automatic-dump folder: ``TORCHNEXT_FR_DUMP_DIR`` when set, else the folder of torch's dump-file
    prefix ``TORCH_FR_DUMP_TEMP_FILE``, else None (no automatic dumps)."""


ENV_VARS = {
    "fr_buffer_size": "TORCHNEXT_FR_BUFFER_SIZE",
    "fr_dump_dir": "TORCHNEXT_FR_DUMP_DIR",
    "autotune": "TORCHNEXT_AUTOTUNE",
    "autotune_cache": "TORCHNEXT_AUTOTUNE_CACHE",
    "ft_coordinator": "TORCHNEXT_FT_COORDINATOR",
    "ft_token": "TORCHNEXT_FT_TOKEN",
    "ft_replica_group": "TORCHNEXT_FT_REPLICA_GROUP",
    "ft_leader_address": "TORCHNEXT_FT_LEADER_ADDRESS",
    "ft_group_session": "TORCHNEXT_FT_GROUP_SESSION",
    "huge_pages": "TORCHNEXT_HUGE_PAGES",
    "cpu_kernels": "TORCHNEXT_CPU_KERNELS",
    "kernel_cache": "TORCHNEXT_KERNEL_CACHE",
    "cxx": "TORCHNEXT_CXX",
    "build_timeout": "TORCHNEXT_BUILD_TIMEOUT",
    "kernel_cache_keep_days": "TORCHNEXT_KERNEL_CACHE_KEEP_DAYS",
    "pg_cuda_backend": "TORCHNEXT_PG_CUDA_BACKEND",
    "pg_fr_buffer_size": "TORCHNEXT_FR_BUFFER_SIZE",
    "pg_fr_dump_dir": "TORCHNEXT_FR_DUMP_DIR",
    "suite_groups": "TORCHNEXT_SUITE_GROUPS",
    "check_collectives": "TORCHNEXT_CHECK_COLLECTIVES",
    "native_pg": "TORCHNEXT_NATIVE_PG",
}
_TORCH_FALLBACKS = {"pg_fr_buffer_size": "TORCH_FR_BUFFER_SIZE"}
"""Fields that fall back to torch's variable of the same meaning when ours is unset."""


def env_config() -> EnvConfig:
    """Read the ``TORCHNEXT_*`` variables into an :class:`EnvConfig` (defaults where unset)."""
    defaults = EnvConfig()
    values: dict[str, object] = {}
    for f in fields(EnvConfig):
        var = ENV_VARS[f.name]
        if not os.environ.get(var) and os.environ.get(_TORCH_FALLBACKS.get(f.name, "")):
            var = _TORCH_FALLBACKS[f.name]
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            values[f.name] = _flag(var, default)
        elif isinstance(default, int):
            values[f.name] = _int(var, default)
        else:
            values[f.name] = _str(var, default)
    autotune = values["autotune"]
    if autotune not in ("0", "1", "readonly", "fastest"):
        raise ValueError(f"TORCHNEXT_AUTOTUNE={autotune!r}: expected one of '0', '1', 'readonly', 'fastest'")
    if values["cpu_kernels"] not in (0, 1):
        raise ValueError(f"TORCHNEXT_CPU_KERNELS={values['cpu_kernels']!r}: expected 0 or 1")
    if values["native_pg"] not in (0, 1):
        raise ValueError(f"TORCHNEXT_NATIVE_PG={values['native_pg']!r}: expected 0 or 1")
    if values["huge_pages"] not in (0, 1):
        raise ValueError(f"TORCHNEXT_HUGE_PAGES={values['huge_pages']!r}: expected 0 or 1")
    if int(values["fr_buffer_size"]) < 0:  # type: ignore[call-overload]
        raise ValueError(f"TORCHNEXT_FR_BUFFER_SIZE={values['fr_buffer_size']!r} must be >= 0")
    if int(values["pg_fr_buffer_size"]) < 0:  # type: ignore[call-overload]
        raise ValueError(f"TORCH_FR_BUFFER_SIZE={values['pg_fr_buffer_size']!r} must be >= 0")
    if int(values["build_timeout"]) < 1:  # type: ignore[call-overload]
        raise ValueError(f"TORCHNEXT_BUILD_TIMEOUT={values['build_timeout']!r} must be >= 1 (seconds)")
    if int(values["kernel_cache_keep_days"]) < 0:  # type: ignore[call-overload]
        raise ValueError(f"TORCHNEXT_KERNEL_CACHE_KEEP_DAYS={values['kernel_cache_keep_days']!r} must be >= 0")
    if values["suite_groups"] not in ("gloo", "torchnext"):
        raise ValueError(f"TORCHNEXT_SUITE_GROUPS={values['suite_groups']!r}: expected 'gloo' or 'torchnext'")
    if values["pg_cuda_backend"] not in ("nccl", "none"):
        raise ValueError(f"TORCHNEXT_PG_CUDA_BACKEND={values['pg_cuda_backend']!r}: expected 'nccl' or 'none'")
    if not os.environ.get("TORCHNEXT_CHECK_COLLECTIVES"):
        values["check_collectives"] = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    if values["pg_fr_dump_dir"] is None and os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
        values["pg_fr_dump_dir"] = str(Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"]).parent)
    return EnvConfig(**values)  # type: ignore[arg-type]


RELEVANT_ENV_PREFIXES: tuple[str, ...] = ("TORCHNEXT_", "TORCH_NCCL_", "NCCL_", "NVSHMEM_", "TORCH_FR_")
"""Prefixes of the variables ``torchnext doctor`` reports (read-only)."""

RELEVANT_ENV_NAMES: tuple[str, ...] = (
    "TORCH_DISTRIBUTED_DEBUG",
    "NVIDIA_IMEX_CHANNELS",
    "NVIDIA_PYTORCH_VERSION",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "THP_MEM_ALLOC_ENABLE",
)
"""Individual variables ``torchnext doctor`` reports (read-only)."""

_SECRET_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "KEY")


def relevant_environment() -> dict[str, str]:
    """The environment variables that matter to torchnext and its hazards, sorted by name.

    Semantics::

        {k: v for k, v in os.environ.items()
         if (k in RELEVANT_ENV_NAMES or k.startswith(RELEVANT_ENV_PREFIXES)) and no secret marker in k}

    Names containing TOKEN/SECRET/PASSWORD/KEY are never returned, so a report can be pasted into an issue.
    """
    out: dict[str, str] = {}
    for name, value in os.environ.items():
        if name not in RELEVANT_ENV_NAMES and not name.startswith(RELEVANT_ENV_PREFIXES):
            continue
        if any(marker in name.upper() for marker in _SECRET_MARKERS):
            continue
        out[name] = value
    return dict(sorted(out.items()))
@dataclass(kw_only=True, frozen=True)
class DistEnv:
    """The standard torchrun / ``env://`` variables (not TORCHNEXT_*: launchers set them)."""

    rank: int
    """``RANK``: global rank of this process."""
    world_size: int
    """``WORLD_SIZE``: number of processes."""
    master_addr: str
    """``MASTER_ADDR``: host of the TCPStore."""
    master_port: int
    """``MASTER_PORT``: port of the TCPStore."""
    local_rank: int
    """``LOCAL_RANK`` (default: ``RANK``)."""


def dist_env() -> DistEnv:
    """Read RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK; a missing required one raises ValueError."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"environment variables {missing} are not set (expected from torchrun or an env:// launcher)")
    rank = _int("RANK", 0)
    return DistEnv(
        rank=rank,
        world_size=_int("WORLD_SIZE", 1),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=_int("MASTER_PORT", 0),
        local_rank=_int("LOCAL_RANK", rank),
    )
