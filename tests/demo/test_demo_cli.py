"""`torchnext demo` flags: the fault grammar, the defaults, and clear errors for bad input (no process started)."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import pytest

from torchnext.cli import main
from torchnext.demo.chaos import HEAD, MIN_GAP, TAIL, chaos_schedule, max_chaos, percentile
from torchnext.demo.launcher import DemoConfig, Fault


def test_fault_grammar() -> None:
    assert Fault.parse("kill:2@20") == Fault(kind="kill", rank=2, step=20)
    assert Fault.parse(" HANG : 1 @ 5 ") == Fault(kind="hang", rank=1, step=5)
    assert str(Fault.parse("hang:3@7")) == "hang:3@7"
    assert Fault.parse("coordinator@12") == Fault(kind="coordinator", rank=-1, step=12)
    assert Fault.parse("partition:3@9") == Fault(kind="partition", rank=3, step=9)
    assert str(Fault.parse(" Coordinator @ 4")) == "coordinator@4"


@pytest.mark.parametrize(("text", "message"), [
    ("kill", "expected KIND:RANK@STEP"),
    ("kill:2", "expected KIND:RANK@STEP"),
    ("kill:x@3", "expected KIND:RANK@STEP"),
    ("explode:2@20", "unknown kind 'explode'"),
    ("kill:-1@20", "rank -1 is negative"),
    ("kill:2@-3", "step -3 is negative"),
    ("coordinator:1@5", "a coordinator fault names no rank: coordinator@STEP"),
    ("coordinator@-2", "step -2 is negative"),
])
def test_bad_fault_strings_are_refused_by_the_parser(text: str, message: str, capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--fault", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--fault" in err and message in err, err


@pytest.mark.parametrize(("args", "message"), [
    (["--fault", "kill:4@20"], "rank 4 is out of range [0, 4)"),
    (["--fault", "kill:2@200"], "step 200 must be in (0, --steps 200)"),
    (["--fault", "kill:2@0"], "step 0 must be in (0, --steps 200)"),
    (["--ranks", "5"], "--ranks 5 is not divisible by --shard-size 2"),
    (["--ranks", "6", "--shard-size", "4"], "--ranks 6 is not divisible by --shard-size 4"),
    (["--ranks", "1"], "at least 2 ranks"),
    (["--no-fault", "--fault", "kill:1@3"], "--no-fault and --fault contradict"),
    (["--no-rejoin", "--fault", "kill:0@5", "--fault", "kill:2@9"], "take down every replica group"),
    (["--no-rejoin", "--fault", "kill:2@5", "--fault", "hang:3@9"], "replica group 1 (ranks [2, 3]) already failed"),
    (["--shard-size", "0"], "--shard-size must be >= 1"),
    (["--parallel", "diloco", "--sync-every", "0"], "--sync-every must be >= 1"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--seq-len", "-4"], "--seq-len must be >= 1"),
    (["--chaos", "-1"], "--chaos must be >= 0, got -1"),
    (["--chaos", "4", "--steps", "30"], "--steps 30 fits at most 3 faults"),
    (["--chaos", "1", "--steps", "12"], "--steps 12 fits at most 0 faults"),
    (["--chaos", "2", "--fault", "kill:1@3"], "--chaos 2 draws its own faults: drop --fault"),
    (["--chaos", "2", "--no-fault"], "--chaos 2 draws its own faults: drop --no-fault"),
    (["--chaos", "2", "--no-rejoin"], "--chaos 2 needs rejoin"),
    (["--fault", "coordinator@200"], "step 200 must be in (0, --steps 200)"),
    (["--fault", "partition:2@5", "--fault", "coordinator@9"], "cannot be combined"),
])
def test_bad_flag_combinations_are_clear_errors(args: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quiet", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "error" in err and message in err, err


def test_defaults_and_valid_combinations() -> None:
    d = DemoConfig()
    assert (d.parallel, d.ranks, d.shard_size, d.groups, d.group_size) == ("hsdp", 4, 2, 2, 2)
    assert list(d.faults) == [Fault(kind="kill", rank=2, step=20)]
    assert d.rejoin and d.chaos == 0  # the killed group comes back: the default run ends with 2 groups to compare
    d.validate()
    ddp = DemoConfig(parallel="ddp", faults=(Fault(kind="kill", rank=0, step=3), Fault(kind="hang", rank=3, step=5)))
    ddp.validate()  # ddp: every rank its own group, two of four may fail
    assert (ddp.groups, ddp.group_size) == (4, 1)
    DemoConfig(rejoin=True, faults=(Fault(kind="kill", rank=2, step=5), Fault(kind="kill", rank=3, step=9))).validate()
    # with rejoin every group may fail in turn (one at a time), and every coordinator fault has its own standby
    DemoConfig(faults=(Fault(kind="kill", rank=0, step=5), Fault(kind="kill", rank=2, step=9))).validate()
    DemoConfig(faults=(Fault(kind="coordinator", rank=-1, step=5), Fault(kind="coordinator", rank=-1, step=9))).validate()


def _parse(*argv: str) -> argparse.Namespace:
    from torchnext.demo.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rejoin_is_on_by_default_and_no_rejoin_turns_it_off() -> None:
    from torchnext.demo.cli import _config

    assert _parse().rejoin is True and _config(_parse()).rejoin is True
    assert _parse("--rejoin").rejoin is True  # still accepted
    assert _parse("--no-rejoin").rejoin is False and _config(_parse("--no-rejoin")).rejoin is False
    cfg = _config(_parse("--chaos", "3", "--steps", "40", "--seed", "7"))
    assert cfg.chaos == 3 and list(cfg.faults) == [] and len(cfg.schedule()) == 3


@pytest.mark.parametrize("partition", [False, True])
def test_chaos_schedule_is_seeded_spaced_and_survivable(partition: bool) -> None:
    kinds: set[str] = set()
    for seed in range(200):
        for n, steps in ((1, 20), (3, 40), (10, 200), (30, 200)):
            faults = chaos_schedule(n, steps=steps, ranks=4, seed=seed, partition=partition)
            assert faults == chaos_schedule(n, steps=steps, ranks=4, seed=seed, partition=partition)  # seeded
            assert len(faults) == n
            at = [f.step for f in faults]
            assert at == sorted(at) and HEAD <= at[0] and at[-1] < steps - TAIL, at
            assert all(b - a >= MIN_GAP for a, b in itertools.pairwise(at)), at  # never two at once
            got = {f.kind for f in faults}
            assert not {"partition", "coordinator"} <= got, faults  # the lab has no standby coordinator
            assert partition or "partition" not in got
            kinds |= got
            if "partition" not in got:  # (a partition's validation asks the system for network namespaces)
                DemoConfig(steps=steps, faults=faults).validate()
    assert kinds == ({"kill", "hang", "coordinator", "partition"} if partition else {"kill", "hang", "coordinator"})
    assert chaos_schedule(3, steps=40, ranks=4, seed=0) != chaos_schedule(3, steps=40, ranks=4, seed=1)
    assert chaos_schedule(0, steps=40, ranks=4, seed=0) == []
    assert max_chaos(40) == 4 and max_chaos(HEAD + TAIL + MIN_GAP - 1) == 0


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 99) == 4.0
    assert percentile([float(i) for i in range(1, 201)], 99) == 198.0


def _fake_summary(equal: bool | None, groups: int, survived: int = 1) -> dict[str, Any]:
    return {"failures": [], "initial_loss": 3.5, "final_loss": 1.0, "steps_completed": 30,
            "params_equal_across_ranks": equal, "replica_groups_compared": groups,
            "params_equal_reason": None if equal is not None else "only 1 replica group finished: nothing to compare",
            "wall_s": 1.0, "faults_scheduled": ["kill:2@10"], "faults_survived": {"kill": survived} if survived else {},
            "recovery_s": {"n": 0, "p50": None, "p99": None}, "resources": None}


@pytest.mark.parametrize(("equal", "groups", "survived", "rc"), [
    (None, 1, 1, 0),  # nothing compared: not a failure, the reason is printed
    (True, 2, 1, 0),
    (False, 2, 1, 1),  # compared and different
    (True, 2, 0, 1),  # a scheduled fault was not survived
])
def test_exit_code_follows_the_comparison(equal: bool | None, groups: int, survived: int, rc: int, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torchnext.demo.cli as cli
    import torchnext.demo.launcher as launcher

    monkeypatch.setattr(launcher, "run_demo", lambda cfg, on_event: _fake_summary(equal, groups, survived))
    monkeypatch.setattr(cli, "analyze_flight_recorder", lambda out: (0, tmp_path / "fr_timeline.png"))
    assert main(["demo", "--quiet", "--out", str(tmp_path)]) == rc
    out = " ".join(capsys.readouterr().out.split())
    if equal is None:
        assert "not compared: only 1 replica group finished: nothing to compare" in out, out
    else:
        assert f"{equal} (2 replica groups compared)" in out, out
