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
