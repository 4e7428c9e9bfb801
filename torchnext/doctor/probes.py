"""Which torchnext areas and backends can run here, and why not: a registry of probes.

A :class:`Probe` answers "can backend ``name`` of area ``area`` run in this environment?" as an
:class:`Availability` (available + reason). Probes are functions of :class:`~torchnext.doctor.facts.Facts` (they may
also look at the machine themselves, but then they are harder to test).

Two ways to contribute probes:

* ``register_probe(Probe(...))`` at runtime;
* a *provider* module listed in :data:`PROBE_PROVIDERS` (or added with :func:`register_probe_provider`) that defines
  ``doctor_probes() -> Iterable[Probe]``. Doctor imports providers only when it runs, so a subpackage (for example
  the lowp backend registry) can describe its own backends without ``import torchnext.doctor`` importing it.

Probes are keyed by ``(area, name)``; a later contribution replaces an earlier one with the same key, so a subpackage
can take over the built-in coarse probes (:mod:`torchnext.doctor.builtin_probes`) of its area.

Semantics of :func:`run_probes`::

    [BackendStatus(p.area, p.name, *p.check(facts)) for p in all_probes()]   # a raising probe -> unavailable
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torchnext.doctor.facts import Facts

__all__ = [
    "PROBE_PROVIDERS",
    "Availability",
    "BackendStatus",
    "Probe",
    "all_probes",
    "register_probe",
    "register_probe_provider",
    "run_probes",
]


@dataclass(frozen=True, kw_only=True)
class Availability:
    """Whether something can run here; ``reason`` says why (or why not) in a few words."""

    available: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One backend's availability check."""

    area: str
    """torchnext area: ``comms``, ``lowp``, ``control``, ..."""
    name: str
    """Backend or feature name within the area."""
    check: Callable[[Facts], Availability]


@dataclass(frozen=True, kw_only=True)
class BackendStatus:
    """A probe's answer, as reported."""

    area: str
    name: str
    available: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"area": self.area, "name": self.name, "available": self.available, "reason": self.reason}


PROBE_PROVIDERS: list[str] = ["torchnext.doctor.builtin_probes", "torchnext.doctor.lowp_probes"]
"""Modules defining ``doctor_probes()``, imported in this order when doctor runs."""

_REGISTERED: dict[tuple[str, str], Probe] = {}


def register_probe(probe: Probe) -> None:
    """Add ``probe`` (replacing any probe with the same ``(area, name)``)."""
    if not probe.area or not probe.name:
        raise ValueError(f"probe needs a non-empty area and name, got area={probe.area!r} name={probe.name!r}")
    _REGISTERED[(probe.area, probe.name)] = probe


def register_probe_provider(module: str) -> None:
    """Add a provider module (a dotted name whose ``doctor_probes()`` yields :class:`Probe`s)."""
    if module not in PROBE_PROVIDERS:
        PROBE_PROVIDERS.append(module)


def _provider_failure(module: str, exc: BaseException) -> Probe:
    message = f"probe provider {module} failed: {type(exc).__name__}: {exc}"

    def check(facts: Facts) -> Availability:
        return Availability(available=False, reason=message)

    return Probe(area="doctor", name=module, check=check)


def all_probes() -> list[Probe]:
    """Providers' probes (in :data:`PROBE_PROVIDERS` order), then runtime registrations; later wins per key."""
    merged: dict[tuple[str, str], Probe] = {}
    for module in PROBE_PROVIDERS:
        try:
            provided = list(importlib.import_module(module).doctor_probes())
        except Exception as exc:
            failure = _provider_failure(module, exc)
            merged[(failure.area, failure.name)] = failure
            continue
        for probe in provided:
            merged[(probe.area, probe.name)] = probe
    merged.update(_REGISTERED)
    return list(merged.values())


def run_probes(facts: Facts, probes: Iterable[Probe] | None = None) -> list[BackendStatus]:
    """Ask every probe about ``facts``; a probe that raises reports ``unavailable: probe raised ...``."""
    out = []
    for probe in all_probes() if probes is None else probes:
        try:
            answer = probe.check(facts)
        except Exception as exc:
            answer = Availability(available=False, reason=f"probe raised {type(exc).__name__}: {exc}")
        out.append(BackendStatus(area=probe.area, name=probe.name, available=answer.available, reason=answer.reason))
    return out
