"""`torchnext demo` flags: the fault grammar, the defaults, and clear errors for bad input (no process started)."""

from __future__ import annotations

import pytest

from torchnext.cli import main
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
    (["--fault", "kill:0@5", "--fault", "kill:2@9"], "take down every replica group"),
    (["--fault", "kill:2@5", "--fault", "hang:3@9"], "replica group 1 (ranks [2, 3]) already failed"),
    (["--shard-size", "0"], "--shard-size must be >= 1"),
    (["--parallel", "diloco", "--sync-every", "0"], "--sync-every must be >= 1"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--seq-len", "-4"], "--seq-len must be >= 1"),
    (["--fault", "coordinator@5", "--fault", "coordinator@9"], "at most one"),
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
    d.validate()
    ddp = DemoConfig(parallel="ddp", faults=(Fault(kind="kill", rank=0, step=3), Fault(kind="hang", rank=3, step=5)))
    ddp.validate()  # ddp: every rank its own group, two of four may fail
    assert (ddp.groups, ddp.group_size) == (4, 1)
    DemoConfig(rejoin=True, faults=(Fault(kind="kill", rank=2, step=5), Fault(kind="kill", rank=3, step=9))).validate()
