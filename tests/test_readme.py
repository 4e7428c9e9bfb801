"""Every ```python example in README.md runs (each in a fresh interpreter) and its asserts hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n{proc.stdout}\n{proc.stderr}"


def test_quick_start_has_exactly_two_commands() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", quick, re.S)[0]  # the first block is the two-command Quick start
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    assert "torchnext demo" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command"
