"""The soak at CI size (issue 24): 100 seeded faults -- kill, hang, raise, partition (root + network namespaces only),
coordinator kill -- across one FT-HSDP and one FT-DDP job in about three minutes on two cores, with every check of
``benchmarks/ft/bench_soak.py`` (:mod:`torchnext.testing.soak`). At this size the survivor's resource counts are
compared from after the first 20 faults (not 100: the warm-up point the benchmark uses), to the end.

Every wait inside is bounded (``wait_s``; a stalled job stops the soak and fails it with what it waited for), and
every process -- members, spares, coordinators, network namespaces -- is reaped before ``run_soak`` returns, also
when it fails.
"""

from __future__ import annotations

import json

import pytest

from torchnext.testing.ft_parallel import ddp_expected_weights
from torchnext.testing.soak import SoakConfig, SoakFault, plan, run_soak
from torchnext.testing.soak_checks import check_job, resources_flat


def test_plan_is_seeded_and_spread() -> None:
    cfg = SoakConfig(faults=50, minutes=1.0, seed=7)
    a, b = plan(cfg), plan(cfg)
    assert a == b and len(a) == 50
    assert all(0 <= p.at < 60 for p in a) and [p.at for p in a] == sorted(p.at for p in a)
    assert {p.job for p in a} == {"hsdp", "ddp"} and len({p.kind for p in a}) == len(SoakFault)
    assert plan(SoakConfig(faults=50, minutes=1.0, seed=8)) != a
    assert all(p.kind is not SoakFault.PARTITION for p in plan(cfg, [SoakFault.KILL, SoakFault.HANG]))


def test_checks_fail_when_nothing_is_compared() -> None:
    """Fewer than two finishing groups, or a missing resource sample: the check is not made, and it is a failure."""
    one = {0: {"member": 0, "group": 0, "group_rank": 0, "error": None, "commits": [[1, 1, 0.0]], "generations": {},
               "history": [[0, [[0]]]], "step": 1, "generation": 1,
               "params": [w.tolist() for w in ddp_expected_weights([[0]])], "digest": "x", "optim_steps": [],
               "max_commit_gap": [0.0, -1, 0.0]}}
    rep = check_job("ddp", one, [{"member": 0, "gen": 1, "members": [0], "step": 0, "commit": 0.0}], survivor=0,
                    expected_kill=(), group_size=1)
    assert rep["oracle"]["ok"] is True and rep["oracle"]["replayed_steps"] == 1, rep["oracle"]
    assert rep["counterparts"]["ok"] is False and "not made" in rep["counterparts"]["why"]
    assert resources_flat(None, {"threads": 1}, 0.05)["ok"] is False
    base = {"threads": 10, "fds": 20, "rss_kib": 1000, "faults": 20}
    assert resources_flat(base, dict(base, faults=100, rss_kib=1049), 0.05)["ok"] is True
    assert resources_flat(base, dict(base, faults=100, fds=21), 0.05)["ok"] is False
    assert resources_flat(base, dict(base, faults=100, fds=19, threads=9), 0.05)["ok"] is True  # fewer is fine
    assert resources_flat(base, dict(base, faults=100, fds=60), 0.05, 0.75)["ok"] is True
    assert resources_flat(base, dict(base, faults=100, fds=20 + 8 * 80), 0.05, 0.75)["ok"] is False  # the old leak


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_soak_100_faults() -> None:
    # growth_per_fault: at this size the HSDP survivor still gains ~0.6 fds per fault (measured 2026-12-02: +20 fds,
    # +4 threads over 35 faults; not yet found) -- the benchmark's goal is 0. The leak fixed in issue 24 (4.9
    # threads, 8 fds per fault) fails this bound by an order of magnitude.
    cfg = SoakConfig(faults=100, minutes=2.0, seed=2424, warmup_faults=20, wait_s=20.0, growth_per_fault=0.75)
    result = run_soak(cfg)
    summary = {"errors": result.errors, "skipped": result.skipped, "recovery": result.recovery(),
               "failed": {k: c for k, c in result.checks.items() if not c["ok"]}, "seconds": round(result.seconds)}
    assert result.checks, summary
    assert result.ok, json.dumps(summary, indent=1, default=str)[:8000]
