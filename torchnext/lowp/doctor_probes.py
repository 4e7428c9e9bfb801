"""Doctor probes for the ``scaled_mm`` backends: ``torchnext doctor`` lists each one as area ``lowp``, name
``scaled_mm.<backend>``, with the backend's own ``available()`` answer (installed packages, device, compiler).

Provider module for :mod:`torchnext.doctor.probes` (listed in ``PROBE_PROVIDERS``); imported only when doctor runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["doctor_probes"]


def doctor_probes() -> Iterable[Any]:
    """One ``Probe`` per registered scaled_mm backend."""
    from torchnext.doctor.probes import Availability, Probe
    from torchnext.lowp.backends import BACKENDS, get_backend

    get_backend("reference")  # loads the built-in backends

    def check_for(name: str) -> Any:
        def check(_facts: Any) -> Any:
            ok, why = BACKENDS[name].available()
            return Availability(available=ok, reason=why)

        return check

    return [Probe(area="lowp", name=f"scaled_mm.{name}", check=check_for(name)) for name in sorted(BACKENDS)]
