"""Streaming DiLoCo against fp32 DiLoCo at the same H, on the demo model, in one run (issue #28's goals).

Each mode is a fresh job: an in-process :class:`~torchnext.ft.Coordinator` and ``--groups`` member processes (one
replica group each, :func:`torchnext.testing.run_ranks`) training the demo's MoE transformer (fp32 weights) on the
demo's character data (group ``g`` reads shard ``g``) with AdamW inner steps for ``--steps`` inner steps:

* ``diloco``: :class:`torchnext.ft.DiLoCo`, ``sync_every=H``, fp32;
* ``streaming <dtype>``: :class:`torchnext.ft.StreamingDiLoCo`, ``sync_every=H``, ``--fragments`` fragments (the
  embeddings, each transformer block and the head are the blocks, strided), ``tau = --delay``, ``alpha = 0.5``.

Measured per process, medians over the processes:

* ``loss``: cross-entropy of the final global copy (every group adopts it after the last synchronization) on
  ``--eval-batches`` held-out batches -- the same batches for every mode;
* ``payload B/step``: bytes handed to the exchange collectives on ft's communicator (a pre hook on ``all_reduce``
  and ``all_gather_single``, at the issue) per inner step; ``wire B/step``: the bytes a ring algorithm sends per rank for them
  (all-reduce: ``2 (M - 1) / M`` x payload; all-gather: ``(M - 1)`` x payload); ``written B/step``: the process's
  ``wchar`` (``/proc/self/io``: every byte written to a socket or file -- Gloo's traffic, heartbeats, votes);
* ``peak B/sync``: the largest payload of one synchronization;
* ``step ms``: the inner step's compute (forward, backward, AdamW; ``step()`` excluded) while a fragment's exchange
  is in flight vs while none is, and the ``step()`` call itself at an issue and at a completion.

    python benchmarks/ft/bench_streaming_diloco.py [--groups 2] [--steps 96] [--sync-every 8] [--fragments 2]
        [--delay 2] [--dtypes fp32,mxfp4,nvfp4] [--json out.json]
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

import torchnext
from torchnext.testing import RankContext, run_ranks

_EXCHANGE = ("all_reduce", "all_gather_single")


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def _member(ctx: RankContext, addr: str, token: str, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    import torch.nn.functional as F

    from torchnext.demo.data import VOCAB, batch_for_step
    from torchnext.demo.model import ModelConfig, MoETransformerLM, Precision
    from torchnext.ft import (
        DiLoCo,
        DiLoCoConfig,
        FaultTolerant,
        FaultTolerantConfig,
        StreamingDiLoCo,
        StreamingDiLoCoConfig,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), precision=Precision("fp32")))
    inner = torch.optim.AdamW(model.parameters(), lr=args["lr"])
    holder: list[Any] = []
    ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, member_id=ctx.rank, timeout_s=120.0),
                       state_dict=lambda: holder[0].state_dict(), load_state_dict=lambda s: holder[0].load_state_dict(s),
                       join=False)
    h = args["sync_every"]
    if mode == "diloco":
        algo: Any = DiLoCo(ft, model, DiLoCoConfig(sync_every=h))
    else:
        cfg = StreamingDiLoCoConfig(sync_every=h, num_fragments=args["fragments"], fragment_sync_delay=args["delay"],
                                    fragment_update_alpha=0.5, outer_dtype=mode.split()[1])
        algo = StreamingDiLoCo(ft, model, cfg, blocks=[model.tok, model.pos, *model.blocks, model.ln_f, model.head])
    holder.append(algo)
    algo.join()
    payloads: list[int] = []

    def count(info: Any) -> None:
        if info.op in _EXCHANGE:
            payloads.append(sum(t.numel() * t.element_size() for t in info.inputs))

    ft.register_pre_hook(count)  # at the issue, on this generation's communicator: no failure in this benchmark
    streaming = mode != "diloco"
    busy, idle, issue_s, complete_s, per_sync = [], [], [], [], []
    w0 = _wchar()
    for n in range(1, args["steps"] + 1):
        x, y = batch_for_step(n, seed=1, shard=ctx.rank, num_shards=args["groups"], batch_size=8, seq_len=64)
        in_flight = streaming and algo.in_flight is not None
        t0 = time.perf_counter()
        F.cross_entropy(model(x).reshape(-1, len(VOCAB)), y.reshape(-1)).backward()
        inner.step()
        inner.zero_grad()
        t1 = time.perf_counter()
        before = len(payloads)
        rec = algo.step()
        t2 = time.perf_counter()
        (busy if in_flight else idle).append(t1 - t0)
        if streaming:
            if in_flight and rec is not None:
                complete_s.append(t2 - t1)
            elif algo.in_flight is not None:
                issue_s.append(t2 - t1)
        if len(payloads) > before:
            per_sync.append(sum(payloads[before:]))
    if streaming:
        algo.drain()
        with torch.no_grad():
            for p, g in zip(model.parameters(), algo.global_params, strict=True):
                p.copy_(g)
    written = _wchar() - w0
    commits = ft.step_count
    with torch.no_grad():
        losses = []
        for k in range(args["eval_batches"]):
            x, y = batch_for_step(10_000 + k, seed=7, shard=0, num_shards=1, batch_size=8, seq_len=64)
            losses.append(float(F.cross_entropy(model(x).reshape(-1, len(VOCAB)), y.reshape(-1))))
    ft.finish()
    return {"loss": statistics.mean(losses), "payload": sum(payloads), "peak": max(per_sync), "written": written,
            "commits": commits, "busy": busy, "idle": idle, "issue": issue_s, "complete": complete_s,
            "params": sum(p.numel() for p in model.parameters())}


def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig

    cfg = MembershipConfig(min_size=1, initial_size=args.groups, heartbeat_timeout_s=5.0)
    with Coordinator(CoordinatorConfig(membership=cfg)) as coord:
        res = run_ranks(_member, args.groups, timeout=1800, args=(coord.address, coord.token, mode, vars(args)))
    m = args.groups
    med = {k: statistics.median(r[k] for r in res) for k in ("loss", "payload", "peak", "written")}
    ring = (m - 1) if mode != "diloco" and not mode.endswith("fp32") else 2 * (m - 1) / m
    ms = {k: 1e3 * statistics.median(x for r in res for x in r[k]) if any(r[k] for r in res) else float("nan")
          for k in ("busy", "idle", "issue", "complete")}
    return {"mode": mode, "commits": res[0]["commits"], "params": res[0]["params"], "loss": med["loss"],
            "payload_per_step": med["payload"] / args.steps, "wire_per_step": ring * med["payload"] / args.steps,
            "written_per_step": med["written"] / args.steps, "peak_per_sync": med["peak"],
            **{f"{k}_ms": v for k, v in ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--delay", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--dtypes", default="fp32,mxfp4,nvfp4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, torchnext {torchnext.__version__}, python {platform.python_version()}, "
          f"{platform.machine()} x{os.cpu_count()}, load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    rows = [_run("diloco", args)] + [_run(f"streaming {d}", args) for d in args.dtypes.split(",")]
    base = rows[0]
    print(f"demo model (fp32) = {base['params']:,} parameters; {args.groups} replica groups; {args.steps} inner steps; "
          f"H={args.sync_every}; streaming: {args.fragments} fragments, tau={args.delay}, alpha=0.5")
    print(f"{'mode':<18}{'commits':>8}{'loss':>8}{'vs':>7}{'wire B/step':>13}{'vs':>7}{'written B/step':>16}{'vs':>7}"
          f"{'peak B/sync':>13}{'vs':>7}{'step ms idle':>14}{'in flight':>11}{'vs':>7}{'issue ms':>10}{'done ms':>9}")
    for r in rows:
        r["loss_vs"] = r["loss"] / base["loss"]
        r["wire_vs"] = r["wire_per_step"] / base["wire_per_step"]
        r["written_vs"] = r["written_per_step"] / base["written_per_step"]
        r["peak_vs"] = r["peak_per_sync"] / base["peak_per_sync"]
        r["busy_vs"] = r["busy_ms"] / r["idle_ms"]
        print(f"{r['mode']:<18}{r['commits']:>8}{r['loss']:>8.4f}{r['loss_vs']:>7.3f}{r['wire_per_step']:>13,.0f}"
              f"{r['wire_vs']:>7.3f}{r['written_per_step']:>16,.0f}{r['written_vs']:>7.3f}{r['peak_per_sync']:>13,.0f}"
              f"{r['peak_vs']:>7.3f}{r['idle_ms']:>14.1f}{r['busy_ms']:>11.1f}{r['busy_vs']:>7.3f}"
              f"{r['issue_ms']:>10.1f}{r['complete_ms']:>9.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
