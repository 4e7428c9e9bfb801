"""Test and debugging support for :class:`~torchnext.integrations.torchtitan.FaultTolerantTrainer`'s semi-sync
training: a trainer that records the parameters around every outer synchronization, so that a test (or a person
checking a job) can recompute each outer step with an oracle of their own, and that can hold a group until a killed
one has restarted (a test's schedule). Not used by the trainer itself. (Here rather than in
:mod:`torchnext.testing`, which sits below the integrations layer and may not import the trainer.)

``-m torchtitan.train --module torchnext.integrations.torchtitan.recording --config
llama3_debugmodel_torchnext_ft_recorded --recording.folder DIR [--recording.params layers.1.,lm_head]
[--recording.hold_at_step 4 --recording.hold_for_group 1]``. What it writes to ``DIR`` (``g``: replica group, ``r``: rank in the group, ``a``:
torchrun's restart count; tensors are this rank's local shards of the recorded parameters)::

    g{g}-r{r}-a{a}-joined.pt    # {name: tensor} after joining (the job's formation, or a rejoin: healed)
    g{g}-r{r}-a{a}-s{step}.pt   # {"pre": {...}, "post": {...}, "syncs": [OuterSyncRecord fields]}: around the
                                # synchronization(s) after inner step `step`
    restarted-g{g}              # a restarted attempt of group g is about to join
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchnext.ft.state import local
from torchnext.integrations.torchtitan.config_registry import llama3_debugmodel_torchnext_ft
from torchnext.integrations.torchtitan.ft import FaultTolerantTrainer

__all__ = ["Recording", "RecordingTrainer", "llama3_debugmodel_torchnext_ft_recorded"]


@dataclass(kw_only=True, slots=True)
class Recording:
    """The ``--recording.*`` section of :class:`RecordingTrainer.Config`."""

    folder: str = ""
    """Where to write (the module docstring); empty: record nothing."""
    params: list[str] = field(default_factory=list)
    """Record the parameters whose fqn contains one of these (empty: all)."""
    hold_at_step: int = 0
    """After this step (0: never), wait until a restarted attempt of ``hold_for_group`` is about to join."""
    hold_for_group: int = -1
    """The group whose restart ``hold_at_step`` waits for."""
    hold_timeout_s: float = 240.0
    """The hold's bound: past it, ``RuntimeError``."""


class RecordingTrainer(FaultTolerantTrainer):
    """:class:`FaultTolerantTrainer` that records around each outer synchronization (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):
        recording: Recording = field(default_factory=Recording)
        """What to record, and the hold."""

    def _restart(self) -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def _path(self, name: str) -> Path:
        return Path(self.config.recording.folder) / name

    def _snapshot(self) -> dict[str, torch.Tensor]:
        wanted = self.config.recording.params
        return {n: local(p.detach()).clone() for n, p in self.model_parts[0].named_parameters()
                if not wanted or any(w in n for w in wanted)}

    def _save(self, name: str, obj: Any) -> None:
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        os.replace(tmp, path)

    def _join(self) -> None:
        rec = self.config.recording
        if not rec.folder:
            super()._join()
            return
        g, r, a = self.replica_group, dist.get_rank(), self._restart()
        if a > 0:
            self._path(f"restarted-g{g}").touch()
        super()._join()
        self._save(f"g{g}-r{r}-a{a}-joined.pt", self._snapshot())

    def _outer_sync(self) -> None:
        rec = self.config.recording
        if not rec.folder:
            super()._outer_sync()
            return
        before, n = self._snapshot(), len(self.syncs)
        super()._outer_sync()
        if len(self.syncs) > n:
            g, r, a = self.replica_group, dist.get_rank(), self._restart()
            self._save(f"g{g}-r{r}-a{a}-s{self.step}.pt", {
                "pre": before, "post": self._snapshot(), "syncs": [dataclasses.asdict(s) for s in self.syncs[n:]]})
        if rec.hold_at_step and self.step == rec.hold_at_step:
            marker = self._path(f"restarted-g{rec.hold_for_group}")
            deadline = time.monotonic() + rec.hold_timeout_s
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RecordingTrainer: group {rec.hold_for_group} did not restart within "
                                       f"{rec.hold_timeout_s}s ({marker} missing)")
                time.sleep(0.1)


def llama3_debugmodel_torchnext_ft_recorded() -> Any:
    """:func:`~torchnext.integrations.torchtitan.config_registry.llama3_debugmodel_torchnext_ft`, trained by
    :class:`RecordingTrainer`."""
    base = llama3_debugmodel_torchnext_ft()
    return RecordingTrainer.Config(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init})
