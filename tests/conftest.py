"""Session set-up shared by every test directory.

The compiled CPU kernels (torchnext/lowp/cpu) and the native process-group backend (torchnext/comms/native: the
default data path of torchnext process groups) are built on first use and cached; here that first use happens once,
before any test runs, so the build (tens of seconds each on a 2-core machine, more under load) is never charged to
one test's timeout -- or to a rank of a multi-rank test -- and the pytest header says whether the fast paths are in
use and why.
"""

from __future__ import annotations

import pytest


def _kernels() -> str:
    from torchnext.lowp.cpu import status  # memoized: builds or loads once per process

    st = status()
    return f"torchnext CPU kernels: {'available' if st.available else 'unavailable'}: {st.reason}"


def _native() -> str:
    from torchnext.comms.native import status  # memoized: builds or loads once per process

    st = status()
    return f"torchnext native process groups: {'available' if st.available else 'unavailable'}: {st.reason}"


def pytest_sessionstart(session: pytest.Session) -> None:
    _kernels()
    _native()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import os

    long = os.environ.get("TORCHNEXT_LONG", "") not in ("", "0")
    return [_kernels(), _native(), f"long-haul sizes: {'on' if long else 'off (CI sizes; TORCHNEXT_LONG=1 for the full ones)'}"]
