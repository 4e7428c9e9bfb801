"""``torchnext run`` and torchrun's restarts: every attempt of a one-node job rendezvous under its own store prefix
(``torchnext-run-<TORCHELASTIC_RESTART_COUNT>/``), so a restarted worker never reads the keys of the attempt before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchnext.comms.process_group.launch import restart_prefix

_SCRIPT = """\
import datetime, os, sys, time
import torch, torch.distributed as dist
restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if restart == 1 and rank == 0:
    time.sleep(3)  # rank 1 of the new attempt reaches the rendezvous first, beside the dead attempt's keys
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
store = dist.distributed_c10d._get_default_store()
stale = store.check(["attempt-marker"])  # written by rank 0 of an earlier attempt, if this one can see its keys
dist.barrier()
if rank == 0:
    store.set("attempt-marker", str(restart))
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
with open(os.path.join(sys.argv[1], f"attempt{restart}-rank{rank}.txt"), "w") as f:
    f.write(f"SUM {t.item()} STALE {stale} GROUP {type(dist.group.WORLD).__name__}")
dist.barrier()
if restart == 0:
    if rank == 1:
        os._exit(3)  # the first attempt dies: torchrun stops the other worker and starts both again
    time.sleep(60)
dist.destroy_process_group()
"""


def test_restart_prefix_names_the_attempt_on_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHELASTIC_RESTART_COUNT", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert restart_prefix() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_prefix() == "torchnext-run-2/"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert restart_prefix() == "torchnext-run-2/"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # several agents count restarts each on their own
    assert restart_prefix() is None


@pytest.mark.slow
def test_a_restarted_attempt_never_reads_the_keys_of_the_one_before(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHNEXT_", "MASTER_", "RANK", "WORLD_", "TORCHELASTIC_", "GROUP_"))}
    proc = subprocess.run([sys.executable, "-m", "torchnext", "run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", "--monitor-interval", "0.5", str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(2):  # both attempts ran on torchnext groups; the second one saw none of the first one's keys
        assert (tmp_path / f"attempt0-rank{r}.txt").read_text().startswith("SUM 3.0 STALE "), out[-4000:]
        assert (tmp_path / f"attempt1-rank{r}.txt").read_text() == "SUM 3.0 STALE False GROUP TorchnextProcessGroup"
