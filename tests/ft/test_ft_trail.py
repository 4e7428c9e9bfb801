"""A member's membership trail: the bounded record of what it saw (interrupts, announcements, entries, reports),
carried by the ``QuorumLost`` a member raises when no generation comes -- so that such a failure in a long or
loaded run says what the member knew (the coordinator-failover flake of issue #24 left only "no new generation")."""

from __future__ import annotations

import pytest

from torchnext.ft import Coordinator, CoordinatorConfig, FaultTolerant, FaultTolerantConfig, MembershipConfig
from torchnext.ft.fault_tolerant import TRAIL_KEPT
from torchnext.ft.membership import QuorumLost

pytestmark = pytest.mark.timeout(60)


def test_waiting_in_vain_for_a_generation_raises_quorum_lost_with_the_members_last_events() -> None:
    cfg = CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1))
    with Coordinator(cfg) as coord:
        ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, member_id=0, min_size=1))
        try:
            assert ft.generation == 1
            assert any(e.endswith("entered gen 1") for e in ft.trail), list(ft.trail)
            ft._report("a test says generation 1 broke")  # the coordinator replaces it ...
            ft._settle(need_new=True, timeout=20)
            assert ft.generation == 2
            with pytest.raises(QuorumLost) as exc:  # ... but nothing replaces generation 2
                ft._settle(need_new=True, timeout=0.3)
            text = str(exc.value)
            assert "no new generation within 0.3s after generation 2 broke" in text
            assert "generation 2, attempted 2, newest announced 2, pending None" in text
            assert "report gen 1 broken (a test says generation 1 broke)" in text and "entered gen 2" in text, text
        finally:
            ft.close()


def test_the_trail_is_bounded() -> None:
    cfg = CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1))
    with Coordinator(cfg) as coord:
        ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token, member_id=0, min_size=1))
        try:
            for i in range(3 * TRAIL_KEPT):
                ft._trace(f"event {i}")
            assert len(ft.trail) == TRAIL_KEPT and ft.trail[-1].endswith(f"event {3 * TRAIL_KEPT - 1}")
        finally:
            ft.close()
