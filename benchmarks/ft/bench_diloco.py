"""Bytes sent per inner step: DiLoCo / LocalSGD (every H steps) vs FT-DDP (every step), same model, same run.

Each mode is a fresh job: an in-process :class:`~torchnext.ft.Coordinator` and ``--groups`` member processes (one
replica group each, :func:`torchnext.testing.run_ranks`) training an MLP of ``--width`` x ``--depth`` float32
``nn.Linear`` layers on random data for ``--steps`` inner steps:

* ``ddp``: :class:`torchnext.ft.DistributedDataParallel` (gradients all-reduced over the live groups every step,
  one fault-tolerant step per inner step);
* ``diloco H``: :class:`torchnext.ft.DiLoCo` with ``sync_every=H`` (one all-reduce of the pseudo-gradients, and one
  fault-tolerant step, per H inner steps).

Two measurements per process, counted from after the first generation formed (so the initial healing is not in
them) to the end: ``payload`` -- bytes handed to ``all_reduce`` on ft's communicator (a post hook: what the
algorithm asks to reduce), and ``written`` -- the process's ``wchar`` from ``/proc/self/io`` (every byte it wrote to
a socket or file: Gloo's ring traffic, heartbeats, store and commit messages). Medians over the processes.

    python benchmarks/ft/bench_diloco.py [--groups 2] [--steps 200] [--width 256] [--depth 4] [--sync-every 1,10,100]
        [--json out.json] [--plot docs/ft_diloco_bytes.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
from torch import nn

import torchnext
from torchnext.testing import RankContext, run_ranks


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _member(ctx: RankContext, addr: str, token: str, mode: str, h: int, steps: int, width: int,
            depth: int) -> dict[str, Any]:
    from torchnext.ft import DiLoCo, DiLoCoConfig, DistributedDataParallel, FaultTolerant, FaultTolerantConfig

    torch.set_num_threads(1)
    model = _model(width, depth)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    holder: list[Any] = []
    ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, member_id=ctx.rank),
                       state_dict=lambda: holder[0].state_dict(), load_state_dict=lambda s: holder[0].load_state_dict(s),
                       join=False)
    net: nn.Module = model
    if mode == "ddp":
        net = DistributedDataParallel(model, ft)
        holder.append(model)
        ft.join()
    else:
        holder.append(DiLoCo(ft, model, DiLoCoConfig(sync_every=h)))
        holder[0].join()
    payload = [0]

    def count(a: Any) -> None:
        if a.info.op == "all_reduce":
            payload[0] += sum(t.numel() * t.element_size() for t in a.info.inputs)

    ft.register_post_hook(count)  # this generation's communicator: no failure in this benchmark
    g = torch.Generator().manual_seed(ctx.rank)
    xs = [torch.randn(16, width, generator=g) for _ in range(8)]
    w0, t0 = _wchar(), time.perf_counter()
    for s in range(steps):
        if mode == "ddp":
            with ft.step() as st:
                net(xs[s % len(xs)]).square().mean().backward()
                if st.commit():
                    inner.step()
                inner.zero_grad()
        else:
            net(xs[s % len(xs)]).square().mean().backward()
            inner.step()
            inner.zero_grad()
            holder[0].step()
    seconds, written = time.perf_counter() - t0, _wchar() - w0
    commits = ft.step_count
    ft.finish()
    return {"payload": payload[0], "written": written, "seconds": seconds, "commits": commits,
            "params": sum(p.numel() for p in model.parameters())}


def _run(mode: str, h: int, args: argparse.Namespace) -> dict[str, Any]:
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig

    cfg = MembershipConfig(min_size=1, initial_size=args.groups)
    with Coordinator(CoordinatorConfig(membership=cfg)) as coord:
        res = run_ranks(_member, args.groups, timeout=600,
                        args=(coord.address, coord.token, mode, h, args.steps, args.width, args.depth))
    med = {k: statistics.median(r[k] for r in res) for k in ("payload", "written", "seconds")}
    return {"mode": mode if mode == "ddp" else f"diloco H={h}", "sync_every": 1 if mode == "ddp" else h,
            "commits": res[0]["commits"], "params": res[0]["params"],
            "payload_per_step": med["payload"] / args.steps, "written_per_step": med["written"] / args.steps,
            "ms_per_step": 1e3 * med["seconds"] / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--sync-every", default="1,10,100")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, torchnext {torchnext.__version__}, python {platform.python_version()}, "
          f"{platform.machine()} x{os.cpu_count()}, load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    rows = [_run("ddp", 1, args)] + [_run("diloco", int(h), args) for h in args.sync_every.split(",")]
    ddp = rows[0]
    print(f"model: {args.depth} x Linear({args.width}, {args.width}) float32 = {ddp['params']:,} parameters "
          f"({4 * ddp['params'] / 2**20:.2f} MiB); {args.groups} replica groups; {args.steps} inner steps")
    print(f"{'mode':<16}{'commits':>8}{'payload B/step':>16}{'written B/step':>16}{'vs DDP':>8}{'ms/step':>9}")
    for r in rows:
        r["written_vs_ddp"] = r["written_per_step"] / ddp["written_per_step"]
        print(f"{r['mode']:<16}{r['commits']:>8}{r['payload_per_step']:>16,.0f}{r['written_per_step']:>16,.0f}"
              f"{r['written_vs_ddp']:>8.3f}{r['ms_per_step']:>9.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        hs = [r["sync_every"] for r in rows[1:]]
        ax.plot(hs, [r["written_per_step"] for r in rows[1:]], "o-", label="DiLoCo: written")
        ax.plot(hs, [r["payload_per_step"] for r in rows[1:]], "s--", label="DiLoCo: all_reduce payload")
        ax.axhline(ddp["written_per_step"], color="C3", label="FT-DDP: written")
        ax.axhline(ddp["payload_per_step"], color="C3", ls="--", label="FT-DDP: all_reduce payload")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sync_every (H)")
        ax.set_ylabel("bytes per inner step, per process")
        ax.set_title(f"{ddp['params']:,} params, {args.groups} groups", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
