"""Built-in probes: coarse "can this run here" answers from the collected facts alone.

They check prerequisites (torch features, c10d backends, GPUs, importable kernel libraries), not torchnext's
backends themselves; an area that grows its own backend registry can replace them by providing probes with the same
``(area, name)`` (see :mod:`torchnext.doctor.probes`).
"""

from __future__ import annotations

from collections.abc import Callable

from torchnext.doctor.facts import Facts
from torchnext.doctor.probes import Availability, Probe

__all__ = ["doctor_probes"]


def _yes(reason: str) -> Availability:
    return Availability(available=True, reason=reason)


def _no(reason: str) -> Availability:
    return Availability(available=False, reason=reason)


def _cuda_gpus(facts: Facts) -> Availability | None:
    """None when at least one CUDA GPU is usable, else why not."""
    if facts.torch_cuda_build is None:
        return _no("torch is not a CUDA build")
    if not facts.cuda_available:
        return _no("CUDA build, but no GPU is visible (torch.cuda.is_available() is False)")
    if not facts.gpus:
        return _no("no CUDA GPU enumerated")
    return None


def _sm100(facts: Facts) -> Availability | None:
    """None when some CUDA GPU has sm_100+, else why not."""
    missing = _cuda_gpus(facts)
    if missing is not None:
        return missing
    if not any(g.capability >= (10, 0) for g in facts.gpus):
        best = max(facts.gpus, key=lambda g: g.capability)
        return _no(f"needs sm_100+; best GPU is {best.name} ({best.sm}): emulated only")
    return None


def _c10d(name: str) -> Callable[[Facts], Availability]:
    def check(facts: Facts) -> Availability:
        if facts.distributed_available is False:
            return _no("torch.distributed is not available in this build")
        if not facts.c10d_backends.get(name, False):
            return _no(f"torch was built without the {name} backend")
        if name == "nccl":
            missing = _cuda_gpus(facts)
            if missing is not None:
                return missing
            return _yes(f"NCCL {facts.nccl_version or '?'} on {len(facts.gpus)} GPU(s)")
        return _yes(f"c10d {name} backend present")

    return check


def _comms_reconfigure(facts: Facts) -> Availability:
    if facts.torch_features.get("dist_reconfigure"):
        return _yes("torch.distributed._reconfigure present (in-place group rebuild)")
    return _no("torch has no torch.distributed._reconfigure (added in 2.14)")


def _lowp_reference(facts: Facts) -> Availability:
    return _yes("pure torch: runs on any device (correctness path)")


def _lowp_fp8_scaled_mm(facts: Facts) -> Availability:
    if not facts.torch_features.get("scaled_mm"):
        return _no("torch has no torch._scaled_mm")
    where = "CUDA" if _cuda_gpus(facts) is None else "CPU"
    return _yes(f"torch._scaled_mm tensorwise/rowwise FP8 on {where}")


def _lowp_block_scaled_native(facts: Facts) -> Availability:
    missing = _sm100(facts)
    if missing is not None:
        return missing
    if not (facts.torch_features.get("functional_scaled_mm") or facts.torch_features.get("scaled_mm")):
        return _no("torch has no scaled_mm entry point")
    return _yes("sm_100+ GPU with torch scaled_mm: hardware NVFP4/MXFP8/MXFP4 GEMMs")


def _lowp_triton(facts: Facts) -> Availability:
    if facts.packages.get("triton") is None:
        return _no("triton is not installed (pip install 'torchnext[gpu]')")
    if not facts.importable.get("triton", False):
        return _no(f"triton does not import: {facts.unavailable.get('importable.triton', 'unknown error')}")
    missing = _cuda_gpus(facts)
    if missing is not None:
        return missing
    return _yes(f"triton {facts.packages['triton']} on {facts.gpus[0].name}")


def _lowp_cutlass(facts: Facts) -> Availability:
    if facts.packages.get("cutlass") is None:
        return _no("CUTLASS Python DSL is not installed (nvidia-cutlass-dsl)")
    if not facts.importable.get("cutlass", False):
        return _no(f"cutlass does not import: {facts.unavailable.get('importable.cutlass', 'unknown error')}")
    missing = _sm100(facts)
    if missing is not None:
        return missing
    return _yes(f"cutlass {facts.packages['cutlass']} with an sm_100+ GPU")


def _lowp_torchao(facts: Facts) -> Availability:
    version = facts.packages.get("torchao")
    if version is None:
        return _no("torchao is not installed (only needed as a test oracle)")
    return _yes(f"torchao {version} (test oracle)")


def _compile(facts: Facts) -> Availability:
    if facts.compile_supported:
        return _yes("torch.compile is supported by this interpreter")
    if facts.compile_supported is None:
        return _no(f"unknown: {facts.unavailable.get('compile_supported', 'not reported')}")
    return _no(facts.compile_unsupported_reason or "torch.compile is not supported here")


def _control_switch(facts: Facts) -> Availability:
    if facts.torch_features.get("switch_hop"):
        return _yes("torch._higher_order_ops.switch present")
    return _no("torch has no native switch operator (added in 2.14)")


def _control_while_loop(facts: Facts) -> Availability:
    if facts.torch_features.get("while_loop_hop"):
        return _yes("torch._higher_order_ops.while_loop present")
    return _no("torch has no while_loop operator")


def _control_dynamic_spec(facts: Facts) -> Availability:
    if facts.torch_features.get("dynamic_spec_decorator"):
        return _yes("torch.fx.experimental.dynamic_spec.dynamic_spec present")
    return _no("torch has no dynamic_spec decorator (added in 2.14)")


def doctor_probes() -> list[Probe]:
    """The built-in probes, in report order."""
    table: list[tuple[str, str, Callable[[Facts], Availability]]] = [
        ("comms", "gloo", _c10d("gloo")),
        ("comms", "nccl", _c10d("nccl")),
        ("comms", "mpi", _c10d("mpi")),
        ("comms", "ucc", _c10d("ucc")),
        ("comms", "reconfigure", _comms_reconfigure),
        ("lowp", "reference", _lowp_reference),
        ("lowp", "fp8-scaled-mm", _lowp_fp8_scaled_mm),
        ("lowp", "block-scaled-native", _lowp_block_scaled_native),
        ("lowp", "triton", _lowp_triton),
        ("lowp", "cutlass", _lowp_cutlass),
        ("lowp", "torchao-oracle", _lowp_torchao),
        ("control", "compile", _compile),
        ("control", "switch-native", _control_switch),
        ("control", "while-loop-native", _control_while_loop),
        ("control", "dynamic-spec-native", _control_dynamic_spec),
    ]
    return [Probe(area=area, name=name, check=check) for area, name, check in table]
