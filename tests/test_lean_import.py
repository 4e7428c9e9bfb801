"""`import torchnext` must not initialise CUDA, compile anything, or open sockets."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_is_lean() -> None:
    code = textwrap.dedent(
        """
        import socket, sys
        opened = []
        _orig = socket.socket.__init__
        def _init(self, *a, **k):
            opened.append(a)
            _orig(self, *a, **k)
        socket.socket.__init__ = _init
        import torch
        def _no_compile(*a, **k):
            raise SystemExit("torch.compile called during import")
        torch.compile = _no_compile
        import torchnext, torchnext.comms, torchnext.lowp, torchnext.control, torchnext.cli
        assert not torch.cuda.is_initialized(), "CUDA initialised"
        assert not opened, f"sockets opened: {opened}"
        assert "torch._inductor.compile_fx" not in sys.modules, "inductor imported"
        print("LEAN", torchnext.__version__)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LEAN" in proc.stdout


def test_the_comms_core_loads_none_of_its_extensions() -> None:
    """Importing ``torchnext.comms`` (or the Communicator's module) loads the core only; an extension name or a
    Communicator option that needs one imports it on first use (issue #25)."""
    code = textwrap.dedent(
        """
        import sys
        import torch.distributed as dist
        import torchnext.comms, torchnext.comms.communicator
        ext = ("flight_recorder", "window", "consistency", "process_group", "native")
        def loaded():
            return sorted(e for e in ext if f"torchnext.comms.{e}" in sys.modules)
        print("CORE", loaded())
        comm = torchnext.comms.Communicator(dist.HashStore(), 0, 1, flight_recorder=True)  # the option imports it
        print("OPTION", loaded(), type(comm.flight_recorder).__name__)
        comm.shutdown()
        print("NAME", torchnext.comms.Window.__name__, loaded(), "Window" in dir(torchnext.comms))
        try:
            torchnext.comms.NoSuchName
        except AttributeError as exc:
            print("MISSING", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["CORE"] == "[]"
    assert lines["OPTION"] == "['flight_recorder'] FlightRecorder"
    assert lines["NAME"] == "Window ['flight_recorder', 'window'] True"
    assert "NoSuchName" in lines["MISSING"]
