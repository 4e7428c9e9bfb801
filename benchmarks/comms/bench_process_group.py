"""A torchnext process group vs a plain Gloo group: same processes, same run, ops interleaved ABBA.

Every rank initialises the default group with ``backend="torchnext"`` (Flight Recorder on, as by default, plus a
pre and a post hook of our own on its Communicator) and makes a plain torch group over the same ranks -- the peer.
``--peer`` chooses it:

* ``shared`` (default): torch's own ``ProcessGroup`` (dispatcher and all) over **the very ProcessGroupGloo our
  Communicator drives** (a torch backend whose creator returns it). Same sockets, same Gloo threads: the ratio is
  what our layers cost, nothing else.
* ``independent``: ``dist.new_group(backend="gloo")``, a second Gloo instance. Two Gloo instances in one process
  differ by where the kernel happens to place their threads on a small machine: measured with ``--peer aa`` (two
  independent Gloo groups against each other), 1 MiB all_reduces differ 0.3-2x and 16 MiB ones up to 11 % between
  identical groups -- larger than the 3 % this benchmark must resolve.
* ``aa``: two independent plain Gloo groups (no torchnext op at all): the noise floor of ``independent``.

Then, alternating the two groups sample by sample (A B B A ...):

* ``dist.all_reduce`` latency at 4 B and time at 1 MiB and 16 MiB (medians; ratio = gloo time / ours);
* a DDP training step (forward + backward + SGD) of MLPs with ~4 MiB and ~64 MiB of gradients;
* an FSDP2 training step (``fully_shard`` on a 1-D mesh made from each group: ``DeviceMesh.from_group``).

``--path`` chooses how the torchnext group runs its ops: ``python`` (default; the Python path, with the pre and post
hook above), ``python-nohooks`` (the Python path, no hook of ours: the Flight Recorder only) or ``native``
(``TORCHNEXT_NATIVE_PG=1``, no hook of ours, so the group stays on the native data path: torchnext.comms.native).

Goals (issue 14): DDP and FSDP2 steps >= 0.97x Gloo's throughput, collectives >= 1 MiB >= 0.97x, added latency at
4 B <= 10 us per op. Issue 25 (the native path): <= 3 us at 4 B on two ranks, >= 0.98x for the rest.

    python benchmarks/comms/bench_process_group.py [--world-size 2] [--reps 400] [--step-reps 15]
        [--peer shared|independent|aa] [--path python|python-nohooks|native] [--only collectives ddp fsdp]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torchnext
from torchnext.testing import RankContext, run_ranks


def _abba(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each of two callables, interleaved A B B A (noise hits both alike)."""
    (a, fa), (b, fb) = fns.items()
    for _ in range(warmup):
        fa()
        fb()
    times: dict[str, list[float]] = {a: [], b: []}
    for i in range(reps):
        order = ((a, fa), (b, fb)) if i % 2 == 0 else ((b, fb), (a, fa))
        for name, fn in order:
            dist.barrier()  # on the default group: both sides start each sample together
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _ddp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


_SHARED = "bench_shared_gloo"


def _shared_gloo_group(backend: Any, ranks: list[int]) -> dist.ProcessGroup:
    """torch's own ProcessGroup (bookkeeping, dispatcher, everything ``dist.new_group`` does) over ``backend``, an
    existing ProcessGroupGloo, through a torch backend whose creator hands it out."""
    if _SHARED not in dist.Backend.backend_list:
        dist.Backend.register_backend(_SHARED, lambda store, rank, size, timeout: backend, devices=["cpu"])
    group = dist.new_group(ranks, backend=_SHARED)
    assert group is not None
    return group


def _rank_main(ctx: RankContext, reps: int, step_reps: int, only: list[str], peer: str,
               path: str = "python") -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ["TORCHNEXT_NATIVE_PG"] = "1" if path == "native" else "0"
    dist.init_process_group("torchnext", store=ctx.store, rank=ctx.rank, world_size=ctx.world_size)
    ours = dist.group.WORLD
    assert isinstance(ours, torchnext.comms.TorchnextProcessGroup)
    comm = ours.communicator("cpu")
    if path == "python":
        comm.register_pre_hook(lambda info: None)
        comm.register_post_hook(lambda args: None)
    if path == "native" and not ours.native:
        raise RuntimeError("--path native: the group is not on the native path (see the warning above)")
    assert comm.flight_recorder is not None and comm.flight_recorder.enabled
    ranks = list(range(ctx.world_size))
    if peer == "shared":
        gloo = _shared_gloo_group(comm.backend_handle.pg, ranks)
    else:
        gloo = dist.new_group(ranks, backend="gloo")
    if peer == "aa":  # the noise floor: "torchnext" is a second, independent plain Gloo group
        ours = dist.new_group(ranks, backend="gloo")
    out: dict[str, Any] = {}

    for nbytes in (4, 1 << 20, 16 << 20) if "collectives" in only else ():
        x = torch.ones(max(1, nbytes // 4))
        n = reps if nbytes <= 4096 else max(9, reps // 20)
        out[f"all_reduce {nbytes}B"] = _abba({"gloo": lambda x=x: dist.all_reduce(x, group=gloo),
                                             "torchnext": lambda x=x: dist.all_reduce(x, group=ours)}, n)

    for label, width, depth in (("4MiB", 512, 4), ("64MiB", 2048, 4)) if "ddp" in only else ():
        steps = {}
        for name, group in (("gloo", gloo), ("torchnext", ours)):
            model = nn.parallel.DistributedDataParallel(_mlp(width, depth), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            steps[name] = _ddp_step(model, opt, torch.randn(8, width))
        out[f"DDP step {label}"] = _abba(steps, step_reps)

    steps = {}
    for name, group in (("gloo", gloo), ("torchnext", ours)) if "fsdp" in only else ():
        mesh = DeviceMesh.from_group(group, "cpu")
        model = _mlp(1024, 4)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        steps[name] = _ddp_step(model, opt, torch.randn(8, 1024))
    if steps:
        out["FSDP2 step 16MiB"] = _abba(steps, step_reps)
    out["recorded"] = len(comm.flight_recorder.entries())
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=400, help="samples per side for small all_reduces")
    parser.add_argument("--step-reps", type=int, default=15, help="samples per side for training steps")
    parser.add_argument("--only", nargs="+", choices=["collectives", "ddp", "fsdp"],
                        default=["collectives", "ddp", "fsdp"])
    parser.add_argument("--peer", choices=["shared", "independent", "aa"], default="shared",
                        help="the plain group: over our Communicator's own Gloo (default), a second Gloo instance, "
                             "or (aa) two plain Gloo groups against each other")
    parser.add_argument("--path", choices=["python", "python-nohooks", "native"], default="python",
                        help="the torchnext group's data path (see the module docstring)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, torchnext {torchnext.__version__}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, world size {args.world_size}, peer {args.peer}, path {args.path}",
          flush=True)
    results = run_ranks(_rank_main, args.world_size, args=(args.reps, args.step_reps, args.only, args.peer, args.path),
                        timeout=3600)
    rank0 = results[0]
    rows = []
    print(f"{'case':22s} {'gloo':>12s} {'torchnext':>12s} {'ratio':>7s} {'added':>10s}")
    for case, t in rank0.items():
        if not isinstance(t, dict):
            continue
        ratio = t["gloo"] / t["torchnext"]
        added_us = (t["torchnext"] - t["gloo"]) * 1e6
        rows.append({"case": case, "gloo_s": t["gloo"], "torchnext_s": t["torchnext"], "ratio": ratio,
                     "added_us": added_us})
        print(f"{case:22s} {t['gloo'] * 1e3:10.3f}ms {t['torchnext'] * 1e3:10.3f}ms {ratio:7.3f} {added_us:8.1f}us")
    print(f"(ratio = gloo time / torchnext time = our throughput relative to Gloo; "
          f"{rank0['recorded']} ops in rank 0's Flight Recorder ring)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg()[0], "peer": args.peer, "path": args.path, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
