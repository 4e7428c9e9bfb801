"""What ``torchnext doctor`` knows about an environment: plain, immutable data.

:class:`Facts` is the only input of the hazard rules (:mod:`torchnext.doctor.rules`) and of the backend probes
(:mod:`torchnext.doctor.probes`), so tests build fake environments with ``Facts(...)`` or
``dataclasses.replace(facts, ...)``. The default ``Facts()`` describes a bare CPU machine: nothing optional
installed, no GPU, nothing unknown. :func:`torchnext.doctor.environment.collect_facts` fills one in from the running
interpreter.

A fact whose probe failed holds its "unknown" value (``None``, or an empty mapping) and the reason sits in
:attr:`Facts.unavailable` under the field's name (``unavailable["driver_version"] == "nvidia-smi timed out"``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GPU", "Facts", "version_tuple"]

_VERSION_RE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    """The leading numeric release of a version string, or None when there is none.

    ``"2.14.0a0+git1234" -> (2, 14, 0)``, ``"25.10" -> (25, 10)``, ``"v3.4.5" -> (3, 4, 5)``, ``None -> None``,
    ``"unknown" -> None``. Compare with tuples of the same length (``version_tuple(v)[:2] >= (2, 13)``).
    """
    if version is None:
        return None
    m = _VERSION_RE.match(version)
    if m is None:
        return None
    return tuple(int(part) for part in m.group(1).split("."))


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator visible to torch."""

    index: int = 0
    """Device ordinal (``cuda:<index>``)."""
    name: str
    """Marketing name as the driver reports it (``"NVIDIA H100 80GB HBM3"``)."""
    capability: tuple[int, int]
    """Compute capability ``(major, minor)``: ``(9, 0)`` Hopper, ``(10, 0)`` B200, ``(12, 0)`` RTX 50xx."""
    total_memory_gib: float | None = None
    """Device memory in GiB (None: unknown)."""

    @property
    def sm(self) -> str:
        """``"sm_90"`` style name of the capability."""
        return f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True, kw_only=True)
class Facts:
    """A snapshot of the environment, gathered defensively (see the module docstring for "unknown" values)."""

    torchnext_version: str = "0.0.0"
    """``torchnext.__version__``."""

    python_version: tuple[int, int, int] = (3, 11, 0)
    """``sys.version_info[:3]``."""
    python_implementation: str = "CPython"
    """``platform.python_implementation()``."""
    python_executable: str | None = None
    """``sys.executable``."""
    os: str | None = None
    """``platform.platform()``."""
    machine: str | None = None
    """``platform.machine()`` (``x86_64``, ``aarch64``)."""

    torch_version: str | None = "2.14.0"
    """``torch.__version__``."""
    torch_git_version: str | None = None
    """``torch.version.git_version``."""
    torch_debug: bool | None = False
    """``torch.version.debug``."""
    torch_cuda_build: str | None = None
    """``torch.version.cuda``: the CUDA version torch was built with (None: not a CUDA build)."""
    torch_hip_build: str | None = None
    """``torch.version.hip`` (None: not a ROCm build)."""

    cuda_available: bool | None = False
    """``torch.cuda.is_available()``."""
    driver_version: str | None = None
    """NVIDIA driver version (``/proc/driver/nvidia/version`` or ``nvidia-smi``); None when no driver was found."""
    gpus: tuple[GPU, ...] = ()
    """The GPUs torch can use (empty without CUDA)."""
    nccl_version: str | None = None
    """``torch.cuda.nccl.version()`` as ``"2.27.5"`` (None: not a NCCL build)."""

    distributed_available: bool | None = True
    """``torch.distributed.is_available()``."""
    c10d_backends: dict[str, bool] = field(
        default_factory=lambda: {"gloo": True, "nccl": False, "mpi": False, "ucc": False}
    )
    """Which c10d process-group backends this torch build has."""
    nvshmem_available: bool | None = False
    """``torch.distributed._symmetric_memory.is_nvshmem_available()`` (torch's NVSHMEM symmetric memory)."""

    compile_supported: bool | None = True
    """``torch._dynamo.is_dynamo_supported()``: can torch.compile run under this interpreter."""
    compile_unsupported_reason: str | None = None
    """Dynamo's own message when ``compile_supported`` is False."""
    torch_features: dict[str, bool] = field(default_factory=dict)
    """Presence of torch features torchnext uses natively when present (``switch_hop``, ``dist_reconfigure``, ...)."""

    packages: dict[str, str | None] = field(default_factory=dict)
    """Installed version of related distributions (None or absent: not installed), by short name:
    ``transformer_engine``, ``triton``, ``torchao``, ``cutlass``, ``nvshmem``, ``torchft``, ``ml_dtypes``, ..."""
    importable: dict[str, bool] = field(default_factory=dict)
    """Whether a module imports (``triton``, ``cutlass``); the error of a failed import is in ``unavailable``
    under ``"importable.<name>"``."""

    thp_mode: str | None = None
    """Linux transparent huge pages mode (the bracketed word of ``/sys/kernel/mm/transparent_hugepage/enabled``:
    ``always``, ``madvise`` or ``never``); None elsewhere or when unreadable."""

    container_version: str | None = None
    """NVIDIA NGC PyTorch container release (``NVIDIA_PYTORCH_VERSION``, e.g. ``"25.10"``); None outside one."""
    env: dict[str, str] = field(default_factory=dict)
    """Relevant environment variables (:func:`torchnext._config.relevant_environment`)."""
    torchnext_config: dict[str, Any] | None = field(default_factory=dict)
    """The parsed ``TORCHNEXT_*`` settings (None when they do not parse; the error is in ``unavailable``)."""

    unavailable: dict[str, str] = field(default_factory=dict)
    """Fact name -> why it could not be gathered."""

    # ---- small derived views used by rules, probes and the report ----

    @property
    def torch_release(self) -> tuple[int, ...] | None:
        """``version_tuple(torch_version)``."""
        return version_tuple(self.torch_version)

    def package_version(self, name: str) -> str | None:
        """Installed version of the distribution known as ``name`` (None: not installed or unknown)."""
        return self.packages.get(name)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dictionary of every field (tuples become lists)."""
        return asdict(self)
