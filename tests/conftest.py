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


@pytest.fixture(autouse=True)
def _no_active_ddp_module_left() -> object:
    """torch's DDP marks the module whose forward runs in a class attribute (``_active_ddp_module``) and restores
    the previous value on exit -- not thread-safe: two members training as threads of this process (the fault
    tolerance tests) can leave one of their DDPs marked. Every later ``torch.compile`` in the process then takes the
    DDPOptimizer path with that module's bucket size (CI, 2026-12-06: 48 compile tests failed with "First bucket
    should be smaller/equal to other buckets" after test_ft_vote_early's 256-byte buckets). Cleared after each
    test."""
    yield
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return
    DistributedDataParallel._active_ddp_module = None
