"""torchnext.testing.netns: hosts reach each other over the lab network only as the faults allow, and everything
the lab creates is gone afterwards -- also when the test body fails, and after a run that was killed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from torchnext.testing.netns import NetLab, available, remove_leftovers

_OK, _WHY = available()
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")]

_SERVER = "import socket, sys; s = socket.create_server((sys.argv[1], 5555)); print('up', flush=True); [s.accept()[0].close() for _ in range(1000)]"
_CLIENT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 5555), timeout=0.5).close(); print('ok')\n"
           "except OSError as e:\n    print('fail', type(e).__name__)")


def _namespaces() -> list[str]:
    return [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                          text=True).stdout.splitlines() if line.split()]


def _reach(lab: NetLab, src: int, dst: int) -> bool:
    out = subprocess.run([*lab.prefix(src), sys.executable, "-c", _CLIENT, lab.address(dst)], capture_output=True,
                         text=True, timeout=30).stdout
    return out.strip() == "ok"


def test_faults_cut_exactly_the_links_asked_for() -> None:
    with NetLab(3) as lab:
        for h in range(3):
            p = lab.popen(h, [sys.executable, "-c", _SERVER, lab.address(h)], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "up"
        assert _reach(lab, 0, 1) and _reach(lab, 1, 2) and _reach(lab, 2, 0)
        lab.isolate([1])
        assert not _reach(lab, 0, 1) and not _reach(lab, 1, 2) and _reach(lab, 0, 2)
        lab.reconnect([1])
        time.sleep(0.1)
        assert _reach(lab, 0, 1)
        lab.partition([[0], [1, 2]])
        assert _reach(lab, 1, 2) and not _reach(lab, 0, 1) and not _reach(lab, 2, 0)
        lab.heal()
        time.sleep(0.1)
        assert _reach(lab, 0, 2) and _reach(lab, 1, 0)
        # a host has its lab address and loopback only, and no route off the lab network
        routes = subprocess.run(["ip", "-n", lab.netns(0), "route"], capture_output=True, text=True).stdout
        assert "default" not in routes and lab.address(0).rsplit(".", 1)[0] in routes, routes
        name = lab.name
    assert not [ns for ns in _namespaces() if ns.startswith(name)]


def test_everything_is_removed_when_the_body_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetLab(2) as lab:
        name = lab.name
        p = lab.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("boom")
    assert p.poll() is not None, "the lab's process was not reaped"
    assert not [ns for ns in _namespaces() if ns.startswith(name)]


def test_leftovers_of_a_dead_run_are_removed() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    name = f"torchnext-{dead}-abcdef-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in remove_leftovers()
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="hosts"):
        NetLab(0)
    with NetLab(2) as lab:
        with pytest.raises(ValueError, match="host must be"):
            lab.isolate([2])
        with pytest.raises(ValueError, match="two islands"):
            lab.partition([[0], [0, 1]])
