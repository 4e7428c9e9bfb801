"""The demo launcher: hosts the coordinator, starts the ranks, injects the failure, and writes the results.

``run_demo(DemoConfig(...)) -> dict`` (the summary) is what ``torchnext demo`` calls. The launcher never trains:
it hosts the coordinator (so no rank's death can take the store down), starts ``ranks`` processes running
:mod:`torchnext.demo.train`, reads their JSON-lines progress, kills (SIGKILL) or hangs (SIGSTOP) the chosen rank
when the job reaches the chosen step, optionally starts a replacement that heals from a survivor and joins, and
finally writes ``summary.json``, ``loss.png``, the Flight Recorder dumps (``fr/``) and the analyzer's report.
Every child process is killed and reaped on the way out, whatever happened.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["DemoConfig", "DemoError", "run_demo"]


class DemoError(RuntimeError):
    """The demo could not complete (a rank crashed unexpectedly, a timeout, the coordinator failed)."""


@dataclass(kw_only=True)
class DemoConfig:
    """What ``torchnext demo`` runs."""

    ranks: int = 4
    """Local ranks to launch."""
    steps: int = 200
    """Committed training steps."""
    precision: str = "nvfp4"
    """Weight precision: nvfp4, mxfp8, bf16, fp32."""
    kill_rank: int | None = 2
    """Rank (initial member id) to SIGKILL; None: no kill."""
    kill_step: int = 20
    """Committed step after which the failure is injected."""
    hang_rank: int | None = None
    """Rank to SIGSTOP instead (declared failed by missed heartbeats, then resumed to see it refused)."""
    rejoin: bool = False
    """Start a replacement after the failure; it heals from a survivor and joins."""
    batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 64
    """Characters per sequence."""
    seed: int = 0
    """Seed of the model and data."""
    out: str = "./torchnext-demo"
    """Output folder."""
    timeout_s: float = 600.0
    """Give up (DemoError) after this long."""
    lowp_backend: str = "eager"
    """torchnext.lowp.mm.scaled_mm backend for the block-scaled layers."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the rank processes."""


@dataclass
class _Rank:
    member: int
    proc: subprocess.Popen[str]
    log: IO[str]
    started: float
    state: str = "running"  # standby | running | killed | hung | removed | done | failed


class _Launcher:
    def __init__(self, cfg: DemoConfig, on_event: Callable[[dict[str, Any]], None]) -> None:
        self.cfg = cfg
        self.on_event = on_event
        self.out = Path(cfg.out)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.ranks: dict[int, _Rank] = {}
        self.losses: dict[int, float] = {}
        self.sizes: list[tuple[int, int]] = []  # (step, size) whenever the size changes
        self.failures: list[dict[str, Any]] = []
        self.reconfigs: list[dict[str, Any]] = []
        self.done: dict[int, dict[str, Any]] = {}

    # ---------------------------------------------------------------------------------------------- processes
    def spawn(self, member: int, coordinator: str, token: str, *, standby: bool = False) -> None:
        cfg = self.cfg
        env = dict(os.environ)
        env.update(cfg.extra_env)
        env.update({"TORCHNEXT_FT_COORDINATOR": coordinator, "TORCHNEXT_FT_TOKEN": token,
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-m", "torchnext.demo.train", "--steps", str(cfg.steps), "--precision", cfg.precision,
               "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len), "--seed", str(cfg.seed),
               "--out", str(self.out), "--member-id", str(member), "--lowp-backend", cfg.lowp_backend,
               "--min-size", "2" if cfg.ranks > 2 else "1", *(["--standby"] if standby else [])]
        log = open(self.out / "logs" / f"member_{member}.log", "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True,
                                stdin=subprocess.PIPE if standby else subprocess.DEVNULL)
        self.ranks[member] = _Rank(member, proc, log, time.monotonic(), state="standby" if standby else "running")
        threading.Thread(target=self._reader, args=(member, proc), daemon=True, name=f"demo-reader-{member}").start()

    def wake(self, member: int) -> None:
        """Tell a warm spare to join now."""
        r = self.ranks[member]
        assert r.proc.stdin is not None
        r.proc.stdin.write("join\n")
        r.proc.stdin.flush()
        r.state = "running"

    def _reader(self, member: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev["_member"] = member
            ev["_t"] = time.monotonic()
            self.events.put(ev)
        self.events.put({"event": "exit", "_member": member, "_t": time.monotonic(), "code": proc.wait()})

    def cleanup(self) -> None:
        for r in self.ranks.values():
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for r in self.ranks.values():
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                pass
            r.log.close()


def _log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_demo(cfg: DemoConfig, on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the demo end to end and return the summary (also written to ``<out>/summary.json``)."""
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig

    if cfg.ranks < 2:
        raise ValueError(f"the demo needs at least 2 ranks, got {cfg.ranks}")
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    target = cfg.kill_rank if cfg.kill_rank is not None else cfg.hang_rank
    if cfg.kill_rank is not None and cfg.hang_rank is not None:
        raise ValueError("choose either a kill or a hang (--kill-rank / --hang-rank), not both")
    if target is not None and not 0 <= target < cfg.ranks:
        raise ValueError(f"the rank to fail must be in [0, {cfg.ranks}), got {target}")
    if target is not None and not 0 < cfg.kill_step < cfg.steps:
        raise ValueError(f"the failure step must be in (0, {cfg.steps}), got {cfg.kill_step}")
    emit = on_event or (lambda ev: None)
    out = Path(cfg.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "fr").mkdir(parents=True, exist_ok=True)
    for old in (out / "fr").iterdir():
        old.unlink()
    t_start = time.monotonic()
    launcher = _Launcher(cfg, emit)
    coord = Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=cfg.ranks)))
    coord.start()
    fault_at: float | None = None
    fault_done = False
    error: BaseException | None = None
    try:
        for m in range(cfg.ranks):
            launcher.spawn(m, coord.address, coord.token)
        spare = cfg.ranks if cfg.rejoin else None
        if spare is not None:  # a warm spare: imports and model built now, joins when the failure happens
            launcher.spawn(spare, coord.address, coord.token, standby=True)
        emit({"event": "launched", "ranks": cfg.ranks, "coordinator": coord.address})
        deadline = t_start + cfg.timeout_s
        while True:
            live = [r for r in launcher.ranks.values() if r.state == "running"]
            if live and all(m in launcher.done for m in (r.member for r in live)):
                break
            if time.monotonic() > deadline:
                raise DemoError(f"the demo did not finish within {cfg.timeout_s:.0f} s")
            try:
                ev = launcher.events.get(timeout=0.2)
            except queue.Empty:
                continue
            kind, member = ev["event"], ev["_member"]
            if kind == "step":
                step = int(ev["step"])
                launcher.losses.setdefault(step, float(ev["loss"]))
                if not launcher.sizes or launcher.sizes[-1][1] != ev["size"]:
                    launcher.sizes.append((step, int(ev["size"])))
                if target is not None and not fault_done and step >= cfg.kill_step:
                    victim = launcher.ranks[target]
                    fault_at = time.monotonic()
                    if cfg.kill_rank is not None:
                        os.killpg(victim.proc.pid, signal.SIGKILL)
                        victim.state = "killed"
                    else:
                        os.killpg(victim.proc.pid, signal.SIGSTOP)
                        victim.state = "hung"
                    fault_done = True
                    if spare is not None:
                        launcher.wake(spare)
                        emit({"event": "rejoin_started", "member": spare})
                    emit({"event": "fault", "kind": "kill" if cfg.kill_rank is not None else "hang",
                          "rank": target, "step": step})
            elif kind == "reconfigured":
                launcher.reconfigs.append(ev)
                if cfg.hang_rank is not None:
                    victim = launcher.ranks[cfg.hang_rank]
                    if victim.state == "hung":  # removed: let it run again, it must be refused
                        os.killpg(victim.proc.pid, signal.SIGCONT)
                        victim.state = "removed"
            elif kind == "done":
                launcher.done[member] = ev
            elif kind == "exit":
                r = launcher.ranks[member]
                if r.state in ("running", "standby") and member not in launcher.done:
                    r.state = "failed"
                    raise DemoError(f"member {member} exited unexpectedly (code {ev['code']}); its log:\n"
                                    + _log_tail(out / "logs" / f"member_{member}.log"))
            emit(ev)
    except BaseException as exc:
        error = exc
        raise
    finally:
        history = coord.history()
        launcher.cleanup()
        coord.stop()
        summary = _summarize(cfg, launcher, history, fault_at, target, time.monotonic() - t_start, error)
    return summary


def _summarize(cfg: DemoConfig, launcher: _Launcher, history: list[dict[str, Any]], fault_at: float | None,
               target: int | None, wall: float, error: BaseException | None = None) -> dict[str, Any]:
    out = Path(cfg.out)
    failures: list[dict[str, Any]] = []
    if fault_at is not None and target is not None:
        detected = next((h for h in history if h["event"] == "failure" and h.get("member") == target), None)
        gen = next((h for h in history if h["event"] == "generation" and detected is not None
                    and h["at"] >= detected["at"]), None)
        built = [ev["timings"].get("built") for ev in launcher.reconfigs
                 if gen is not None and ev.get("generation") == gen["gen"] and ev["timings"].get("built")]
        failures.append({
            "kind": "kill" if cfg.kill_rank is not None else "hang",
            "rank": target,
            "step": cfg.kill_step,
            "detect_s": None if detected is None else round(detected["at"] - fault_at, 4),
            "agree_s": None if detected is None or gen is None else round(gen["at"] - detected["at"], 4),
            "rebuild_s": None if gen is None or not built else round(max(built) - gen["at"], 4),
        })
    digests = {m: d["digest"] for m, d in launcher.done.items()}
    losses = [launcher.losses[s] for s in sorted(launcher.losses)]
    summary = {
        "steps_completed": max(launcher.losses) if launcher.losses else 0,
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "world_size_history": [{"step": s, "size": n} for s, n in launcher.sizes],
        "failures": failures,
        "params_equal_across_ranks": len(set(digests.values())) == 1 and len(digests) >= 1,
        "final_members": sorted(digests),
        "precision": cfg.precision,
        "wall_s": round(wall, 2),
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "config": asdict(cfg),
    }
    (out / "coordinator_history.json").write_text(json.dumps(history, indent=1, default=str))
    (out / "loss.json").write_text(json.dumps({str(s): launcher.losses[s] for s in sorted(launcher.losses)}))
    summary["loss_plot"] = _plot_loss(out / "loss.png", launcher.losses, failures).name
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _plot_loss(path: Path, losses: dict[int, float], failures: list[dict[str, Any]]) -> Path:
    """Loss vs step with the failures marked: ``loss.png`` with matplotlib, else a dependency-free ``loss.svg``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = path.with_suffix(".svg")
        svg.write_text(_loss_svg(losses, failures))
        return svg
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    steps = sorted(losses)
    ax.plot(steps, [losses[s] for s in steps], color="#1f77b4", lw=1.8, label="loss (nats/char)")
    for f in failures:
        ax.axvline(f["step"], color="#d62728", ls="--", lw=1.2, label=f"{f['kind']} rank {f['rank']}")
    ax.set_xlabel("committed step")
    ax.set_ylabel("loss")
    ax.set_title("torchnext demo: fault-tolerant low-precision MoE training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _loss_svg(losses: dict[int, float], failures: list[dict[str, Any]], w: int = 700, h: int = 320) -> str:
    steps = sorted(losses)
    if not steps:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}"></svg>'
    x0, x1 = steps[0], max(steps[-1], steps[0] + 1)
    lo, hi = min(losses.values()), max(losses.values())
    hi = hi if hi > lo else lo + 1.0
    pad = 40

    def xy(s: float, v: float) -> str:
        return f"{pad + (s - x0) / (x1 - x0) * (w - 2 * pad):.1f},{h - pad - (v - lo) / (hi - lo) * (h - 2 * pad):.1f}"

    points = " ".join(xy(s, losses[s]) for s in steps)
    marks = "".join(
        f'<line x1="{xy(f["step"], lo).split(",")[0]}" y1="{pad}" x2="{xy(f["step"], lo).split(",")[0]}" '
        f'y2="{h - pad}" stroke="#d62728" stroke-dasharray="6,4"/>'
        f'<text x="{xy(f["step"], hi).split(",")[0]}" y="{pad - 6}" fill="#d62728" font-size="12">'
        f'{f["kind"]} rank {f["rank"]}</text>'
        for f in failures
    )
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">'
            f'<rect width="{w}" height="{h}" fill="white"/>'
            f'<text x="{pad}" y="18" font-size="14">torchnext demo: loss (nats/char) vs committed step, '
            f'{losses[steps[0]]:.2f} → {losses[steps[-1]]:.2f}</text>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>{marks}'
            f'<text x="{pad}" y="{h - 10}" font-size="12">step {x0}</text>'
            f'<text x="{w - pad - 60}" y="{h - 10}" font-size="12">step {x1}</text></svg>')
