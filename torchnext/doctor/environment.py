"""Gather :class:`~torchnext.doctor.facts.Facts` from the running interpreter, one guarded probe per fact.

Every probe runs inside :class:`_Collector.gather`: an exception becomes ``Facts.unavailable[name] = "<Type>:
<message>"`` and the fact keeps its unknown value, so one broken library never stops the report. Collecting does
initialise CUDA when a GPU is present (to read device properties); importing this module does not.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from torchnext.doctor.facts import GPU, Facts

__all__ = ["KNOWN_PACKAGES", "collect_facts"]

T = TypeVar("T")

KNOWN_PACKAGES: dict[str, tuple[str, ...]] = {
    "transformer_engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"),
    "triton": ("triton", "pytorch-triton", "pytorch-triton-rocm"),
    "torchao": ("torchao",),
    "cutlass": ("nvidia-cutlass-dsl", "nvidia-cutlass"),
    "nvshmem": ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
    "torchft": ("torchft", "torchft-nightly"),
    "ml_dtypes": ("ml_dtypes",),
    "numpy": ("numpy",),
    "rich": ("rich",),
}
"""Short name -> distribution names to try, first installed wins."""

IMPORT_CHECKS: dict[str, str] = {"triton": "triton", "cutlass": "cutlass"}
"""Short name -> module imported to prove that an installed package really loads."""

_PROC_DRIVER = Path("/proc/driver/nvidia/version")
_DRIVER_RE = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9]+(?:\.[0-9]+)+)")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Collector:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.unavailable: dict[str, str] = {}

    def gather(self, name: str, probe: Callable[[], T], *, default: Any = None, store: bool = True) -> T | None:
        """Run ``probe`` and store its value under ``name``; on failure store ``default``, record why, return None.

        ``store=False`` records only a failure (for entries of a mapping fact, named ``"<fact>.<key>"``).
        """
        try:
            value = probe()
        except Exception as exc:
            self.unavailable[name] = _describe(exc)
            if store:
                self.values[name] = default
            return None
        if store:
            self.values[name] = value
        return value


def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for short, dists in KNOWN_PACKAGES.items():
        out[short] = None
        for dist in dists:
            try:
                out[short] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def _driver_version(cuda_available: bool) -> str | None:
    """NVIDIA kernel driver version; reads /proc first, asks nvidia-smi only when CUDA is usable."""
    if _PROC_DRIVER.exists():
        m = _DRIVER_RE.search(_PROC_DRIVER.read_text(errors="replace"))
        if m:
            return m.group(1)
    smi = shutil.which("nvidia-smi")
    if cuda_available and smi:
        proc = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        )
        first = proc.stdout.strip().splitlines()
        return first[0].strip() if first else None
    return None


def _gpus(torch: Any) -> tuple[GPU, ...]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            GPU(
                index=i,
                name=str(props.name),
                capability=(int(props.major), int(props.minor)),
                total_memory_gib=round(props.total_memory / 2**30, 1),
            )
        )
    return tuple(gpus)


def _nccl_version(torch: Any) -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    v = torch.cuda.nccl.version()
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _c10d_backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {}
    out: dict[str, bool] = {}
    for name in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        check = getattr(dist, f"is_{name}_available", None)
        if check is not None:
            out[name] = bool(check())
    return out


def _nvshmem_available() -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed import _symmetric_memory

    check = getattr(_symmetric_memory, "is_nvshmem_available", None)
    return bool(check()) if check is not None else False


def _compile_support() -> tuple[bool, str | None]:
    from torch._dynamo import eval_frame

    check = getattr(eval_frame, "check_if_dynamo_supported", None)
    if check is None:  # very old or very new torch: fall back on the boolean
        import torch._dynamo

        return bool(torch._dynamo.is_dynamo_supported()), None
    try:
        check()
    except Exception as exc:
        return False, str(exc)
    return True, None


def _has_attr(module: str, attr: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return False
        return hasattr(mod, attr)

    return probe


TORCH_FEATURES: dict[str, Callable[[], bool]] = {
    "switch_hop": _has_attr("torch._higher_order_ops", "switch"),
    "while_loop_hop": _has_attr("torch._higher_order_ops", "while_loop"),
    "dynamic_spec_decorator": _has_attr("torch.fx.experimental.dynamic_spec", "dynamic_spec"),
    "dist_reconfigure": _has_attr("torch.distributed", "_reconfigure"),
    "functional_scaled_mm": _has_attr("torch.nn.functional", "scaled_mm"),
    "scaled_mm": _has_attr("torch", "_scaled_mm"),
    "float4_e2m1fn_x2": _has_attr("torch", "float4_e2m1fn_x2"),
    "float8_e8m0fnu": _has_attr("torch", "float8_e8m0fnu"),
}
"""Feature name -> check, for torch features whose presence changes what torchnext can do natively."""


def _import_check(module: str) -> bool:
    importlib.import_module(module)
    return True



_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The selected THP mode (``always [madvise] never`` → ``"madvise"``); None without the file."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None

def collect_facts() -> Facts:
    """Probe the running interpreter and return its :class:`Facts` (never raises for a failing probe)."""
    import torch

    import torchnext
    from torchnext._config import env_config, relevant_environment

    c = _Collector()
    c.values["torchnext_version"] = torchnext.__version__
    c.values["python_version"] = tuple(sys.version_info[:3])
    c.values["python_implementation"] = platform.python_implementation()
    c.values["python_executable"] = sys.executable
    c.gather("os", platform.platform)
    c.gather("machine", platform.machine)

    c.gather("torch_version", lambda: str(torch.__version__))
    c.gather("torch_git_version", lambda: getattr(torch.version, "git_version", None))
    c.gather("torch_debug", lambda: bool(getattr(torch.version, "debug", False)))
    c.gather("torch_cuda_build", lambda: torch.version.cuda)
    c.gather("torch_hip_build", lambda: getattr(torch.version, "hip", None))

    cuda = bool(c.gather("cuda_available", torch.cuda.is_available))
    c.gather("driver_version", lambda: _driver_version(cuda))
    c.values["gpus"] = ()
    if cuda:
        c.gather("gpus", lambda: _gpus(torch), default=())
    c.gather("nccl_version", lambda: _nccl_version(torch))

    c.gather("distributed_available", lambda: bool(torch.distributed.is_available()))
    c.gather("c10d_backends", _c10d_backends, default={})
    c.gather("nvshmem_available", _nvshmem_available)

    support = c.gather("compile_supported", _compile_support)
    c.values["compile_supported"], c.values["compile_unsupported_reason"] = support or (None, None)

    features: dict[str, bool] = {}
    for name, check in TORCH_FEATURES.items():
        value = c.gather(f"torch_features.{name}", check, store=False)
        if value is not None:
            features[name] = value
    c.values["torch_features"] = features

    packages = c.gather("packages", _package_versions, default={}) or {}
    importable: dict[str, bool] = {}
    for short, module in IMPORT_CHECKS.items():
        if packages.get(short) is None:
            continue  # not installed: nothing to import
        importable[short] = bool(c.gather(f"importable.{short}", functools.partial(_import_check, module), store=False))
    c.values["importable"] = importable

    c.gather("thp_mode", _thp_mode)
    env = c.gather("env", relevant_environment, default={}) or {}
    c.values["container_version"] = env.get("NVIDIA_PYTORCH_VERSION")
    c.gather("torchnext_config", lambda: asdict(env_config()))

    return Facts(**c.values, unavailable=c.unavailable)
