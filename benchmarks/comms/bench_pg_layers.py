"""Where the process-group path's per-op time goes: 4-byte all_reduce, layer by layer, same process, same run.

    python benchmarks/comms/bench_pg_layers.py [--ranks 1] [--rounds 30] [--ops 300] [--no-pin]
    python benchmarks/comms/bench_pg_layers.py --ranks 2 [--reps 3000]

Every case runs on **one** Gloo backend -- the ProcessGroupGloo behind our Communicator -- so the differences are
the layers' own costs (two Gloo instances in one process differ by where the kernel places their threads; see
``bench_process_group.py --peer aa``). Cases::

    raw backend          backend.allreduce([t], opts).wait()                  (C++ only)
    dist, torch group    dist.all_reduce(t, group=<torch's ProcessGroup over that backend>)
    dist, floor group    dist.all_reduce(t, group=<a 10-line Python ProcessGroup + Work over that backend>)
    comm sync, bare      Communicator.all_reduce(t), its hooks and Flight Recorder detached for the sample
    comm sync            Communicator.all_reduce(t)   (Flight Recorder + one pre and one post hook, as below)
    comm async           Communicator.all_reduce(t, async_op=True).wait()
    group                our group's allreduce([t]).wait()
    dist, torchnext      dist.all_reduce(t, group=<our group>)                 (the issue's measured path)
    python 0.66us+raw    a pure-Python loop (0.66 us on one pinned core here), then raw backend

``--ranks 1`` (default): one rank (no network), the process pinned to one CPU (``--no-pin``: not), ``--rounds``
rounds of ``--ops`` ops per case, cases interleaved; prints median main-thread CPU and wall per op and each
case's median per-round difference to ``dist, torch group``. ``--ranks 2``: two ranks, one sample = one op after
a barrier, cases interleaved ABBA; prints median latency per case and the difference to ``dist, torch group`` --
the ``python 0.66us+raw`` row shows what a microsecond of Python costs in latency on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import torchnext
from torchnext.testing import RankContext, run_ranks

_SHARED = "bench_layers_gloo"
_BASE = "dist, torch group"


def _burn() -> None:
    x = 0
    for i in range(40):
        x += i


def _cases(rank: int, size: int, store: dist.Store) -> tuple[dict[str, Callable[[], object]], Any]:
    dist.init_process_group("torchnext", store=store, rank=rank, world_size=size)
    ours = dist.group.WORLD
    assert isinstance(ours, torchnext.comms.TorchnextProcessGroup)
    comm = ours.communicator()
    comm.register_pre_hook(lambda info: None)
    comm.register_post_hook(lambda args: None)
    backend = comm.backend_handle.pg
    if _SHARED not in dist.Backend.backend_list:
        dist.Backend.register_backend(_SHARED, lambda store, rank, size, timeout: backend, devices=["cpu"])
    torch_group = dist.new_group(list(range(size)), backend=_SHARED)
    opts = dist.AllreduceOptions()

    class FloorWork(dist._Work):
        __slots__ = ("_bw",)

        def __init__(self, bw: Any) -> None:
            super().__init__()
            self._bw = bw

        def wait(self, timeout: timedelta = timedelta(0)) -> bool:
            return bool(self._bw.wait())

    class FloorGroup(dist.ProcessGroup):
        def allreduce(self, tensors: list[torch.Tensor], o: Any = None) -> FloorWork:  # type: ignore[override]
            return FloorWork(backend.allreduce(tensors, opts))

    floor = FloorGroup(rank, size)  # type: ignore[call-arg]
    pre, post = comm._pre_hooks, comm._post_hooks
    t = torch.ones(1)

    def bare() -> None:
        hooks = pre.snapshot, post.snapshot
        pre.snapshot = post.snapshot = ()
        try:
            comm.all_reduce(t)
        finally:
            pre.snapshot, post.snapshot = hooks

    def python_then_raw() -> None:
        _burn()
        backend.allreduce([t], opts).wait()

    cases: dict[str, Callable[[], object]] = {
        "raw backend": lambda: backend.allreduce([t], opts).wait(),
        _BASE: lambda: dist.all_reduce(t, group=torch_group),
        "dist, floor group": lambda: dist.all_reduce(t, group=floor),
        "comm sync, bare": bare,
        "comm sync": lambda: comm.all_reduce(t),
        "comm async": lambda: comm.all_reduce(t, async_op=True).wait(),  # type: ignore[union-attr]
        "group": lambda: ours.allreduce([t]).wait(),
        "dist, torchnext": lambda: dist.all_reduce(t, group=ours),
        "python 0.66us+raw": python_then_raw,
    }
    return cases, torch_group


def _one_rank(rounds: int, ops: int, pin: bool) -> None:
    if pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # before Gloo starts its threads
    cases, _ = _cases(0, 1, dist.HashStore())
    names = list(cases)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for fn in cases.values():
        for _ in range(200):
            fn()
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = cases[name]
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(ops):
                fn()
            wall[name].append((time.perf_counter() - w0) / ops * 1e6)
            cpu[name].append((time.thread_time() - c0) / ops * 1e6)
    print(f"one rank{', pinned to one CPU' if pin else ''}; {rounds} rounds x {ops} ops; median per op; "
          f"delta = median per-round difference to '{_BASE}'")
    print(f"{'case':22s} {'cpu us':>8s} {'delta':>7s} {'wall us':>8s} {'delta':>7s}")
    for name in names:
        dc = statistics.median(a - b for a, b in zip(cpu[name], cpu[_BASE], strict=True))
        dw = statistics.median(a - b for a, b in zip(wall[name], wall[_BASE], strict=True))
        print(f"{name:22s} {statistics.median(cpu[name]):8.1f} {dc:+7.1f} {statistics.median(wall[name]):8.1f} "
              f"{dw:+7.1f}")
    dist.destroy_process_group()


def _two_rank_main(ctx: RankContext, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cases, barrier_group = _cases(ctx.rank, ctx.world_size, ctx.store)
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            barrier_group.barrier().wait()
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {n: statistics.median(v) * 1e6 for n, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, choices=[1, 2], default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3000, help="samples per case with --ranks 2")
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    if args.ranks == 1:
        _one_rank(args.rounds, args.ops, not args.no_pin)
        return
    res = run_ranks(_two_rank_main, 2, args=(args.reps,), timeout=1800)[0]
    print(f"two ranks; {args.reps} samples per case (ABBA, one op after a barrier); rank 0's median latency")
    for name, us in res.items():
        print(f"{name:22s} {us:8.1f} us  {us - res[_BASE]:+7.1f}")


if __name__ == "__main__":
    main()
