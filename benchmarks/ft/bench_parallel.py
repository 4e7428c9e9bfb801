"""Fault-tolerant DDP and HSDP: per-step overhead against the same parallelism without fault tolerance, recovery
time at the default settings, and torchft 0.2.0's DDP measured the same way in the same run (issue 15).

    python benchmarks/ft/bench_parallel.py                                   # everything, default sizes
    python benchmarks/ft/bench_parallel.py --quick                           # smoke run of every section (< 2 min)
    python benchmarks/ft/bench_parallel.py --only overhead --steps 40 --compute-ms 0 20
    python benchmarks/ft/bench_parallel.py --only overhead --parallel ddp --python-hook --vote-early  # C++ vs Python
    python benchmarks/ft/bench_parallel.py --only overhead --parallel ddp --find-unused  # what the used map costs
    python benchmarks/ft/bench_parallel.py --only overhead --parallel ddp --defer-commit  # the decision a step later
    python benchmarks/ft/bench_parallel.py --only recovery --trials 30 --hsdp-trials 10
    python benchmarks/ft/bench_parallel.py --only torchft --torchft-python /work/venvs/torchft/bin/python

**overhead** -- one job of ``--ranks`` processes per parallelism (forkserver, torch preloaded, 1 torch thread each),
every variant in the same processes on the same model (``_workload.model``), the same inputs and the same simulated
compute (``--compute-kind``: ``sleep``, default, or ``busy``) at the top of every step; variants run in blocks of
``--block`` steps in palindromic order (A B C C B A ...), the first round is warm-up; figures are medians of every
rank's step times:

* DDP: torch's DDP on raw ``ProcessGroupGloo`` (reference), torch's DDP on a plain torchnext process group (the
  baseline: the same Communicator stack without fault tolerance), ``torchnext.ft.DistributedDataParallel`` with
  ``ft.step()`` and a commit every step. Every rank is its own replica group.
* HSDP: FSDP2 ``fully_shard`` per layer on a 2-D mesh (2 replica groups x 2 shards by default) whose shard
  dimension is the same plain torchnext group in both variants: replicate dimension a plain torchnext group
  (baseline) or ``ft.process_group`` through ``torchnext.ft.device_mesh`` with ``ft.step()``/commit (FT-HSDP).

overhead = median FT step / median baseline step - 1 (goals: FT-DDP <= 2 %, FT-HSDP <= 3 %).

**recovery** -- one long-running job at the default ``FaultTolerantConfig`` and ``MembershipConfig`` settings; each
trial SIGKILLs one rank and measures fault -> every survivor committed a step in the generation without it; then a
replacement is launched (healed from a survivor) and the next trial starts when the job is whole again. FT-DDP: the
victim kills itself inside backward, in the gradient hook of a parameter drawn at random (DDP buckets of
``--bucket-mb`` MiB: earlier buckets are then all-reducing). FT-HSDP: a rank of a random replica group kills itself
at a random moment of a step (a timer thread; uniform over 1.5 median step times); its whole group leaves and is
relaunched. Marks are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine) from the
victim, the coordinator's history and every survivor::

    detect  = coordinator records the failure          - fault (victim's last instruction before SIGKILL)
    agree   = coordinator announces the new generation - detect
    rebuild = last survivor built the Communicator     - agree
    commit  = last survivor committed a step           - rebuild
    total   = last survivor committed a step           - fault  (FT-DDP p50 <= 100 ms, p99 <= 300 ms; FT-HSDP p50 <= 300)

**torchft** -- ``torchft_peer.py`` run with the python of a separate virtual environment holding torchft 0.2.0 (it
reuses this torch); the same model, inputs, compute and kill point with torch's DDP on ``ProcessGroupGloo`` vs
torchft's ``DistributedDataParallel`` + ``Manager`` + its lighthouse, at torchft's defaults. If it cannot run, the
reason is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # this checkout's torchnext
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _workload as W

DEFAULT_TORCHFT_PYTHON = "/work/venvs/torchft/bin/python"
QUICK: dict[str, Any] = {"steps": 10, "block": 5, "hidden": 128, "trials": 3, "hsdp_trials": 2, "torchft_trials": 0,
                         "timeout": 120.0, "torchft_timeout": 120.0}
"""``--quick``: the plumbing of every section in well under two minutes (figures too noisy to quote)."""


def _preimport() -> None:
    """Import what torch's DDP and FSDP2 import lazily on first use, before the member's heartbeat thread starts:
    ``torch._dynamo`` (which ``FaultTolerant`` now preloads itself: its import holds the GIL for up to ~0.8 s on this
    loaded machine, past the 0.6 s heartbeat timeout) and FSDP2, so that no timed step and no member's first
    heartbeats pay for an import."""
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.optim  # noqa: F401


# ============================================================================================== overhead: DDP
def _ddp_overhead_rank(ctx: Any, addr: str, token: str, p: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from torchnext.comms import Communicator
    from torchnext.ft import DistributedDataParallel, FaultTolerant, FaultTolerantConfig

    torch.set_num_threads(1)
    _preimport()
    r, n = ctx.rank, ctx.world_size
    dist.init_process_group("gloo", store=dist.PrefixStore("bench.gloo", ctx.store), rank=r, world_size=n)
    gloo = dist.group.WORLD  # torch's own Gloo process group
    plain = Communicator(dist.PrefixStore("bench.plain", ctx.store), r, n, name="bench-plain").as_process_group()
    kw = {"bucket_cap_mb": p["bucket_mb"]}
    early = bool(p.get("vote_early"))
    deferred = bool(p.get("defer_commit"))
    py_hook = bool(p.get("python_hook"))
    find_unused = bool(p.get("find_unused"))
    models = {name: W.model(p["hidden"]) for name in ("gloo", "plain", "ft", *(["ft_early"] if early else []),
                                                       *(["ft_py"] if py_hook else []),
                                                       *(["ft_find_unused"] if find_unused else []),
                                                       *(["ft_deferred"] if deferred else []))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    current = ["ft"]  # the variant stepping now: its model and optimizer are the state a deferred commit snapshots
    ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, member_id=r),
                       state_dict=lambda: {"m": models[current[0]].state_dict(), "o": opts[current[0]].state_dict()},
                       load_state_dict=lambda st: (models[current[0]].load_state_dict(st["m"]),
                                                   opts[current[0]].load_state_dict(st["o"])))
    wrapped = {
        "gloo": TorchDDP(models["gloo"], process_group=gloo, **kw),
        "plain": TorchDDP(models["plain"], process_group=plain, **kw),
        "ft": DistributedDataParallel(models["ft"], ft, **kw),
    }
    if early:  # the same ft, its own DDP: the vote leaves when backward's last bucket is reduced
        wrapped["ft_early"] = DistributedDataParallel(models["ft_early"], ft, vote_early=True, **kw)
    if find_unused:  # the same ft, its own DDP told some parameter may go unused: the used map every step
        wrapped["ft_find_unused"] = DistributedDataParallel(models["ft_find_unused"], ft, find_unused_parameters=True,
                                                            **kw)
    if deferred:  # the same ft, its own DDP, stepped with FaultTolerantConfig(defer_commit=True)
        wrapped["ft_deferred"] = DistributedDataParallel(models["ft_deferred"], ft, **kw)
    if py_hook:  # the same ft, its own DDP built as without the native extension: the Python comm hook and used map
        from unittest import mock

        with mock.patch.object(type(ft.process_group), "native_route", lambda self: None):
            wrapped["ft_py"] = DistributedDataParallel(models["ft_py"], ft, **kw)
    phases = _Phases()
    compute = lambda ms: W.compute(ms, p["compute_kind"])  # noqa: E731
    batch = lambda step: W.batch(step, r)  # noqa: E731
    steps = {name: _plain_step(phases, name, wrapped[name], opts[name], batch, compute) for name in ("gloo", "plain")}
    for name in FT_VARIANTS:
        if name in wrapped:
            steps[name] = _ft_step(phases, ft, wrapped[name], opts[name], batch, compute, name=name)
            steps[name].before_block = lambda name=name: _switch(ft, current, name)  # type: ignore[attr-defined]
    try:
        out = _timed_blocks(steps, p)
    finally:
        ft.finish()
    diff = max((a - b).abs().max().item() for a, b in zip(models["plain"].parameters(), models["ft"].parameters(),
                                                           strict=True))
    return {"times": out, "phases": phases.s, "max_abs_diff": diff}


def _switch(ft: Any, current: list[str], name: str) -> None:
    """Between blocks (untimed): make ``name`` the variant stepping, with ``defer_commit`` iff it is ``ft_deferred``
    (a step still provisional is confirmed first: its decision belongs to the variant that stepped it)."""
    import dataclasses

    if not ft.confirm():
        raise RuntimeError(f"a provisional step of {current[0]} was refused in a benchmark without faults")
    current[0] = name
    ft.config = dataclasses.replace(ft.config, defer_commit=name == "ft_deferred")


class _Phases:
    """Seconds per (variant, phase) of every timed step: where an FT step's extra time goes."""

    def __init__(self) -> None:
        self.s: dict[str, list[float]] = {}

    def add(self, variant: str, phase: str, t0: float) -> None:
        self.s.setdefault(f"{variant}.{phase}", []).append(time.perf_counter() - t0)


def _plain_step(phases: _Phases, name: str, net: Any, opt: Any, batch: Any, compute: Any) -> Any:
    """One timed step of a variant without fault tolerance (``phases``: its forward + backward)."""
    done = [0]

    def step(ms: float) -> None:
        compute(ms)
        t = time.perf_counter()
        net(batch(done[0])).square().mean().backward()
        phases.add(name, "fwd_bwd", t)
        opt.step()
        opt.zero_grad()
        done[0] += 1

    return step


FT_VARIANTS = ("ft", "ft_early", "ft_py", "ft_find_unused", "ft_deferred")
"""The fault-tolerant variants: voting at ``commit()``, (DDP, ``--vote-early``) voting when backward's last
bucket is reduced (``DistributedDataParallel(vote_early=True)``), (DDP, ``--python-hook``) the Python comm hook
(what a DDP gets without the native extension), for an A/B against the C++ path in the same run, (DDP,
``--find-unused``) ``find_unused_parameters=True``: torch's autograd-graph traversal and the used-parameter map's
all_reduce every step, which FT-DDP's default (``False``, as the baseline DDP) skips -- what a mixture-of-experts
model pays -- and (DDP, ``--defer-commit``) ``FaultTolerantConfig(defer_commit=True)``: each step's decision
awaited at the next step's commit, its optimizer update applied provisionally (the model and optimizer copied on
the snapshot thread every attempt); the same ``ft``, switched between blocks. Every FT-DDP variant keeps its bucket
layout pinned (see :mod:`torchnext.ft.ddp`)."""

_VARIANT_LABELS = {"ft": "", "ft_early": " (vote early)", "ft_py": " (Python hook)",
                   "ft_find_unused": " (find_unused_parameters=True)", "ft_deferred": " (defer_commit)"}


def _ft_step(phases: _Phases, ft: Any, net: Any, opt: Any, batch: Any, compute: Any, name: str = "ft") -> Any:
    """One timed fault-tolerant step (``phases``: entering ``ft.step()``, forward + backward, the commit, leaving)."""

    def step(ms: float) -> None:
        t = time.perf_counter()
        with ft.step() as st:
            phases.add(name, "enter", t)
            compute(ms)
            t = time.perf_counter()
            net(batch(ft.step_count)).square().mean().backward()
            phases.add(name, "fwd_bwd", t)
            t = time.perf_counter()
            ok = st.commit()
            phases.add(name, "commit", t)
            if ok:
                opt.step()
            opt.zero_grad()
            t = time.perf_counter()
        phases.add(name, "exit", t)

    return step


def _timed_blocks(steps: dict[str, Any], p: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per compute setting: variant -> step times (s), blocks of ``block`` steps in palindromic order, the first
    round discarded as warm-up."""
    out: dict[str, dict[str, list[float]]] = {}
    names = list(steps)
    rounds = 1 + max(1, p["steps"] // p["block"])
    for ms in p["compute_ms"]:
        times: dict[str, list[float]] = {k: [] for k in names}
        for i, name in enumerate(W.palindrome(names, rounds)):
            before = getattr(steps[name], "before_block", None)
            if before is not None:
                before()
            for _ in range(p["block"]):
                t0 = time.perf_counter()
                steps[name](ms)
                if i >= len(names):
                    times[name].append(time.perf_counter() - t0)
        out[str(ms)] = times
    return out


# ============================================================================================= overhead: HSDP
def _hsdp_overhead_rank(ctx: Any, addr: str, token: str, p: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torchnext.comms import Communicator
    from torchnext.ft import FaultTolerant, FaultTolerantConfig, device_mesh
    from torchnext.ft.state import load_sharded_state, sharded_state

    torch.set_num_threads(1)
    _preimport()
    s = p["shard"]
    gid, local = divmod(ctx.rank, s)
    groups = ctx.world_size // s
    dist.init_process_group("torchnext", store=dist.PrefixStore(f"bench.shard{gid}", ctx.store), rank=local,
                            world_size=s)
    shard = dist.group.WORLD
    rep = Communicator(dist.PrefixStore(f"bench.rep{local}", ctx.store), gid, groups,
                       name=f"bench-rep{local}").as_process_group()
    ranks = dist.get_process_group_ranks(shard)
    plain_mesh = DeviceMesh.from_group([rep, shard], "cpu", mesh=torch.tensor([ranks], dtype=torch.int64),
                                       mesh_dim_names=("replicate", "shard"))
    models = {"plain": W.model(p["hidden"]), "ft": W.model(p["hidden"])}
    opts: dict[str, Any] = {}
    ft = FaultTolerant(FaultTolerantConfig(coordinator=addr, token=token, member_id=ctx.rank, replica_group=gid,
                                           group_rank=local, group_size=s),
                       state_dict=lambda: sharded_state(models["ft"], opts["ft"]),
                       load_state_dict=lambda st: load_sharded_state(st, models["ft"], opts["ft"]), join=False)
    meshes = {"plain": plain_mesh, "ft": device_mesh(ft, ("replicate", "shard"))}
    for name, m in models.items():
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=meshes[name])
        fully_shard(m, mesh=meshes[name])
        opts[name] = torch.optim.SGD(m.parameters(), lr=1e-3)
    ft.join()
    phases = _Phases()
    compute = lambda ms: W.compute(ms, p["compute_kind"])  # noqa: E731
    batch = lambda step: W.batch(step, gid)  # noqa: E731
    steps = {"plain": _plain_step(phases, "plain", models["plain"], opts["plain"], batch, compute),
             "ft": _ft_step(phases, ft, models["ft"], opts["ft"], batch, compute)}
    try:
        out = _timed_blocks(steps, p)
    finally:
        ft.finish()
    diff = max((a.to_local() - b.to_local()).abs().max().item()
               for a, b in zip(models["plain"].parameters(), models["ft"].parameters(), strict=True))
    return {"times": out, "phases": phases.s, "max_abs_diff": diff}


def overhead(p: dict[str, Any]) -> dict[str, Any]:
    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
    from torchnext.testing import run_ranks

    n = p["ranks"]
    res: dict[str, Any] = {}
    for kind, fn, groups in (("ddp", _ddp_overhead_rank, n), ("hsdp", _hsdp_overhead_rank, n // p["shard"])):
        if kind not in p["parallel"]:
            continue
        t0 = time.monotonic()
        with Coordinator(CoordinatorConfig(membership=MembershipConfig(initial_size=groups))) as coord:
            reports = run_ranks(fn, n, args=(coord.address, coord.token, p), timeout=p["timeout"])
        res[kind] = {"reports": reports, "seconds": time.monotonic() - t0}
    return res


def print_overhead(res: dict[str, Any], p: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(f"\n## per-step overhead: {p['ranks']} ranks, {p['steps']} timed steps per variant and setting (blocks of "
          f"{p['block']}, palindromic order), compute = {p['compute_kind']}\n")
    print("| parallelism | compute | raw Gloo step ms | baseline step ms | FT step ms | FT overhead | per-round overhead "
          "p25 .. p75 | goal | commit ms (FT) | max abs param diff |\n|---|---|---|---|---|---|---|---|---|---|")
    for kind, base, goal in (("ddp", "plain", 2.0), ("hsdp", "plain", 3.0)):
        if kind not in res:
            continue
        reports = res[kind]["reports"]
        diff = max(rep["max_abs_diff"] for rep in reports)
        equal = "bitwise" if diff == 0 else f"{diff:.1e}"
        for ms in p["compute_ms"]:
            for variant in FT_VARIANTS:
                if not any(variant in rep["times"][str(ms)] for rep in reports):
                    continue
                med = {v: W.median([x for rep in reports for x in rep["times"][str(ms)].get(v, [])]) * 1e3
                       for v in ("gloo", base, variant)}
                ovh = (med[variant] / med[base] - 1) * 100
                spread = _round_overheads(reports, str(ms), base, p["block"], variant)
                raw = f"{med['gloo']:.2f}" if med["gloo"] == med["gloo"] else "-"
                ok = "met" if ovh <= goal else f"**missed by {ovh - goal:.1f} pts**"
                label = "FT-DDP" if kind == "ddp" else f"FT-HSDP {p['ranks'] // p['shard']}x{p['shard']}"
                label += _VARIANT_LABELS[variant]
                vcommit = _phase(reports, f"{variant}.commit")
                print(f"| {label} | {ms:g} ms | {raw} | {med[base]:.2f} | {med[variant]:.2f} | {ovh:+.1f} % | "
                      f"{W.pct(spread, 25):+.1f} .. {W.pct(spread, 75):+.1f} % | <= {goal:g} % {ok} | {vcommit:.2f} | "
                      f"{equal} |")
                rows.append({"parallelism": kind, "variant": variant, "compute_ms": ms, "raw_gloo_ms": med["gloo"],
                             "baseline_ms": med[base], "ft_ms": med[variant], "overhead_pct": ovh,
                             "round_overhead_p25": W.pct(spread, 25), "round_overhead_p75": W.pct(spread, 75),
                             "commit_ms": vcommit})
    print("\nbaseline = the same torch DDP / FSDP2 on plain torchnext groups (no fault tolerance); raw Gloo = torch's "
          "DDP on ProcessGroupGloo; 'max abs param diff': FT model vs baseline model "
          "at the end (DDP: torch's default hook divides each bucket by the size before a SUM, ours averages after it: "
          "rounding differs)")
    print("\nwhere an FT step's extra time goes (medians over every rank's steps, warm-up and both compute settings "
          "included; fwd+bwd excludes the simulated compute):\n")
    print("| parallelism | baseline fwd+bwd ms | FT fwd+bwd ms | FT `with ft.step()` enter ms | FT commit ms | FT exit ms |"
          "\n|---|---|---|---|---|---|")
    for kind in res:
        reports = res[kind]["reports"]
        for v in FT_VARIANTS:
            if not any(f"{v}.commit" in rep["phases"] for rep in reports):
                continue
            label = ("FT-DDP" if kind == "ddp" else "FT-HSDP") + _VARIANT_LABELS[v]
            print(f"| {label} | {_phase(reports, 'plain.fwd_bwd'):.2f} | {_phase(reports, f'{v}.fwd_bwd'):.2f} | "
                  f"{_phase(reports, f'{v}.enter'):.3f} | {_phase(reports, f'{v}.commit'):.2f} | "
                  f"{_phase(reports, f'{v}.exit'):.3f} |")
            for row in rows:
                if row["parallelism"] == kind and row.get("variant", "ft") == v:
                    row.update({f"phase_{k.replace(v, 'ft')}_ms": _phase(reports, k)
                                for k in ("plain.fwd_bwd", f"{v}.fwd_bwd", f"{v}.enter", f"{v}.commit", f"{v}.exit")})
    return rows


def _round_overheads(reports: list[dict[str, Any]], ms: str, base: str, block: int,
                     variant: str = "ft") -> list[float]:
    """Per rank and palindromic round: median FT step / median baseline step of that round's blocks - 1 (%): the
    spread of the overhead across the run (rounds are minutes apart under a changing load)."""
    out: list[float] = []
    for rep in reports:
        ft, bl = rep["times"][ms][variant], rep["times"][ms][base]
        for k in range(min(len(ft), len(bl)) // block):
            out.append((W.median(ft[k * block:(k + 1) * block]) / W.median(bl[k * block:(k + 1) * block]) - 1) * 100)
    return out


def _phase(reports: list[dict[str, Any]], key: str) -> float:
    return W.median([x for rep in reports for x in rep["phases"].get(key, [])]) * 1e3


# ============================================================================================== recovery
def _log(path: str, rec: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(rec) + "\n")


def _stop_target(path: str) -> int | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    return int(text) if text else None


def _ddp_member(spec: Any) -> dict[str, Any]:
    """A FT-DDP member until the stop file's step; SIGUSR2 arms a kill inside its next backward."""
    from torchnext.ft import DistributedDataParallel, FaultTolerant, FaultTolerantConfig, MembershipError

    torch.set_num_threads(1)
    _preimport()
    p = spec.extra
    model = W.model(p["hidden"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ft = FaultTolerant(FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id),
                       state_dict=lambda: {"m": model.state_dict(), "o": opt.state_dict()},
                       load_state_dict=lambda s: (model.load_state_dict(s["m"]), opt.load_state_dict(s["o"])))
    ddp = DistributedDataParallel(model, ft, bucket_cap_mb=p["bucket_mb"])
    params = list(model.parameters())
    kill_at = [-1]
    rng = random.Random(spec.member_id)
    signal.signal(signal.SIGUSR2, lambda *_: kill_at.__setitem__(0, rng.randrange(len(params))))

    def hook(i: int) -> Any:
        def fire(g: torch.Tensor) -> torch.Tensor:
            if kill_at[0] == i:
                _log(p["fault_log"], {"member": spec.member_id, "t": time.monotonic(), "param": i})
                os.kill(os.getpid(), signal.SIGKILL)
            return g
        return fire

    for i, prm in enumerate(params):
        prm.register_hook(hook(i))
    return _train(ft, spec, lambda: ddp(W.batch(ft.step_count, spec.member_id)).square().mean().backward(),
                  opt, MembershipError)


def _train(ft: Any, spec: Any, fwd_bwd: Any, opt: Any, fatal: type[BaseException],
           durations: list[float] | None = None) -> dict[str, Any]:
    p = spec.extra
    logged = -1
    try:
        while True:
            target = _stop_target(p["stop_file"])
            if target is not None and ft.step_count >= target:
                break
            t0 = time.monotonic()
            with ft.step() as st:
                W.compute(p["compute_ms"], "sleep")
                fwd_bwd()
                if st.commit():
                    opt.step()
                    if ft.generation != logged:
                        logged = ft.generation
                        marks = ft.reconfigurations[-1].timings if ft.reconfigurations else {}
                        _log(p["event_log"], {"member": spec.member_id, "gen": logged, "commit": ft.commit_times[-1][2],
                                              "built": marks.get("built"), "start": marks.get("start")})
                opt.zero_grad()
            if durations is not None:
                durations.append(time.monotonic() - t0)
                del durations[:-20]
        ft.finish()
        return {"member": spec.member_id, "step": ft.step_count, "error": None}
    except fatal as exc:
        ft.close()
        return {"member": spec.member_id, "step": ft.step_count, "error": f"{type(exc).__name__}: {exc}"[:200]}


def _hsdp_member(spec: Any) -> dict[str, Any]:
    """A rank of a FT-HSDP replica group; SIGUSR2 arms a kill at a random moment within 1.5 of its median step
    times (the last 20)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from torchnext.ft import FaultTolerant, FaultTolerantConfig, MembershipError, device_mesh
    from torchnext.ft.state import load_sharded_state, sharded_state

    torch.set_num_threads(1)
    _preimport()
    p = spec.extra
    gid, local, s = p["group"], p["local"], p["shard"]
    store = dist.TCPStore(p["store_host"], p["store_port"], None, False, timeout=timedelta(seconds=60))
    dist.init_process_group("torchnext", store=dist.PrefixStore(f"shard{gid}.{p['incarnation']}", store),
                            rank=local, world_size=s)
    m = W.model(p["hidden"])
    box: dict[str, Any] = {}
    ft = FaultTolerant(FaultTolerantConfig(coordinator=spec.coordinator, token=spec.token, member_id=spec.member_id,
                                           replica_group=gid, group_rank=local, group_size=s),
                       state_dict=lambda: sharded_state(m, box["opt"]),
                       load_state_dict=lambda st: load_sharded_state(st, m, box["opt"]), join=False)
    mesh = device_mesh(ft, ("replicate", "shard"))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    box["opt"] = opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    ft.join()
    rng = random.Random(spec.member_id)

    def die() -> None:
        _log(p["fault_log"], {"member": spec.member_id, "t": time.monotonic()})
        os.kill(os.getpid(), signal.SIGKILL)

    durations: list[float] = []

    def arm(*_: Any) -> None:
        threading.Timer(rng.uniform(0, 1.5 * W.median(durations or [0.02])), die).start()

    signal.signal(signal.SIGUSR2, arm)
    return _train(ft, spec, lambda: m(W.batch(ft.step_count, gid)).square().mean().backward(), opt,
                  MembershipError, durations)


def recovery(kind: str, trials: int, p: dict[str, Any]) -> dict[str, Any]:
    """``trials`` kills on one running job (``kind``: ddp or hsdp); returns the raw marks for :func:`analyse`."""
    import torch.distributed as dist

    from torchnext.ft import Coordinator, CoordinatorConfig, MembershipConfig
    from torchnext.testing.ft_workload import FTJob, WorkerSpec

    tmp = tempfile.mkdtemp(prefix=f"bench-{kind}-")
    files = {k: os.path.join(tmp, k) for k in ("fault_log", "event_log", "stop_file")}
    n, s = p["ranks"], (p["shard"] if kind == "hsdp" else 1)
    groups = n // s
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    records: list[dict[str, Any]] = []
    incarnation = [0]
    next_id = [0]
    fn = _ddp_member if kind == "ddp" else _hsdp_member
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(initial_size=groups))) as coord, FTJob() as job:
        group_of: dict[int, int] = {}
        current: dict[int, list[int]] = {}  # group -> its members' ids in its latest incarnation
        unexpected: list[str] = []  # members that left without being killed (false removal, crash)

        def launch_group(g: int) -> None:
            incarnation[0] += 1
            current[g] = []
            for local in range(s):
                mid = next_id[0]
                next_id[0] += 1
                group_of[mid] = g
                current[g].append(mid)
                extra = {**p, **files, "group": g, "local": local, "shard": s, "incarnation": incarnation[0],
                         "store_host": "127.0.0.1", "store_port": store.port}
                job.launch(WorkerSpec(coordinator=coord.address, token=coord.token, member_id=mid, steps=0,
                                      extra=extra), fn)

        def fail(what: str) -> RuntimeError:
            """Why the job stalled: the members' own reports (errors included) and the coordinator's last events."""
            for _ in range(50):
                job._collect(0.02)
            alive = [m for m, proc in job.procs.items() if proc.is_alive()]
            errors = {m: str(e).strip().splitlines()[-1][:300] for m, e in job.errors.items()}
            done = {m: r for m, r in job.reports.items() if r.get("error")}
            tail = coord.history()[-12:]
            return RuntimeError(f"{kind}: {what}; members alive {alive}, coordinator members {coord.members} step "
                                f"{coord.step}; errors {errors}; reports with an error {done}; last coordinator "
                                f"events {tail}")

        for g in range(groups):
            launch_group(g)
        if not coord.wait_until(lambda c: c.step >= 3 and len(c.members) == n, p["timeout"]):
            raise fail("the job did not start")
        for trial in range(trials):
            time.sleep(random.Random(trial).uniform(0.02, 0.1))
            members = list(coord.members)
            victim = members[random.Random(1000 + trial).randrange(len(members))]
            gen0, step0 = coord.generation, coord.step
            os.kill(job.pid(victim), signal.SIGUSR2)
            g = group_of[victim]
            lost = [m for m in members if group_of[m] == g]
            if not coord.wait_until(lambda c, lost=lost: not set(lost) & set(c.members), 30):
                raise fail(f"trial {trial}: group of member {victim} not removed")
            records.append({"victim": victim, "lost": lost, "gen0": gen0, "step0": step0})
            if not coord.wait_until(lambda c, st=coord.step: c.step >= st + 2, 30):
                raise fail(f"trial {trial}: survivors did not commit")
            job.wait(lost, timeout=30)  # the victim is dead; its group mates leave (RemovedFromGroup)
            launch_group(g)
            deadline = time.monotonic() + 60
            while not coord.wait_until(lambda c: len(c.members) == n, 2):
                # a group that lost a member it was not told to lose (e.g. removed after a starved heartbeat) is
                # relaunched as well, and the reason is kept: the job must be whole before the next trial
                for h, mids in list(current.items()):
                    gone = [m for m in mids if job.exitcode(m) is not None]
                    if h == g or not gone:
                        continue
                    try:
                        reps = job.wait(mids, timeout=30)
                        why = "; ".join(f"member {m}: {r.get('error')}" for m, r in reps.items() if r.get("error"))
                    except (RuntimeError, TimeoutError) as exc:
                        why = str(exc).strip().splitlines()[-1][:300]
                    unexpected.append(f"trial {trial}: group {h} left ({why or 'no error reported'})")
                    launch_group(h)
                if time.monotonic() > deadline:
                    raise fail(f"trial {trial}: the job was not whole again within 60 s")
            if not coord.wait_until(lambda c, st=coord.step: c.step >= st + 3, 30):
                raise fail(f"trial {trial}: no progress after the replacement joined")
        with open(files["stop_file"], "w") as fh:
            fh.write(str(coord.step + 5))
        job.wait(list(coord.members), timeout=60)
        history = coord.history()
    return {"records": records, "history": history, "unexpected": unexpected, **files}


def analyse(run: dict[str, Any]) -> dict[str, list[float]]:
    history = run["history"]
    faults: dict[int, float] = {}
    with open(run["fault_log"]) as fh:
        for line in fh:
            ev = json.loads(line)
            faults[ev["member"]] = ev["t"]
    events: dict[int, list[dict[str, Any]]] = {}
    with open(run["event_log"]) as fh:
        for line in fh:
            ev = json.loads(line)
            events.setdefault(ev["gen"], []).append(ev)
    gens = {h["gen"]: h for h in history if h["event"] == "generation"}
    out: dict[str, list[float]] = {k: [] for k in ("detect", "agree", "rebuild", "commit", "total")}
    for rec in run["records"]:
        victim = rec["victim"]
        if victim not in faults:
            continue
        t_fault = faults[victim]
        fail = next((h for h in history if h["event"] == "failure" and h.get("member") in rec["lost"]), None)
        new = next((g for g in sorted(gens) if g > rec["gen0"] and not set(rec["lost"]) & set(gens[g]["members"])),
                   None)
        if fail is None or new is None:
            continue
        survivors = set(gens[new]["members"])
        evs = [e for e in events.get(new, []) if e["member"] in survivors]
        if {e["member"] for e in evs} != survivors:
            continue
        built = max(e["built"] for e in evs)
        commit = max(e["commit"] for e in evs)
        out["detect"].append(fail["at"] - t_fault)
        out["agree"].append(gens[new]["at"] - fail["at"])
        out["rebuild"].append(built - gens[new]["at"])
        out["commit"].append(commit - built)
        out["total"].append(commit - t_fault)
    return out


def print_recovery(kind: str, res: dict[str, list[float]], trials: int, goal: str,
                   unexpected: list[str]) -> dict[str, Any]:
    label = "FT-DDP" if kind == "ddp" else "FT-HSDP"
    print(f"\n## recovery, {label}: fault -> every survivor committed a step ({len(res['total'])} of {trials} trials "
          f"analysed; goal {goal})\n")
    print("| phase | n | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for phase in ("detect", "agree", "rebuild", "commit", "total"):
        ms = [x * 1e3 for x in res[phase]]
        name = f"**{phase}**" if phase == "total" else phase
        print(f"| {name} | {len(ms)} | {W.pct(ms, 50):.1f} | {W.pct(ms, 99):.1f} | {max(ms, default=float('nan')):.1f} |")
    if unexpected:
        print(f"\nmembers that left without being killed (relaunched): {len(unexpected)}: " + "; ".join(unexpected[:5]))
    tot = [x * 1e3 for x in res["total"]]
    return {"unexpected": unexpected, "kind": kind, "n": len(tot), "p50_ms": W.pct(tot, 50), "p99_ms": W.pct(tot, 99),
            "max_ms": max(tot, default=float("nan"))}


# ============================================================================================== torchft peer
def torchft_peer(p: dict[str, Any]) -> dict[str, Any] | str:
    """Run ``torchft_peer.py`` with torchft's python; its JSON result, or why it could not run."""
    py = p["torchft_python"]
    if not os.path.exists(py):
        return (f"skipped: no torchft python at {py} (python3 -m venv --system-site-packages /work/venvs/torchft && "
                "/work/venvs/torchft/bin/pip install torchft==0.2.0 --no-deps, plus its pure-python deps)")
    probe = subprocess.run([py, "-c", "import torch, torchft, importlib.metadata as m; "
                            "print(torch.__version__, m.version('torchft'))"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"skipped: torchft does not import with {py}: {probe.stderr.strip().splitlines()[-1:]}"
    tv, fv = probe.stdout.split()
    if tv != torch.__version__:
        return f"skipped: {py} has torch {tv}, this run {torch.__version__} (the peer must share this torch)"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchft_peer.py")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = fh.name
    args = [py, script, "--json", out, "--ranks", str(p["ranks"]), "--steps", str(p["steps"]), "--block",
            str(p["block"]), "--hidden", str(p["hidden"]), "--bucket-mb", str(p["bucket_mb"]), "--compute-kind",
            p["compute_kind"], "--trials", str(p["torchft_trials"]), "--compute-ms", *map(str, p["compute_ms"])]
    print(f"torchft peer: torch {tv}, torchft {fv}: {' '.join(args[1:])}", flush=True)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=p["torchft_timeout"])
    except subprocess.TimeoutExpired:
        return f"failed: the torchft peer did not finish within {p['torchft_timeout']} s"
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        return f"failed: torchft peer exited {proc.returncode}:\n{tail}"
    with open(out) as fh:
        res: dict[str, Any] = json.load(fh)
    res["torchft_version"] = fv
    return res


def print_torchft(res: dict[str, Any] | str, ours: list[dict[str, Any]], rec: dict[str, dict[str, Any]]) -> None:
    print("\n## peer: torchft 0.2.0 DDP (Manager + ProcessGroupGloo + lighthouse, torchft defaults), same workload\n")
    if isinstance(res, str):
        print(res)
        return
    ddp = {r["compute_ms"]: r for r in ours if r["parallelism"] == "ddp"}
    print("| compute | torch DDP on ProcessGroupGloo ms | torchft DDP ms | torchft vs torch DDP on Gloo | torchnext "
          "FT-DDP vs torch DDP on Gloo (this run) | torchnext FT-DDP vs its baseline (this run) |\n|---|---|---|---|---|---|")
    for row in res["overhead"]:
        mine = ddp.get(row["compute_ms"])
        raw_txt = f"{(mine['ft_ms'] / mine['raw_gloo_ms'] - 1) * 100:+.1f} %" if mine else "-"
        ours_txt = f"{mine['overhead_pct']:+.1f} %" if mine else "-"
        print(f"| {row['compute_ms']:g} ms | {row['plain_ms']:.2f} | {row['torchft_ms']:.2f} | "
              f"{row['overhead_pct']:+.1f} % | {raw_txt} | {ours_txt} |")
    print(f"\ntorchft's should_commit: median {res.get('commit_ms', float('nan')):.2f} ms (torchnext's commit: see the "
          "overhead breakdown)")
    r = res["recovery"]
    if not r.get("trials"):
        print("\ntorchft recovery: not run (--torchft-trials 0; --quick sets it: one trial takes 5-20 s)")
        return
    print(f"\ntorchft recovery, kill inside backward ({r['trials']} trials):\n")
    print("| measure | n | p50 ms | max ms |\n|---|---|---|---|")
    print(f"| fault -> every survivor committed a step | {r['n']} | {r['p50_ms']:.0f} | {r['max_ms']:.0f} |")
    print(f"| fault -> every replica (survivors, restarted ones, the replacement) committed at full size | "
          f"{len(r.get('whole_ms', []))} | {r.get('whole_p50_ms', float('nan')):.0f} | "
          f"{r.get('whole_max_ms', float('nan')):.0f} |")
    print(f"\ntrials where a survivor's backward raised (torchft's comm hook; the replica must then be restarted): "
          f"{r.get('trials_where_backward_raised', 0)} of {r['trials']} ({', '.join(r.get('raised', [])) or '-'}); "
          f"survivor processes lost: {r['survivor_failures']}; notes: {(r.get('note') or '-')[:400]}")
    mine = rec.get("ddp")
    if mine and r["n"]:
        print(f"torchnext FT-DDP (this run): p50 {mine['p50_ms']:.0f} ms, p99 {mine['p99_ms']:.0f} ms "
              f"(torchft / torchnext at p50: {r['p50_ms'] / mine['p50_ms']:.1f}x)")
    elif mine:
        print(f"torchnext FT-DDP (this run): p50 {mine['p50_ms']:.0f} ms, p99 {mine['p99_ms']:.0f} ms; torchft: no "
              f"trial where every survivor committed without a restart")


# ============================================================================================== main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=["overhead", "recovery", "torchft"],
                    default=["overhead", "recovery", "torchft"])
    ap.add_argument("--parallel", nargs="+", choices=["ddp", "hsdp"], default=["ddp", "hsdp"],
                    help="which parallelisms the overhead and recovery sections measure")
    ap.add_argument("--ranks", type=int, default=4, help="processes (DDP: one replica group each; HSDP: groups of "
                    "--shard)")
    ap.add_argument("--shard", type=int, default=2, help="HSDP shard group size")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant and compute setting")
    ap.add_argument("--block", type=int, default=10, help="steps per block of one variant")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 20.0])
    ap.add_argument("--compute-kind", choices=["sleep", "busy"], default="sleep")
    ap.add_argument("--hidden", type=int, default=512, help="MLP width (~2*hidden^2 parameters)")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket size (MiB)")
    ap.add_argument("--vote-early", action="store_true",
                    help="FT-DDP: also time DistributedDataParallel(vote_early=True) in the same run")
    ap.add_argument("--python-hook", action="store_true",
                    help="FT-DDP: also time it on the Python comm hook (A/B against the C++ path)")
    ap.add_argument("--find-unused", action="store_true",
                    help="FT-DDP: also time it with find_unused_parameters=True (the autograd-graph traversal and the "
                    "used-parameter map's all_reduce every step; the default is False)")
    ap.add_argument("--defer-commit", action="store_true",
                    help="FT-DDP: also time it with FaultTolerantConfig(defer_commit=True) (decision awaited a step later)")
    ap.add_argument("--trials", type=int, default=100, help="FT-DDP recovery trials")
    ap.add_argument("--hsdp-trials", type=int, default=30, help="FT-HSDP recovery trials")
    ap.add_argument("--recovery-compute-ms", type=float, default=5.0, help="sleep per step in the recovery jobs")
    ap.add_argument("--torchft-python", default=os.environ.get("TORCHNEXT_BENCH_TORCHFT_PYTHON", DEFAULT_TORCHFT_PYTHON))
    ap.add_argument("--torchft-trials", type=int, default=8)
    ap.add_argument("--torchft-timeout", type=float, default=1500.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on each job (s)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="smoke run (< 2 min): " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + "; torchft's recovery is skipped")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    import torchnext
    from torchnext.ft import MembershipConfig

    print(f"torch {torch.__version__}, torchnext {getattr(torchnext, '__version__', '?')} "
          f"({os.path.dirname(torchnext.__file__)}), python "
          f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model: MLP {W.IN}-{args.hidden}-{args.hidden}-{args.hidden}-{W.IN} "
          f"({sum(x.numel() for x in W.model(args.hidden).parameters()):,} fp32 params), batch {W.BATCH}; "
          f"defaults: FaultTolerantConfig(), {MembershipConfig()}", flush=True)
    p: dict[str, Any] = {k: getattr(args, k) for k in ("parallel", "ranks", "shard", "steps", "block", "compute_ms", "compute_kind",
                                                       "hidden", "bucket_mb", "vote_early", "python_hook", "find_unused",
                                                       "defer_commit",
                                                       "timeout",
                                                       "torchft_python",
                                                       "torchft_trials", "torchft_timeout")}
    out: dict[str, Any] = {"argv": sys.argv[1:], "load_start": os.getloadavg()}
    rows: list[dict[str, Any]] = []
    rec: dict[str, dict[str, Any]] = {}
    if "overhead" in args.only:
        res = overhead(p)
        rows = print_overhead(res, p)
        out["overhead"] = rows
        print(f"(load average now {os.getloadavg()[0]:.2f})", flush=True)
    if "recovery" in args.only:
        step_ms = args.recovery_compute_ms
        q = {**p, "compute_ms": step_ms}
        for kind, trials, goal in (("ddp", args.trials, "p50 <= 100 ms, p99 <= 300 ms"),
                                   ("hsdp", args.hsdp_trials, "p50 <= 300 ms")):
            if trials <= 0 or kind not in args.parallel:
                continue
            t0 = time.monotonic()
            run = recovery(kind, trials, q)
            rec[kind] = print_recovery(kind, analyse(run), trials, goal, run["unexpected"])
            print(f"({time.monotonic() - t0:.0f} s; load average now {os.getloadavg()[0]:.2f})", flush=True)
        out["recovery"] = rec
    if "torchft" in args.only:
        peer = torchft_peer(p)
        print_torchft(peer, rows, rec)
        out["torchft"] = peer
    out["load_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
