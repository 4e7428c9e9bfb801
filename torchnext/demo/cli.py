"""``torchnext demo``: fault-tolerant low-precision MoE training on local ranks that survives a killed rank."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from torchnext.demo.launcher import DemoConfig
    from torchnext.demo.train import Parallel

    d = DemoConfig()
    parser.add_argument("--ranks", type=int, default=d.ranks,
                        help="local ranks to launch, all replica groups together (default %(default)s)")
    parser.add_argument("--parallel", choices=[p.value for p in Parallel], default=d.parallel,
                        help="hsdp: FSDP2 inside replica groups of --shard-size ranks, fault tolerance across them; "
                             "ddp: torch's DDP, every rank its own replica group; diloco: inner FSDP2 steps, outer "
                             "sync every --sync-every steps; streaming-diloco: the same by --fragments, each fragment's "
                             "exchange overlapped with the next inner step, outer gradients in --outer-dtype "
                             "(default %(default)s)")
    parser.add_argument("--shard-size", type=int, default=d.shard_size,
                        help="hsdp/diloco: ranks per replica group; --ranks must be a multiple (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="committed training steps (default %(default)s)")
    parser.add_argument("--precision", choices=["nvfp4", "mxfp8", "bf16", "fp32"], default=d.precision,
                        help="weight precision of experts and projections (default %(default)s)")
    parser.add_argument("--fault", action="append", type=_fault, default=None, metavar="KIND:RANK@STEP",
                        help="inject a failure after the job committed STEP steps: kill:RANK (SIGKILL) or hang:RANK "
                             "(SIGSTOP) or partition:RANK (its host cut off the network; needs root and network "
                             "namespaces), or coordinator@STEP (kill the coordinator: a standby takes over); "
                             "repeatable (default " + ", ".join(str(f) for f in d.faults) + ")")
    parser.add_argument("--no-fault", action="store_true", help="run without injecting a failure")
    parser.add_argument("--rejoin", action=argparse.BooleanOptionalAction, default=d.rejoin,
                        help="restart each failed replica group (warm standby processes): it heals shard by shard "
                             "from a live group and joins, so the run ends with every replica group and their shards "
                             "are compared; --no-rejoin: a failed group stays out (default: rejoin)")
    parser.add_argument("--chaos", type=int, default=d.chaos, metavar="N",
                        help="inject N random faults instead of --fault (kill, hang, coordinator; partition too as "
                             "root with network namespaces), seeded by --seed, spread over the steps one at a time, "
                             "each failed group restarted from warm spares; the summary adds the faults survived, "
                             "recovery p50/p99 and a survivor's thread/fd growth")
    parser.add_argument("--sync-every", type=int, default=d.sync_every,
                        help="diloco: inner steps between outer synchronizations; streaming-diloco: between two of "
                             "one fragment (default %(default)s)")
    parser.add_argument("--fragments", type=int, default=d.fragments,
                        help="streaming-diloco: fragments, --sync-every / --fragments steps apart (default %(default)s)")
    parser.add_argument("--outer-dtype", choices=["fp32", "bf16", "mxfp8", "mxfp4", "nvfp4"], default=d.outer_dtype,
                        help="streaming-diloco: wire format of the outer gradients, reduced in fp32 "
                             "(default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="characters per sequence")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the model, the data and the --chaos schedule (default %(default)s)")
    parser.add_argument("--out", default=d.out, help="output folder (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="give up after this many seconds")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, only the final summary")


def _fault(text: str) -> Any:
    from torchnext.demo.launcher import Fault

    try:
        return Fault.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config(args: argparse.Namespace) -> Any:
    """The DemoConfig of ``args``, validated.

    Raises:
        ValueError: a flag combination that cannot run (the message names the flag and value).
    """
    from torchnext.demo.launcher import DemoConfig

    if args.no_fault and args.fault:
        raise ValueError("--no-fault and --fault contradict each other: choose one")
    if args.chaos and (args.fault or args.no_fault):
        raise ValueError(f"--chaos {args.chaos} draws its own faults: drop {'--fault' if args.fault else '--no-fault'}")
    kw: dict[str, Any] = {}
    if args.no_fault or args.chaos:
        kw["faults"] = ()
    elif args.fault:
        kw["faults"] = tuple(args.fault)
    cfg = DemoConfig(ranks=args.ranks, steps=args.steps, precision=args.precision, parallel=args.parallel,
                     shard_size=args.shard_size, rejoin=args.rejoin, batch_size=args.batch_size,
                     seq_len=args.seq_len, seed=args.seed, sync_every=args.sync_every, out=args.out, chaos=args.chaos,
                     fragments=args.fragments, outer_dtype=args.outer_dtype,
                     timeout_s=args.timeout, **kw)
    cfg.validate()
    return cfg


def analyze_flight_recorder(out: Path) -> tuple[int, Path]:
    """Run ``torchnext fr analyze`` on ``out/fr``: report to ``fr_report.txt``, timeline to ``fr_timeline.png``
    (``fr_timeline.html`` when matplotlib is not installed). Returns (exit code, timeline path)."""
    import importlib.util

    has_mpl = importlib.util.find_spec("matplotlib") is not None
    timeline = out / ("fr_timeline.png" if has_mpl else "fr_timeline.html")
    cmd = [sys.executable, "-m", "torchnext", "fr", "analyze", str(out / "fr"), "--timeline", str(timeline)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**_env(), "COLUMNS": "120"})
    (out / "fr_report.txt").write_text(proc.stdout + (("\n" + proc.stderr) if proc.stderr else ""))
    return proc.returncode, timeline


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from torchnext.demo.launcher import DemoError, run_demo

    console = Console(stderr=False, highlight=False)
    try:
        cfg = _config(args)
        if cfg.parallel in ("diloco", "streaming-diloco"):
            from torchnext.demo.train import _require_diloco

            _require_diloco()
    except ValueError as exc:
        Console(stderr=True, highlight=False).print(f"[red]torchnext demo: error:[/] {escape(str(exc))}")
        return 2
    fault = ", ".join(str(f) for f in cfg.schedule()) or "none"
    if cfg.chaos:
        fault = f"chaos {cfg.chaos} (seed {cfg.seed}): {fault}"
    layout = (f"{cfg.groups} replica groups of {cfg.group_size} ranks" if cfg.parallel != "ddp"
              else f"{cfg.groups} replica groups of 1 rank")
    console.print(f"[bold]torchnext demo[/]: {cfg.parallel}, {cfg.ranks} ranks ({layout}), {cfg.steps} steps, "
                  f"precision {cfg.precision}, faults: {fault}{', rejoin' if cfg.rejoin else ''} → {cfg.out}")
    progress = Progress(TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}  groups {task.fields[size]}  gen {task.fields[gen]}  "
                                   "{task.fields[tps]} tok/s"),
                        TimeElapsedColumn(), console=console, disable=args.quiet)
    task = progress.add_task("train", total=cfg.steps, loss="-", size=cfg.groups, gen=0, tps="-")
    seen_reconfig: set[int] = set()
    failed_steps: set[int] = set()

    def on_event(ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "step":
            progress.update(task, completed=ev["step"], loss=f"{ev['loss']:.3f}", size=ev["size"],
                            gen=ev["generation"], tps=f"{ev['tokens_per_s']:.0f}")
        elif kind == "fault" and ev["kind"] == "coordinator":
            progress.console.print(f"[red]✗ injected: the coordinator killed after step {ev['step']}; "
                                   "the standby takes over[/]")
        elif kind == "fault":
            progress.console.print(f"[red]✗ injected: {ev['kind']} rank {ev['rank']} (member {ev['member']}, "
                                   f"replica group {ev['group']}) after step {ev['step']}[/]")
        elif kind == "step_failed" and ev["step"] not in failed_steps:
            failed_steps.add(ev["step"])
            progress.console.print(f"[yellow]! step {ev['step']} failed on member {ev['member']}: "
                                   f"{escape(ev['error'])}[/]")
        elif kind == "reconfigured":
            if ev["generation"] not in seen_reconfig:
                seen_reconfig.add(ev["generation"])
                t = ev.get("timings", {})
                rebuild = (t["built"] - t["start"]) * 1e3 if "built" in t and "start" in t else float("nan")
                progress.console.print(f"[green]✓ generation {ev['generation']}: replica groups {ev.get('groups')} "
                                       f"({escape(str(ev['reason']))}), rebuilt in {rebuild:.1f} ms[/]")
        elif kind == "joined" and ev.get("healed") and ev["step"] > 0:
            h = ev["healed"]
            progress.console.print(f"[green]✓ member {ev['member']} joined generation {ev['generation']} at step "
                                   f"{ev['step']}, healed from a survivor: {h['bytes'] / 2**20:.2f} MiB, "
                                   f"{h['tensors']} tensors in {h['seconds'] * 1e3:.0f} ms[/]")
        elif kind == "removed":
            progress.console.print(f"[yellow]- member {ev['member']} left with its replica group "
                                   f"{ev.get('group')}: {escape(str(ev['error']))}[/]")
        elif kind == "rejoin_started":
            progress.console.print(f"[cyan]→ replica group {ev['group']} restarting: members {ev['members']}[/]")

    try:
        with progress:
            summary = run_demo(cfg, on_event)
    except DemoError as exc:
        console.print(f"[red]demo failed:[/] {escape(str(exc))}")
        return 1
    out = Path(cfg.out)
    rc, timeline = analyze_flight_recorder(out)
    for f in summary["failures"]:
        if f["kind"] == "coordinator":
            console.print(f"failure: coordinator killed at step {f['step']}: standby in office after "
                          f"{f['takeover_s']} s, next committed step after {f['next_commit_s']} s")
            continue
        if f["kind"] == "partition":
            console.print(f"failure: rank {f['rank']}'s host cut off at step {f['step']} (replica group {f['group']}): "
                          f"the survivors' generation without it after {f['removed_s']} s")
            continue
        console.print(f"failure: {f['kind']} rank {f['rank']} (replica group {f['group']}) at step {f['step']}: "
                      f"detect {f['detect_s']} s, "
                      f"agree {f['agree_s']} s, rebuild {f['rebuild_s']} s")
    equal = summary["params_equal_across_ranks"]
    verdict = (f"not compared: {summary['params_equal_reason']}" if equal is None
               else f"{equal} ({summary['replica_groups_compared']} replica groups compared)")
    console.print(f"loss {summary['initial_loss']:.3f} → {summary['final_loss']:.3f} over "
                  f"{summary['steps_completed']} steps; every shard equals its counterparts in the other replica groups: "
                  f"{verdict}; wall {summary['wall_s']} s")
    missed = _missed_faults(summary)
    if cfg.chaos or len(summary["failures"]) > 1:
        survived = ", ".join(f"{k} {n}" for k, n in sorted(summary["faults_survived"].items())) or "none"
        rec, res = summary["recovery_s"], summary["resources"]
        growth = ("n/a" if res is None else f"member {res['member']} from step {res['from_step']} to "
                  f"{res['to_step']}: threads {res['threads'][0]} → {res['threads'][1]}, "
                  f"fds {res['fds'][0]} → {res['fds'][1]}")
        console.print(f"faults survived {sum(summary['faults_survived'].values())} of "
                      f"{len(summary['faults_scheduled'])} ({survived}); recovery (detect+agree+rebuild; coordinator: "
                      f"next commit) p50 {rec['p50']} s, p99 {rec['p99']} s over {rec['n']}; resources: {growth}")
    if missed:
        console.print(f"[red]faults not survived: {missed}[/]")
    plot = "loss.png" if (out / "loss.png").exists() else "loss.svg"
    console.print(f"wrote {out}/summary.json, {plot}, fr/, fr_report.txt (analyzer exit {rc}), {timeline.name}")
    if not args.quiet:
        console.print_json(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    # exit 1 when a comparison was made and failed, or a scheduled fault was not injected and survived; no
    # comparison (fewer than two groups finished) is not a failure: the reason was printed
    return 1 if equal is False or missed else 0


def _missed_faults(summary: dict[str, Any]) -> int:
    """Scheduled faults that were not injected, or after which the job was not whole again."""
    return len(summary["faults_scheduled"]) - sum(summary["faults_survived"].values())
