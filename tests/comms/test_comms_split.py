"""Eager split / split_by_color on 4 real processes: membership, ranks, collectives in children, nesting."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from torchnext.comms import Communicator
from torchnext.testing import RankContext, run_ranks


def _summary(c: Communicator | None) -> Any:
    return None if c is None else (c.rank, c.size, c.ranks, c.name)


def _split_scenario(ctx: RankContext) -> dict[str, Any]:
    g = ctx.rank
    world = Communicator(ctx.store, g, 4, timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    # split(ranks): order of the list gives child ranks; non-members get None
    sub = world.split([3, 0, 2], name="trio")
    out["split"] = _summary(sub)
    if sub is not None:
        t = torch.tensor([float(g)])
        sub.all_reduce(t)  # usable at once (eager)
        out["split_sum"] = t.item()
        gathered = torch.empty(3, dtype=torch.int64)
        sub.all_gather_single(gathered, torch.tensor([g]))
        out["split_gather"] = gathered.tolist()
    # split_by_color: two colors, key reverses the order; both children run collectives at the same time
    half = world.split_by_color(g % 2, key=-g)
    assert half is not None
    out["color"] = _summary(half)
    t = torch.tensor([float(10 ** g)])
    half.all_reduce(t)
    out["color_sum"] = t.item()
    # nesting: split a child again; color None -> not a member
    nested = half.split_by_color(None if half.rank == 0 else 7)
    out["nested"] = _summary(nested)
    if nested is not None:
        t = torch.tensor([float(g)])
        nested.all_reduce(t)
        out["nested_sum"] = t.item()
    # the parent still works after splits
    t = torch.ones(1)
    world.all_reduce(t)
    out["world_sum"] = t.item()
    # mismatched lists are detected on every rank
    with pytest.raises(ValueError, match="differ"):
        world.split([0, 1] if g == 0 else [0, 2])
    # bad arguments are refused locally before any exchange
    with pytest.raises(ValueError, match="out of range"):
        world.split([0, 9])
    with pytest.raises(ValueError, match="duplicates"):
        world.split([1, 1])
    with pytest.raises(TypeError, match="color"):
        world.split_by_color("red")  # type: ignore[arg-type]
    # aborting a child leaves its parent alone
    if half is not None:
        half.abort()
    world.barrier()
    return out


def test_split_and_split_by_color() -> None:
    res = run_ranks(_split_scenario, 4, timeout=120)
    trio = {3: 0, 0: 1, 2: 2}
    for g, r in enumerate(res):
        if g in trio:
            assert r["split"] == (trio[g], 3, [3, 0, 2], "trio"), r["split"]
            assert r["split_sum"] == 5.0 and r["split_gather"] == [3, 0, 2]
        else:
            assert r["split"] is None
        members = [2, 0] if g % 2 == 0 else [3, 1]  # key = -rank: highest rank first
        assert r["color"][:3] == (members.index(g), 2, members), r["color"]
        assert r["color"][3].startswith("world.")
        assert r["color_sum"] == float(sum(10 ** m for m in members))
        if members.index(g) == 0:
            assert r["nested"] is None
        else:
            assert r["nested"][:3] == (0, 1, [g]) and r["nested_sum"] == float(g)
        assert r["world_sum"] == 4.0
