"""PyTorch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the torch wheel) as a harness
for torchnext process groups.

The suite picks its backend from the ``BACKEND`` environment variable and gates about 44 places on ``BACKEND ==
"gloo"``. So ``BACKEND`` stays ``gloo``, and with ``TORCHNEXT_SUITE_GROUPS=torchnext`` every group the suite creates
(``init_process_group``, ``new_group``) is a torchnext group instead -- the swap ``torchnext run`` does
(:func:`torchnext.comms.process_group.launch.swap_backends`). With ``TORCHNEXT_SUITE_GROUPS=gloo`` (default) it is
torch's own Gloo: the same tests, the oracle. Spawned test processes import this module again, so the swap is made
at import. Needs the ``expecttest`` package (in the ``[test]`` extra). Run it with pytest, e.g.::

    BACKEND=gloo WORLD_SIZE=2 TORCHNEXT_SUITE_GROUPS=torchnext python -m pytest torchnext/testing/torch_suite.py
    python benchmarks/comms/torch_dist_suite.py --groups torchnext --world-size 3     # whole suite, counts
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")  # replaced per test by the suite's setUp

from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

from torchnext._config import env_config

__all__ = ["GROUPS", "TestTorchSuite", "junit_outcomes"]

GROUPS = env_config().suite_groups
"""Which groups the suite runs on in this process: ``gloo`` or ``torchnext``."""

if GROUPS == "torchnext":
    from torchnext.comms.process_group.launch import swap_backends

    swap_backends()


class TestTorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of ``DistributedTest._DistTestBase``, each on ``WORLD_SIZE`` spawned processes."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def junit_outcomes(junit: str | Path) -> dict[str, str]:
    """``{test name: "passed" | "failed" | "skipped"}`` from the JUnit XML of a run of this module (an error
    counts as failed)."""
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "?")
        if case.find("failure") is not None or case.find("error") is not None:
            out[name] = "failed"
        elif case.find("skipped") is not None:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out
