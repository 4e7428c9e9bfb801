"""Doctor probes for lowp: ``cpu-kernels`` (torchnext's compiled C++ CPU kernels: built with which compiler, cached
where, or why not — this probe builds them if the cache has none, which takes ~30-60 s once) and one probe per
``scaled_mm`` backend, name ``scaled_mm.<backend>``, with the backend's own ``available()`` answer (installed
packages, device, compiler).

A provider module of :mod:`torchnext.doctor.probes` (listed in ``PROBE_PROVIDERS``), imported only when doctor
runs. The doctor reads lowp's backend registry; lowp knows nothing of the doctor.
"""

from __future__ import annotations

from collections.abc import Callable

from torchnext.doctor.facts import Facts
from torchnext.doctor.probes import Availability, Probe

__all__ = ["doctor_probes"]


def doctor_probes() -> list[Probe]:
    """``cpu-kernels``, then one ``Probe`` per registered scaled_mm backend (built-in and user-registered)."""
    from torchnext.lowp.cpu import status
    from torchnext.lowp.mm.backends import BACKENDS, available_backends

    def kernels(_facts: Facts) -> Availability:
        st = status()
        return Availability(available=st.available, reason=st.reason)

    available_backends()  # loads the built-in backends

    def check_for(name: str) -> Callable[[Facts], Availability]:
        def check(_facts: Facts) -> Availability:
            ok, why = BACKENDS[name].available()
            return Availability(available=ok, reason=why)

        return check

    return [
        Probe(area="lowp", name="cpu-kernels", check=kernels),
        *(Probe(area="lowp", name=f"scaled_mm.{name}", check=check_for(name)) for name in sorted(BACKENDS)),
    ]
