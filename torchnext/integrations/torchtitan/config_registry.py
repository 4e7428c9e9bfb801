"""Config functions for ``-m torchtitan.train --module torchnext.integrations.torchtitan --config NAME``:
torchtitan's own llama3 debug model with the torchnext low-precision converter."""

from __future__ import annotations

from typing import Any

from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from torchnext.integrations.torchtitan.converter import TorchnextLowpConverter

__all__ = [
    "llama3_debugmodel_torchnext_diloco",
    "llama3_debugmodel_torchnext_ft",
    "llama3_debugmodel_torchnext_ft_mxfp8",
    "llama3_debugmodel_torchnext_mxfp8",
    "llama3_debugmodel_torchnext_nvfp4",
]


def _with_lowp(recipe: str, fqns: list[str]) -> Any:
    config = llama3_debugmodel()
    config.model_spec = model_registry(
        "debugmodel", converters=[TorchnextLowpConverter.Config(recipe=recipe, fqns=fqns)])
    return config


def llama3_debugmodel_torchnext_mxfp8() -> Any:
    """llama3 debug model, every Linear (the output head too) in MXFP8 training."""
    return _with_lowp("mxfp8", [])


def llama3_debugmodel_torchnext_nvfp4() -> Any:
    """llama3 debug model, the transformer blocks' Linear layers in NVFP4 (the output head stays high precision)."""
    return _with_lowp("nvfp4", ["layers"])


def llama3_debugmodel_torchnext_ft() -> Any:
    """llama3 debug model trained by :class:`~torchnext.integrations.torchtitan.ft.FaultTolerantTrainer`: one
    ``torchnext run`` job per replica group (``TORCHNEXT_FT_REPLICA_GROUP``), FT-HSDP across the groups."""
    import dataclasses

    from torchnext.integrations.torchtitan.ft import FaultTolerantTrainer

    base = llama3_debugmodel()
    return FaultTolerantTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                                          if f.init})


def llama3_debugmodel_torchnext_ft_mxfp8() -> Any:
    """:func:`llama3_debugmodel_torchnext_ft` with every Linear in MXFP8 training (FT-HSDP + MXFP8)."""
    config = llama3_debugmodel_torchnext_ft()
    config.model_spec = model_registry("debugmodel", converters=[TorchnextLowpConverter.Config(recipe="mxfp8")])
    return config


def llama3_debugmodel_torchnext_diloco() -> Any:
    """:func:`llama3_debugmodel_torchnext_ft` trained semi-synchronously: DiLoCo (``--fault_tolerance.semi_sync_method
    diloco``), an outer synchronization every 5 steps (``--fault_tolerance.sync_steps``), FSDP inside each replica
    group only."""
    config = llama3_debugmodel_torchnext_ft()
    config.fault_tolerance.semi_sync_method = "diloco"
    return config
