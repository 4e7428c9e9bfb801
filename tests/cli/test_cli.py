from __future__ import annotations

import subprocess
import sys

import pytest

import torchnext
from torchnext.cli import SUBCOMMANDS, Subcommand, main, register_subcommand


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert torchnext.__version__ in capsys.readouterr().out


def test_help_lists_every_subcommand() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchnext", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name in SUBCOMMANDS:
        assert name in proc.stdout


def test_duplicate_subcommand_rejected() -> None:
    assert SUBCOMMANDS, "the CLI registers built-in subcommands"
    name = next(iter(SUBCOMMANDS))
    with pytest.raises(ValueError, match="already registered"):
        register_subcommand(Subcommand(name=name, module="x", help="x"))
