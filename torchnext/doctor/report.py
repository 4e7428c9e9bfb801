"""A doctor report: facts + hazard verdicts + backend availability, and its JSON form (tables: :mod:`.render`).

JSON schema (``schema_version`` 1; keys are only ever added)::

    {
      "schema_version": 1,
      "facts": {<every Facts field>, "unavailable": {fact: reason}},
      "hazards": [{"id", "title", "severity", "applies", "detail", "meaning", "what_to_do", "source"}, ...],
      "torchnext": {"version": str, "backends": [{"area", "name", "available", "reason"}, ...]},
      "summary": {"hazards_applying": [id, ...], "backends_available": int, "backends_total": int}
    }
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchnext.doctor.facts import Facts
from torchnext.doctor.probes import BackendStatus, Probe, run_probes
from torchnext.doctor.rules import RULES, HazardResult, Rule, Severity, evaluate_rules

__all__ = ["SCHEMA_VERSION", "DoctorReport", "build_report"]

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    """Everything ``torchnext doctor`` prints."""

    facts: Facts
    hazards: list[HazardResult]
    backends: list[BackendStatus]

    @property
    def applying(self) -> list[HazardResult]:
        """The hazards that apply here."""
        return [h for h in self.hazards if h.verdict.applies]

    @property
    def gating(self) -> list[HazardResult]:
        """The applying hazards that fail ``--strict``: warnings and criticals (info is advice, never a gate)."""
        return [h for h in self.applying if h.rule.severity is not Severity.INFO]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "facts": self.facts.to_json(),
            "hazards": [h.to_json() for h in self.hazards],
            "torchnext": {
                "version": self.facts.torchnext_version,
                "backends": [b.to_json() for b in self.backends],
            },
            "summary": {
                "hazards_applying": [h.rule.id for h in self.applying],
                "backends_available": sum(b.available for b in self.backends),
                "backends_total": len(self.backends),
            },
        }


def build_report(
    facts: Facts | None = None, *, rules: tuple[Rule, ...] = RULES, probes: Iterable[Probe] | None = None
) -> DoctorReport:
    """Collect facts (unless given), evaluate ``rules`` and run the probes (all registered unless given)."""
    if facts is None:
        from torchnext.doctor.environment import collect_facts

        facts = collect_facts()
    return DoctorReport(facts=facts, hazards=evaluate_rules(facts, rules), backends=run_probes(facts, probes))
