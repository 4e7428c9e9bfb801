"""``torchnext doctor``: what this environment is, what torchnext can run on it, and which known hazards apply.

* :mod:`~torchnext.doctor.facts`       -- :class:`Facts`, the data every check reads (fake it in tests).
* :mod:`~torchnext.doctor.environment` -- :func:`collect_facts`, one guarded probe per fact.
* :mod:`~torchnext.doctor.rules`       -- :data:`RULES`, the hazard table (data + detection functions).
* :mod:`~torchnext.doctor.probes`      -- the backend-availability registry other areas contribute to.
* :mod:`~torchnext.doctor.report`      -- JSON and rich rendering; :mod:`~torchnext.doctor.command` is the CLI.

Importing this package is lean: it does not import rich, probe CUDA or import optional libraries; that happens in
:func:`collect_facts` / :func:`build_report`.
"""

from __future__ import annotations

from torchnext.doctor.environment import collect_facts as collect_facts
from torchnext.doctor.facts import GPU as GPU
from torchnext.doctor.facts import Facts as Facts
from torchnext.doctor.facts import version_tuple as version_tuple
from torchnext.doctor.probes import Availability as Availability
from torchnext.doctor.probes import BackendStatus as BackendStatus
from torchnext.doctor.probes import Probe as Probe
from torchnext.doctor.probes import register_probe as register_probe
from torchnext.doctor.probes import register_probe_provider as register_probe_provider
from torchnext.doctor.probes import run_probes as run_probes
from torchnext.doctor.report import SCHEMA_VERSION as SCHEMA_VERSION
from torchnext.doctor.report import DoctorReport as DoctorReport
from torchnext.doctor.report import build_report as build_report
from torchnext.doctor.rules import RULES as RULES
from torchnext.doctor.rules import HazardResult as HazardResult
from torchnext.doctor.rules import Rule as Rule
from torchnext.doctor.rules import Severity as Severity
from torchnext.doctor.rules import Verdict as Verdict
from torchnext.doctor.rules import evaluate_rules as evaluate_rules

__all__ = [
    "GPU",
    "RULES",
    "SCHEMA_VERSION",
    "Availability",
    "BackendStatus",
    "DoctorReport",
    "Facts",
    "HazardResult",
    "Probe",
    "Rule",
    "Severity",
    "Verdict",
    "build_report",
    "collect_facts",
    "evaluate_rules",
    "register_probe",
    "register_probe_provider",
    "run_probes",
    "version_tuple",
]
