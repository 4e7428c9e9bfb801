"""The doctor's lowp provider reports the compiled CPU kernels and every scaled_mm backend with its own
availability answer."""

from __future__ import annotations

import pytest


def test_doctor_probes_cover_every_backend() -> None:
    pytest.importorskip("torchnext.doctor.probes", reason="torchnext.doctor is not on this branch (merged by the lead)")
    from torchnext.doctor.lowp_probes import doctor_probes
    from torchnext.lowp.cpu import status
    from torchnext.lowp.mm.backends import available_backends

    probes = {p.name: p for p in doctor_probes()}
    avail = available_backends()
    assert set(probes) == {"cpu-kernels"} | {f"scaled_mm.{n}" for n in avail}
    kernels = probes["cpu-kernels"].check(None)
    assert (kernels.available, kernels.reason) == (status().available, status().reason)
    if kernels.available:
        assert "built with" in kernels.reason and "cached at" in kernels.reason
    for name, (ok, why) in avail.items():
        got = probes[f"scaled_mm.{name}"].check(None)
        assert (got.available, got.reason) == (ok, why)
