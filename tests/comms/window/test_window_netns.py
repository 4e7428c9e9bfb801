"""RMA windows between two hosts: two network namespaces of a NetLab, the window's TCP transport over the veth
addresses (not loopback), the Communicator's gloo bound to the interface that reaches the store.

Root and Linux network namespaces only (CI runs as root): skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchnext.testing.netns import NetLab, available

_OK, _WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")]

_RANK = textwrap.dedent('''
    import json, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from torchnext.comms import Communicator

    rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = dist.TCPStore(host, port, 2, rank == 0, timeout=timedelta(seconds=60))
    comm = Communicator(store, rank, 2, timeout=timedelta(seconds=30), name="netns-window")
    win = comm.new_window(torch.arange(8, dtype=torch.float32) + 100 * rank, transport="tcp")
    peer = 1 - rank
    got = win.get(peer).tolist()                      # the peer's initial memory, over TCP
    win.fence()
    win.put(torch.tensor([float(10 + rank)]), peer, rank)
    win.fence()
    mine = win.get(rank).tolist()                     # what the peer put into this rank's memory
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)                                # the Communicator itself, across the hosts
    print(json.dumps({"rank": rank, "transport": [win.transport(p).value for p in range(2)], "got": got,
                      "mine": mine, "sum": t.item()}), flush=True)
    win.close()
    comm.shutdown()
''')


def test_window_tcp_transport_between_two_hosts(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]),
                                                        os.environ.get("PYTHONPATH", "")])}
    with NetLab(2) as lab:
        host = lab.address(0)
        procs = [lab.popen(r, [sys.executable, str(script), str(r), host, "29611"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert not lab.leftovers()
    for o in outs:
        r, peer = o["rank"], 1 - o["rank"]
        assert o["transport"][peer] == "tcp", o
        assert o["got"] == [float(x + 100 * peer) for x in range(8)], o
        expect = [float(x + 100 * r) for x in range(8)]
        expect[peer] = float(10 + peer)
        assert o["mine"] == expect, o
        assert o["sum"] == 3.0
