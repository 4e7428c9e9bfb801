"""torchft 0.2.0's DDP through the measurements of ``bench_parallel.py`` (its peer, run in the same benchmark run).

Run with the python of a virtual environment that has torchft and shares this machine's torch (``bench_parallel.py
--only torchft`` does it and prints the tables); it writes one JSON file. Uses torchft's public API only:
``torchft.Manager`` + ``torchft.ProcessGroupGloo`` + ``torchft.ddp.DistributedDataParallel`` + ``OptimizerWrapper``
semantics (``start_quorum`` at the top of the step, ``should_commit`` before the optimizer step), one replica per
process, its lighthouse (``torchft.coordination.LighthouseServer``) in this process, every setting at torchft's
defaults.

* overhead: torch's DDP on a plain Gloo default group vs torchft's DDP, same processes, the same model, inputs,
  simulated compute and palindromic blocks as ``bench_parallel.py``.
* recovery: one replica SIGKILLs itself inside backward (a parameter's gradient hook, drawn at random) -> every
  survivor committed a step in a smaller quorum; then a replacement replica is started and heals. A survivor whose
  backward raised (torchft's comm hook asserts when an all-reduce failed; torch's DDP reducer is then broken for
  good: every later backward fails ``!unmarked_param_indices.empty() INTERNAL ASSERT``) exits and is restarted, as
  one that crashed outright; such trials are counted, and have no "every survivor committed" time. ``whole``: fault
  -> every replica (survivors, restarts and the replacement) committed a step in a quorum of ``--ranks`` again.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload as W


def _manager(p: dict[str, Any], replica: str, model: torch.nn.Module, opt: Any) -> Any:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # this replica group's store
    return Manager(pg=ProcessGroupGloo(), min_replica_size=1,
                   load_state_dict=lambda s: (model.load_state_dict(s["m"]), opt.load_state_dict(s["o"])),
                   state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
                   replica_id=replica, store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                   lighthouse_addr=p["lighthouse"]), store


def _ft_step(manager: Any, ddp: Any, opt: Any, replica: int, ms: float, kind: str, commit_s: list[float],
             raised: list[str] | None = None) -> bool:
    """One torchft step as its OptimizerWrapper runs it: quorum, compute, forward/backward, should_commit, step.
    With ``raised``: an exception out of forward/backward (torchft 0.2.0's DDP comm hook raises ``AssertionError``
    out of backward when an all-reduce failed) is reported to the manager, the step is not committed, and the
    exception is recorded for the caller."""
    manager.start_quorum()
    opt.zero_grad()
    W.compute(ms, kind)
    try:
        ddp(W.batch(manager.current_step(), replica)).square().mean().backward()
    except Exception as exc:
        if raised is None:
            raise
        raised.append(f"{type(exc).__name__}: {str(exc)[:80]}")
        manager.report_error(exc)
    t = time.perf_counter()
    ok = bool(manager.should_commit())
    commit_s.append(time.perf_counter() - t)
    if ok:
        opt.step()
    return ok


def _overhead_replica(rank: int, p: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torchft.ddp import DistributedDataParallel

    torch.set_num_threads(1)
    n = p["ranks"]
    shared = dist.TCPStore("127.0.0.1", p["store_port"], None, False)
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", shared), rank=rank, world_size=n)
    models = {"plain": W.model(p["hidden"]), "torchft": W.model(p["hidden"])}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    manager, _store = _manager(p, f"replica{rank}", models["torchft"], opts["torchft"])
    plain = TorchDDP(models["plain"], bucket_cap_mb=p["bucket_mb"])
    ftddp = DistributedDataParallel(manager, models["torchft"], bucket_cap_mb=p["bucket_mb"])
    commit_s: list[float] = []
    # until every replica is in the quorum (a replica that starts late joins by healing)
    for _ in range(1000):
        _ft_step(manager, ftddp, opts["torchft"], rank, 0, "sleep", commit_s)
        if manager.num_participants() == n:
            break
    commit_s.clear()
    step_no = [0]

    def plain_step(ms: float) -> None:
        W.compute(ms, p["compute_kind"])
        plain(W.batch(step_no[0], rank)).square().mean().backward()
        opts["plain"].step()
        opts["plain"].zero_grad()
        step_no[0] += 1

    def ft_step(ms: float) -> None:
        _ft_step(manager, ftddp, opts["torchft"], rank, ms, p["compute_kind"], commit_s)

    out: dict[str, dict[str, list[float]]] = {}
    rounds = 1 + max(1, p["steps"] // p["block"])
    steps = {"plain": plain_step, "torchft": ft_step}
    for ms in p["compute_ms"]:
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i, name in enumerate(W.palindrome(list(steps), rounds)):
            for _ in range(p["block"]):
                t0 = time.perf_counter()
                steps[name](ms)
                if i >= len(steps):
                    times[name].append(time.perf_counter() - t0)
        out[str(ms)] = times
    manager.shutdown(wait=False)
    return {"times": out, "commit_s": commit_s}


def _recovery_replica(rank: int, p: dict[str, Any]) -> dict[str, Any]:
    from torchft.ddp import DistributedDataParallel

    torch.set_num_threads(1)
    model = W.model(p["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    manager, _store = _manager(p, f"replica{rank}", model, opt)
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=p["bucket_mb"])
    params = list(model.parameters())
    kill_at = [-1]
    rng = random.Random(rank)
    signal.signal(signal.SIGUSR2, lambda *_: kill_at.__setitem__(0, rng.randrange(len(params))))

    def hook(i: int) -> Any:
        def fire(g: torch.Tensor) -> torch.Tensor:
            if kill_at[0] == i:
                _log(p["fault_log"], {"replica": rank, "t": time.monotonic()})
                os.kill(os.getpid(), signal.SIGKILL)
            return g
        return fire

    for i, prm in enumerate(params):
        prm.register_hook(hook(i))
    commit_s: list[float] = []
    raised: list[str] = []
    while not os.path.exists(p["stop_file"]):
        ok = _ft_step(manager, ddp, opt, rank, p["recovery_compute_ms"], "sleep", commit_s, raised)
        if raised:
            # torchft 0.2.0's comm hook raised out of backward: torch's DDP reducer is then left mid-reduction and
            # every later backward fails its INTERNAL ASSERT (measured), so this replica can only be restarted
            _log(p["event_log"], {"replica": rank, "t": time.monotonic(), "raised": raised.pop()})
            manager.shutdown(wait=False)
            os._exit(3)
        if ok:
            _log(p["event_log"], {"replica": rank, "t": time.monotonic(), "step": manager.current_step(),
                                  "n": manager.num_participants()})
    manager.shutdown(wait=False)
    return {"replica": rank}


def _log(path: str, rec: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _child(fn: Any, rank: int, p: dict[str, Any], results: Any) -> None:
    try:
        out = (rank, True, fn(rank, p))
    except BaseException:
        out = (rank, False, traceback.format_exc())
    results.put(out)
    results.close()
    results.join_thread()
    os._exit(0)


class _Job:
    def __init__(self) -> None:
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "torch.distributed", "torchft"])
        self.results = self.ctx.Queue()
        self.procs: dict[int, Any] = {}

    def launch(self, fn: Any, rank: int, p: dict[str, Any]) -> None:
        proc = self.ctx.Process(target=_child, args=(fn, rank, p, self.results), daemon=True)
        proc.start()
        self.procs[rank] = proc

    def collect(self, ranks: list[int], timeout: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while set(ranks) - set(got) and time.monotonic() < deadline:
            try:
                rank, ok, value = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            if not ok:
                raise RuntimeError(f"torchft replica {rank} failed:\n{value}")
            got[rank] = value
        if set(ranks) - set(got):
            raise TimeoutError(f"torchft replicas {sorted(set(ranks) - set(got))} did not finish in {timeout} s")
        return got

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


def _events(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def recovery(p: dict[str, Any], trials: int, job: _Job) -> dict[str, Any]:
    n = p["ranks"]
    tmp = tempfile.mkdtemp(prefix="torchft-rec-")
    p = {**p, "fault_log": os.path.join(tmp, "faults"), "event_log": os.path.join(tmp, "events"),
         "stop_file": os.path.join(tmp, "stop")}
    live = list(range(n))
    for r in live:
        job.launch(_recovery_replica, r, p)
    next_rank = n
    totals: list[float] = []
    wholes: list[float] = []
    survivor_failures = 0
    notes: list[str] = []

    def all_in(after: float, ranks: list[int], size: int | None, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            first: dict[int, float] = {}
            for ev in _events(p["event_log"]):
                if "raised" in ev:
                    continue
                if ev["replica"] in ranks and ev["t"] > after and (size is None or ev["n"] == size):
                    first.setdefault(ev["replica"], ev["t"])
            if len(first) == len(ranks):
                return max(first.values())
            dead = [r for r in ranks if not job.procs[r].is_alive()]
            if dead:
                raise ChildProcessError(f"replicas {dead} exited")
            time.sleep(0.05)
        return None

    if all_in(0.0, live, n, p["trial_timeout"]) is None:
        raise RuntimeError("torchft: the replicas did not form a quorum of all")
    crashed_trials = 0
    raised_trials = 0
    raised_what: set[str] = set()
    for trial in range(trials):
        time.sleep(random.Random(trial).uniform(0.02, 0.1))
        victim = live[random.Random(1000 + trial).randrange(len(live))]
        os.kill(job.procs[victim].pid, signal.SIGUSR2)
        job.procs[victim].join(timeout=30)
        t_fault = next((e["t"] for e in _events(p["fault_log"]) if e["replica"] == victim), None)
        live.remove(victim)
        survivors = list(live)
        if t_fault is None:
            notes.append(f"trial {trial}: the victim did not record its kill")
            continue
        crashed: list[str] = []
        try:
            done = all_in(t_fault, live, None, p["trial_timeout"])
            if done is None:
                notes.append(f"trial {trial}: no commit by every survivor within {p['trial_timeout']} s")
            else:
                totals.append(done - t_fault)
        except ChildProcessError:
            pass
        for _attempt in range(3):  # make the job whole again: replacements, and restarts of crashed survivors
            for r in [r for r in live if not job.procs[r].is_alive()]:
                job.procs[r].join(timeout=5)
                crashed.append(f"replica {r} exit code {job.procs[r].exitcode}")
                live.remove(r)
            while len(live) < n:
                job.launch(_recovery_replica, next_rank, p)
                live.append(next_rank)
                next_rank += 1
            try:
                whole = all_in(time.monotonic(), live, n, p["trial_timeout"])
                if whole is not None:
                    wholes.append(whole - t_fault)
                    break
            except ChildProcessError:
                continue
        else:
            notes.append(f"trial {trial}: the job did not become whole again; stopping")
            break
        raisers = {e["replica"]: e["raised"] for e in _events(p["event_log"])
                   if "raised" in e and e["t"] > t_fault and e["replica"] in survivors}
        if raisers:
            raised_trials += 1
            raised_what.update(x.split(":")[0] for x in raisers.values())
        while True:  # why they died: the tracebacks their processes reported
            try:
                rank, ok, value = job.results.get(timeout=0.2)
            except queue.Empty:
                break
            if not ok:
                lines = str(value).strip().splitlines()
                why = " | ".join(x.strip() for x in lines[-4:])[:300]
                crashed = [c + f" ({why})" if c.startswith(f"replica {rank} ") else c for c in crashed]
        if crashed:
            crashed_trials += 1
            survivor_failures += len(crashed)
            notes.append(f"trial {trial}: survivors died: {', '.join(crashed)}")
    with open(p["stop_file"], "w") as fh:
        fh.write("stop")
    ms = [x * 1e3 for x in totals]
    whole_ms = [x * 1e3 for x in wholes]
    return {"whole_p50_ms": W.pct(whole_ms, 50), "whole_max_ms": max(whole_ms, default=float("nan")),
            "whole_ms": whole_ms, "trials": trials, "n": len(ms), "p50_ms": W.pct(ms, 50), "p99_ms": W.pct(ms, 99),
            "max_ms": max(ms, default=float("nan")), "totals_ms": ms, "survivor_failures": survivor_failures,
            "trials_with_survivor_deaths": crashed_trials, "trials_where_backward_raised": raised_trials,
            "raised": sorted(raised_what),
            "note": "; ".join(notes)}


def _terminate(*_: Any) -> None:
    raise SystemExit(143)  # run the finally blocks: replicas and the lighthouse are shut down


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--compute-kind", default="sleep")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--recovery-compute-ms", type=float, default=5.0)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--trial-timeout", type=float, default=90.0)
    ap.add_argument("--only", nargs="+", choices=["overhead", "recovery"], default=["overhead", "recovery"])
    args = ap.parse_args()
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    p = {**vars(args), "lighthouse": lighthouse.address(), "store_port": store.port}
    out: dict[str, Any] = {}
    job = _Job()
    try:
        n = args.ranks
        if "overhead" in args.only:
            for r in range(n):
                job.launch(_overhead_replica, r, p)
            reports = job.collect(list(range(n)), timeout=1200)
            rows = []
            for ms in args.compute_ms:
                med = {v: W.median([x for rep in reports.values() for x in rep["times"][str(ms)][v]]) * 1e3
                       for v in ("plain", "torchft")}
                rows.append({"compute_ms": ms, "plain_ms": med["plain"], "torchft_ms": med["torchft"],
                             "overhead_pct": (med["torchft"] / med["plain"] - 1) * 100})
            out["overhead"] = rows
            out["commit_ms"] = W.median([x for rep in reports.values() for x in rep["commit_s"]]) * 1e3
            print(json.dumps(out), flush=True)
            job.close()
            job = _Job()
        out["recovery"] = recovery(p, args.trials, job) if args.trials > 0 and "recovery" in args.only else {
            "trials": 0, "n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"),
            "survivor_failures": 0, "note": "not run (--trials 0)"}
    finally:
        job.close()
        lighthouse.shutdown()
    with open(args.json, "w") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
