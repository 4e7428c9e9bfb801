"""The hazard table: known problems of this software stack, each a row of data with a detection function.

A :class:`Rule`'s ``detect`` is a pure function of :class:`~torchnext.doctor.facts.Facts` returning a
:class:`Verdict` (does it apply here, and the specifics that made the call). Evaluating the table is::

    [HazardResult(rule, rule.detect(facts)) for rule in RULES]

Adding a hazard = adding a ``Rule(...)`` to :data:`RULES` plus a test with a faked environment where it applies and
one where it does not (tests/cli/test_doctor.py). Facts that could not be gathered make a rule "not apply" with a
detail that says the answer is unknown; they never make it raise.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from torchnext.doctor.facts import GPU, Facts, version_tuple

__all__ = ["RULES", "HazardResult", "Rule", "Severity", "Verdict", "evaluate_rules"]


class Severity(str, Enum):
    """How bad a hazard is when it applies."""

    INFO = "info"
    """Worth knowing; nothing breaks."""
    WARNING = "warning"
    """Something fails loudly, runs slowly, or runs differently than you may expect."""
    CRITICAL = "critical"
    """Wrong results, crashes or hangs, or an unsupported setup."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The outcome of one rule on one environment."""

    applies: bool
    detail: str
    """Why (names the versions, GPUs or variables that decided it)."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One known hazard."""

    id: str
    """Stable kebab-case identifier (used in JSON and by ``--strict`` users to filter)."""
    title: str
    severity: Severity
    meaning: str
    """What goes wrong when the hazard applies."""
    what_to_do: str
    source: str
    """Where the caveat comes from."""
    detect: Callable[[Facts], Verdict]


@dataclass(frozen=True, kw_only=True)
class HazardResult:
    """A rule together with its verdict on the collected facts."""

    rule: Rule
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        r = self.rule
        return {
            "id": r.id,
            "title": r.title,
            "severity": r.severity.value,
            "applies": self.verdict.applies,
            "detail": self.verdict.detail,
            "meaning": r.meaning,
            "what_to_do": r.what_to_do,
            "source": r.source,
        }


def _unknown(facts: Facts, name: str) -> str:
    reason = facts.unavailable.get(name)
    return f"unknown: {name} unavailable ({reason})" if reason else f"unknown: {name} not reported"


def _gpu_list(gpus: tuple[GPU, ...] | list[GPU]) -> str:
    return ", ".join(f"cuda:{g.index} {g.name} ({g.sm})" for g in gpus)


# ---------------------------------------------------------------------------------------------------------------
# Detection functions (pure functions of Facts)
# ---------------------------------------------------------------------------------------------------------------


def _te_214_mxfp8_dbias(facts: Facts) -> Verdict:
    version = facts.package_version("transformer_engine")
    if version is None:
        return Verdict(applies=False, detail="Transformer Engine is not installed")
    v = version_tuple(version)
    if v is None:
        return Verdict(applies=False, detail=f"unknown: cannot parse Transformer Engine version {version!r}")
    affected = v[:2] == (2, 14) and (len(v) < 3 or v[2] == 0)
    if affected:
        return Verdict(applies=True, detail=f"transformer_engine {version} is installed (fixed in 2.14.1)")
    return Verdict(applies=False, detail=f"transformer_engine {version} is not the affected 2.14.0")


_FLEX_IMA_GPU = re.compile(r"\bH100\b|\bH200\b|\bGH200\b|\bThor\b", re.IGNORECASE)
_FLEX_IMA_FIRST_TORCH = (2, 10)


def _flex_attention_ima(facts: Facts) -> Verdict:
    if facts.torch_hip_build is not None:
        return Verdict(applies=False, detail="ROCm build: the report concerns CUDA GPUs")
    hit = [g for g in facts.gpus if _FLEX_IMA_GPU.search(g.name)]
    if not hit:
        if "gpus" in facts.unavailable:
            return Verdict(applies=False, detail=_unknown(facts, "gpus"))
        return Verdict(applies=False, detail="no THOR / H100 / H200 GPU visible")
    release = facts.torch_release
    if release is None:
        return Verdict(
            applies=False, detail=f"{_gpu_list(hit)} present but torch version {_unknown(facts, 'torch_version')}"
        )
    if release[:2] < _FLEX_IMA_FIRST_TORCH:
        return Verdict(applies=False, detail=f"torch {facts.torch_version} predates the reported regression (2.10+)")
    arch = f" on {facts.machine}" if facts.machine else ""
    return Verdict(applies=True, detail=f"torch {facts.torch_version}{arch} with {_gpu_list(hit)}")


_NVSHMEM_IMEX_FIRST_CONTAINER = (25, 10)


def _nvshmem_imex(facts: Facts) -> Verdict:
    channels = facts.env.get("NVIDIA_IMEX_CHANNELS")
    if channels is not None and channels.strip() != "":
        return Verdict(applies=False, detail=f"NVIDIA_IMEX_CHANNELS={channels} is set")
    container = version_tuple(facts.container_version)
    if container is not None and container[:2] >= _NVSHMEM_IMEX_FIRST_CONTAINER:
        return Verdict(
            applies=True,
            detail=f"NVIDIA container {facts.container_version} (ships NVSHMEM) and NVIDIA_IMEX_CHANNELS is unset",
        )
    nvshmem = facts.package_version("nvshmem")
    if container is None and (nvshmem is not None or facts.nvshmem_available):
        found = f"NVSHMEM {nvshmem}" if nvshmem else "torch's NVSHMEM support"
        return Verdict(
            applies=False,
            detail=f"{found} found outside an NVIDIA container: the caveat is stated for container releases 25.10+; "
            "if NVSHMEM segfaults at start-up, set NVIDIA_IMEX_CHANNELS=0",
        )
    if container is not None:
        return Verdict(applies=False, detail=f"NVIDIA container {facts.container_version} predates 25.10")
    return Verdict(applies=False, detail="no NVSHMEM found")


def _compile_unsupported(facts: Facts) -> Verdict:
    py = ".".join(str(x) for x in facts.python_version)
    if facts.python_version[:2] >= (3, 15):
        return Verdict(applies=True, detail=f"Python {py}: torch.compile does not support 3.15+")
    if facts.compile_supported is False:
        reason = facts.compile_unsupported_reason or "torch._dynamo.is_dynamo_supported() is False"
        return Verdict(applies=True, detail=f"Python {py}: {reason}")
    if facts.compile_supported is None:
        return Verdict(applies=False, detail=_unknown(facts, "compile_supported"))
    return Verdict(applies=False, detail=f"torch.compile is supported on Python {py}")


def _native_block_scaled(gpu: GPU, facts: Facts) -> bool:
    return facts.torch_hip_build is None and gpu.capability >= (10, 0)


def _fp4_mx_needs_sm100(facts: Facts) -> Verdict:
    if not facts.gpus:
        if "gpus" in facts.unavailable:
            return Verdict(applies=False, detail=_unknown(facts, "gpus"))
        return Verdict(applies=False, detail="no GPU: block-scaled GEMMs use the reference path (expected on CPU)")
    slow = [g for g in facts.gpus if not _native_block_scaled(g, facts)]
    if slow:
        kind = "ROCm GPUs" if facts.torch_hip_build is not None else "below sm_100"
        return Verdict(applies=True, detail=f"{kind}: {_gpu_list(slow)}")
    return Verdict(applies=False, detail=f"all GPUs are sm_100+: {_gpu_list(facts.gpus)}")


_TORCHNEXT_MIN_TORCH = (2, 13)


def _torch_too_old(facts: Facts) -> Verdict:
    release = facts.torch_release
    if release is None:
        return Verdict(applies=False, detail=_unknown(facts, "torch_version"))
    if release[:2] < _TORCHNEXT_MIN_TORCH:
        return Verdict(applies=True, detail=f"torch {facts.torch_version} < 2.13")
    return Verdict(applies=False, detail=f"torch {facts.torch_version} >= 2.13")


def _gloo_missing(facts: Facts) -> Verdict:
    if facts.distributed_available is False:
        return Verdict(applies=True, detail="torch.distributed.is_available() is False")
    if facts.distributed_available is None:
        return Verdict(applies=False, detail=_unknown(facts, "distributed_available"))
    if "c10d_backends" in facts.unavailable:
        return Verdict(applies=False, detail=_unknown(facts, "c10d_backends"))
    if not facts.c10d_backends.get("gloo", False):
        return Verdict(applies=True, detail="this torch build has no Gloo backend")
    return Verdict(applies=False, detail="Gloo is available")


def _nccl_async_error_handling_off(facts: Facts) -> Verdict:
    value = facts.env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if value is not None and value.strip() == "0":
        return Verdict(applies=True, detail="TORCH_NCCL_ASYNC_ERROR_HANDLING=0")
    shown = "unset" if value is None else f"={value}"
    return Verdict(applies=False, detail=f"TORCH_NCCL_ASYNC_ERROR_HANDLING {shown}")


def _driver_but_cpu_torch(facts: Facts) -> Verdict:
    if facts.driver_version is None:
        return Verdict(applies=False, detail="no NVIDIA driver found")
    if facts.torch_cuda_build is None and facts.torch_hip_build is None and facts.torch_version is not None:
        return Verdict(
            applies=True, detail=f"NVIDIA driver {facts.driver_version} but torch {facts.torch_version} has no CUDA"
        )
    return Verdict(applies=False, detail=f"NVIDIA driver {facts.driver_version}, torch CUDA {facts.torch_cuda_build}")


def _config_invalid(facts: Facts) -> Verdict:
    reason = facts.unavailable.get("torchnext_config")
    if reason is not None:
        return Verdict(applies=True, detail=reason)
    return Verdict(applies=False, detail="TORCHNEXT_* settings parse")


def _cpu_alloc_small_pages(facts: Facts) -> Verdict:
    if facts.thp_mode is None:
        return Verdict(applies=False, detail="not Linux, or the THP mode is unreadable")
    env = facts.env.get("THP_MEM_ALLOC_ENABLE")
    if facts.thp_mode == "madvise" and (env is None or env.strip() != "1"):
        shown = "unset" if env is None else f"={env}"
        return Verdict(applies=True, detail=f"transparent huge pages: madvise; THP_MEM_ALLOC_ENABLE {shown}")
    return Verdict(applies=False, detail=f"transparent huge pages: {facts.thp_mode}; THP_MEM_ALLOC_ENABLE={env}")


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    Rule(
        id="te-2.14-mxfp8-dbias",
        title="Transformer Engine 2.14 + MXFP8 training with bias can give nondeterministic wrong answers",
        severity=Severity.CRITICAL,
        meaning="TE 2.14.0's fused MXFP8 quantization + bias-gradient (dbias) kernel can silently produce wrong "
        "results, differently from run to run, when training with an MXFP8 recipe and bias=True.",
        what_to_do="Upgrade to transformer-engine >= 2.14.1, or train those layers without bias / without MXFP8.",
        source="NVIDIA 26.08 container release notes; fixed in Transformer Engine v2.14.1 (NVIDIA/TransformerEngine#2921)",
        detect=_te_214_mxfp8_dbias,
    ),
    Rule(
        id="flex-attention-ima",
        title="FlexAttention may hit a nondeterministic illegal memory access on THOR and H100/H200",
        severity=Severity.WARNING,
        meaning="Compiled FlexAttention kernels can fault with 'CUDA error: an illegal memory access' on these GPUs, "
        "not on every run; the process's CUDA context is then unusable.",
        what_to_do="If you use torch.nn.attention.flex_attention here, checkpoint often and prefer SDPA for "
        "production runs until a torch release lists the fix; report reproducers upstream.",
        source="PyTorch 2.14 release notes (known issues); pytorch/pytorch#168397",
        detect=_flex_attention_ima,
    ),
    Rule(
        id="nvshmem-imex-channels",
        title="NVSHMEM from 25.10 may need NVIDIA_IMEX_CHANNELS=0 to avoid segfaults",
        severity=Severity.WARNING,
        meaning="NVSHMEM initialisation (torch symmetric memory, NVSHMEM-based kernels) can segfault when no IMEX "
        "channel is selected.",
        what_to_do="export NVIDIA_IMEX_CHANNELS=0 (or pass -e NVIDIA_IMEX_CHANNELS=0 to the container).",
        source="NVIDIA 26.08 PyTorch container release notes",
        detect=_nvshmem_imex,
    ),
    Rule(
        id="compile-unsupported-python",
        title="torch.compile is unsupported under this interpreter (Python 3.15+)",
        severity=Severity.WARNING,
        meaning="torch.compile raises instead of compiling; torchnext's compile paths (compiled control flow, "
        "Inductor lowp backends) raise an error rather than silently falling back to eager.",
        what_to_do="Use Python <= 3.14 for compiled paths, or call the eager entry points explicitly.",
        source="PyTorch 2.14 release notes; torch._dynamo.eval_frame.check_if_dynamo_supported",
        detect=_compile_unsupported,
    ),
    Rule(
        id="fp4-mx-needs-sm100",
        title="FP4/MX block-scaled GEMMs need sm_100+ (Hopper only emulates)",
        severity=Severity.WARNING,
        meaning="NVFP4 / MXFP8 / MXFP4 matmuls have no hardware path on these GPUs: they run emulated "
        "(dequantize + high-precision GEMM): numerically equivalent, without the speed or memory win.",
        what_to_do="Run block-scaled training or inference on Blackwell-class GPUs (sm_100+) for speed; use the "
        "emulated path elsewhere for correctness checks only.",
        source="PyTorch 2.14 / NVIDIA 26.08 container release notes; cuBLAS block-scaled GEMM requirements",
        detect=_fp4_mx_needs_sm100,
    ),
    Rule(
        id="torch-too-old",
        title="torch older than 2.13 is not supported by torchnext",
        severity=Severity.CRITICAL,
        meaning="torchnext relies on torch 2.13+ APIs (control-flow operators, scaled_mm, c10d hooks); older "
        "releases fail at import or at first use.",
        what_to_do="pip install 'torch>=2.13'.",
        source="torchnext pyproject.toml (dependencies)",
        detect=_torch_too_old,
    ),
    Rule(
        id="gloo-unavailable",
        title="torch.distributed / Gloo unavailable",
        severity=Severity.CRITICAL,
        meaning="torchnext.comms' CPU path, its multi-rank tests and `torchnext demo` need the Gloo backend.",
        what_to_do="Install an official torch wheel (they include Gloo), or build torch with USE_DISTRIBUTED=1.",
        source="torchnext.comms requirements",
        detect=_gloo_missing,
    ),
    Rule(
        id="nccl-async-error-handling-off",
        title="TORCH_NCCL_ASYNC_ERROR_HANDLING=0 disables NCCL failure handling",
        severity=Severity.WARNING,
        meaning="With async error handling off, the NCCL watchdog neither aborts communicators nor tears down on "
        "a timeout: a rank that dies can leave the others hanging, defeating fault tolerance.",
        what_to_do="unset TORCH_NCCL_ASYNC_ERROR_HANDLING (default 3), or set it to 1 or 3.",
        source="PyTorch ProcessGroupNCCL environment variables documentation",
        detect=_nccl_async_error_handling_off,
    ),
    Rule(
        id="gpu-driver-cpu-torch",
        title="NVIDIA driver present but torch is a CPU-only build",
        severity=Severity.INFO,
        meaning="Everything runs on the CPU although a GPU driver is installed.",
        what_to_do="Install a CUDA build of torch (https://pytorch.org/get-started/locally/).",
        source="torch.version.cuda and /proc/driver/nvidia/version",
        detect=_driver_but_cpu_torch,
    ),
    Rule(
        id="cpu-alloc-small-pages",
        title="Large CPU tensors are backed by 4 KiB pages (THP is madvise-only and torch does not ask)",
        severity=Severity.INFO,
        meaning="Every fresh CPU tensor of tens of MiB page-faults once per 4 KiB on its first write: on the "
        "2-core CI machine a new 64 MiB tensor took 17.8 ms to fill instead of 3.7 ms. torchnext advises huge "
        "pages for the large outputs it allocates itself (TORCHNEXT_HUGE_PAGES), but not for torch's own tensors.",
        what_to_do="export THP_MEM_ALLOC_ENABLE=1 before starting Python (PyTorch reads it once, at its first "
        "allocation): torch then aligns and advises huge pages for every large CPU allocation.",
        source="c10/core/impl/alloc_cpu.cpp (THP_MEM_ALLOC_ENABLE); measured in docs/benchmarks.md (grouped GEMM)",
        detect=_cpu_alloc_small_pages,
    ),
    Rule(
        id="torchnext-config-invalid",
        title="A TORCHNEXT_* environment variable does not parse",
        severity=Severity.CRITICAL,
        meaning="torchnext raises ValueError wherever it reads its settings (Flight Recorder, autotuner).",
        what_to_do="Fix or unset the variable named in the detail (see docs/doctor.md for the list).",
        source="torchnext._config.env_config",
        detect=_config_invalid,
    ),
)
"""Every known hazard, in report order."""


def evaluate_rules(facts: Facts, rules: tuple[Rule, ...] = RULES) -> list[HazardResult]:
    """Run every rule on ``facts``; a rule whose detection raises is reported as not applying, with the error."""
    results = []
    for rule in rules:
        try:
            verdict = rule.detect(facts)
        except Exception as exc:  # a broken rule must not hide the others
            verdict = Verdict(applies=False, detail=f"unknown: rule raised {type(exc).__name__}: {exc}")
        results.append(HazardResult(rule=rule, verdict=verdict))
    return results
