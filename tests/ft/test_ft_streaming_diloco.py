"""Streaming DiLoCo over the fault-tolerant group: real member processes (torchnext.testing.run_ranks), an
in-process coordinator, and the paper's update rule (Douillard et al. 2025, arXiv 2501.18512, Algorithm 1 with the
overlap of section 2.3) written out below with plain tensors -- no torchnext code.

The data keep every parameter in [1, 2) and every inner update a multiple of 2**-9, so pseudo-gradients are exact
differences, their sums over the groups exact in any order, and the alpha = 0.5 mix (a + b) / 2 correctly rounded
whichever way it is computed: a run must match the reference bitwise, after every inner step.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torchnext.ft import (
    Coordinator,
    CoordinatorConfig,
    DiLoCo,
    DiLoCoConfig,
    FaultTolerant,
    FaultTolerantConfig,
    MembershipConfig,
    MembershipError,
    StreamingDiLoCo,
    StreamingDiLoCoConfig,
)
from torchnext.testing import RankContext, RankExited, run_ranks

pytestmark = pytest.mark.timeout(150)

LR_IN = 2.0**-6
_PATIENT = {"heartbeat_timeout_s": 3.0}  # a loaded 2-core machine starves heartbeat threads; kills are seen by EOF
SHAPES = ((3, 4), (5,), (2, 3), (4,))
DTYPES = (torch.float64, torch.float32, torch.float64, torch.float32)  # two dtypes: two buckets per fragment
N_PARAMS = len(SHAPES)


FP32 = (torch.float32,) * N_PARAMS  # the compressed runs: one bucket (one encoded vector) per fragment


def _init(j: int, dtypes: tuple[torch.dtype, ...] = DTYPES) -> torch.Tensor:
    n = int(np.prod(SHAPES[j]))
    return (1.5 + ((torch.arange(n, dtype=torch.float64) % 7) - 3) / 64).to(dtypes[j]).reshape(SHAPES[j])


def _coef(member: int, n: int, j: int, dtypes: tuple[torch.dtype, ...] = DTYPES) -> torch.Tensor:
    """The gradient of parameter ``j`` at inner step ``n`` (1-based) on ``member``: multiples of 1/8."""
    k = int(np.prod(SHAPES[j]))
    c = ((torch.arange(k, dtype=torch.float64) * (j + 1) + 3 * member + 7 * n) % 5 - 2) / 8
    return c.to(dtypes[j]).reshape(SHAPES[j])


class _Model(nn.Module):
    def __init__(self, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(_init(j, dtypes)) for j in range(N_PARAMS)])

    def forward(self, cs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((w * c).sum().double() for w, c in zip(self.ws, cs, strict=True)), torch.zeros((), dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ the reference
def reference(groups: int, steps: int, *, sync_every: int, fragments: list[list[int]], delay: int, alpha: float,
              lr: float = 0.7, momentum: float = 0.9, dtypes: tuple[torch.dtype, ...] = DTYPES,
              average: Any = None, contributors: Any = None,
              joins: dict[int, int] | None = None) -> tuple[list[list[list[torch.Tensor]]], list[torch.Tensor]]:
    """Streaming DiLoCo by hand, every group in one loop. Returns (per inner step, per group, the local parameters
    after that step's synchronization work; the final global copy).

    Outer step (per fragment, Nesterov SGD written with the ops of torch's single-tensor SGD so that it can be
    compared bitwise): ``buf = avg if first else momentum * buf + avg``; ``theta_g -= lr * (avg + momentum * buf)``.
    ``average(p, deltas) -> {j: avg}`` replaces the plain mean (the compressed runs). Faults:
    ``contributors(n)``, the groups whose pseudo-gradients the synchronization issued at step ``n`` averages
    (default: all); ``joins[m] = n``: group ``m`` gets the global copy at the issue of step ``n`` (and does not
    contribute to that one).
    """
    num = len(fragments)
    spacing = sync_every // num
    theta = [[_init(j, dtypes) for j in range(N_PARAMS)] for _ in range(groups)]
    theta_g = [_init(j, dtypes) for j in range(N_PARAMS)]
    buf: list[torch.Tensor | None] = [None] * N_PARAMS
    pending: tuple[int, list[list[torch.Tensor]], int] | None = None  # (fragment, deltas[m][j], due)
    trajectory = []

    def outer(p: int, deltas: list[list[torch.Tensor]]) -> None:
        avgs = None if average is None else average(p, deltas)
        for j in fragments[p]:
            avg = sum(d[j] for d in deltas) / len(deltas) if avgs is None else avgs[j]
            b = buf[j]
            buf[j] = avg.clone() if b is None else b * momentum + avg
            theta_g[j] = torch.add(theta_g[j], torch.add(avg, buf[j], alpha=momentum), alpha=-lr)
            for m in range(groups):
                theta[m][j] = alpha * theta[m][j] + (1 - alpha) * theta_g[j]

    for n in range(1, steps + 1):
        for m in range(groups):
            theta[m] = [t - LR_IN * _coef(m, n, j, dtypes) for j, t in enumerate(theta[m])]
        if pending is not None and n == pending[2]:
            outer(pending[0], pending[1])
            pending = None
        if n % spacing == 0:  # fragment p's pseudo-gradients are taken every H steps, fragments H / P apart
            p = (n // spacing - 1) % num
            live = list(range(groups)) if contributors is None else contributors(n)
            deltas = [[theta_g[j] - theta[m][j] if j in fragments[p] else torch.zeros(0) for j in range(N_PARAMS)]
                      for m in live]
            for m, at in (joins or {}).items():
                if at == n:
                    theta[m] = [t.clone() for t in theta_g]
            if delay == 0:
                outer(p, deltas)
            else:
                pending = (p, deltas, n + delay)
        trajectory.append([[t.clone() for t in th] for th in theta])
    if pending is not None:  # drain(): the last one in flight
        outer(pending[0], pending[1])
        trajectory.append([[t.clone() for t in th] for th in theta])
    return trajectory, theta_g


def _bits(ts: Any) -> list[bytes]:
    return [np.asarray(t).tobytes() for t in ts]


# ---------------------------------------------------------------------------------------------- one member process
def _ft(ctx: RankContext, addr: str, token: str, algos: list[Any]) -> FaultTolerant:
    return FaultTolerant(
        FaultTolerantConfig(coordinator=addr, token=token, member_id=ctx.rank, timeout_s=20.0),
        state_dict=lambda: {"algos": [a.state_dict() for a in algos]},
        load_state_dict=lambda s: [a.load_state_dict(x) for a, x in zip(algos, s["algos"], strict=True)],
        join=False,
    )


def _member(ctx: RankContext, addr: str, token: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One replica group. ``spec``: steps, runs (a list of StreamingDiLoCoConfig kwargs, or "diloco:<H>"), run one
    after another on one ``ft``; ``slow`` ({"member", "step", "sleep"}: that member sleeps before that inner step)."""
    member = ctx.rank
    runs = spec["runs"]
    dtypes = tuple(getattr(torch, d) for d in spec.get("dtypes", [str(d).split(".")[1] for d in DTYPES]))
    models = [_Model(dtypes) for _ in runs]
    algos: list[Any] = []
    ft = _ft(ctx, addr, token, algos)
    for run, model in zip(runs, models, strict=True):
        if isinstance(run, str):
            algos.append(DiLoCo(ft, model, DiLoCoConfig(sync_every=int(run.split(":")[1]))))
        else:
            blocks = list(model.ws) if run.pop("blocks", True) else None
            algos.append(StreamingDiLoCo(ft, model, StreamingDiLoCoConfig(**run), blocks=blocks))
    for a in algos:
        a.join()
    out: dict[str, Any] = {"member": member, "trajectories": [], "globals": [], "syncs": [], "fragments": [],
                           "step_s": []}
    slow = spec.get("slow")
    for a, model in zip(algos, models, strict=True):
        inner = torch.optim.SGD(model.parameters(), lr=LR_IN)
        traj, syncs, times = [], [], []
        for n in range(1, spec["steps"] + 1):
            if slow and slow["member"] == member and slow["step"] == n:
                time.sleep(slow["sleep"])
            model([_coef(member, n, j, dtypes) for j in range(N_PARAMS)]).backward()
            inner.step()
            inner.zero_grad()
            t0 = time.perf_counter()
            rec = a.step()
            times.append(time.perf_counter() - t0)
            if isinstance(a, StreamingDiLoCo):
                if rec is not None:
                    syncs.append(rec)
            traj.append([p.detach().numpy().copy() for p in model.parameters()])
        if isinstance(a, StreamingDiLoCo):
            rec = a.drain()
            if rec is not None:
                syncs.append(rec)
                traj.append([p.detach().numpy().copy() for p in model.parameters()])
            out["fragments"].append([list(f) for f in a.fragments])
        out["trajectories"].append(traj)
        out["globals"].append([g.numpy().copy() for g in a.global_params])
        out["syncs"].append(syncs)
        out["step_s"].append(times)
    out["step_count"] = ft.step_count
    ft.finish()
    return out


def _run(groups: int, spec: dict[str, Any], *, timeout: float = 120) -> list[Any]:
    cfg = MembershipConfig(min_size=1, initial_size=groups, **_PATIENT)
    with Coordinator(CoordinatorConfig(membership=cfg)) as coord:
        return run_ranks(_member, groups, args=(coord.address, coord.token, spec), timeout=timeout)


# ------------------------------------------------------------------------------------------------------ tests
_ORACLE = [
    # (config, the fragments as the test expects them: parameter indices)
    ({"sync_every": 4, "num_fragments": 2, "fragment_pattern": "strided", "fragment_sync_delay": 1,
      "fragment_update_alpha": 0.5}, [[0, 2], [1, 3]]),
    ({"sync_every": 4, "num_fragments": 2, "fragment_pattern": "sequential", "fragment_sync_delay": 1,
      "fragment_update_alpha": 0.0}, [[0, 1], [2, 3]]),
    ({"sync_every": 8, "num_fragments": 4, "fragment_pattern": "strided", "fragment_sync_delay": 1,
      "fragment_update_alpha": 0.5}, [[0], [1], [2], [3]]),
    ({"sync_every": 4, "num_fragments": 2, "fragment_pattern": "sequential", "fragment_sync_delay": 0,
      "fragment_update_alpha": 0.5}, [[0, 1], [2, 3]]),
]


@pytest.mark.slow
def test_streaming_diloco_follows_the_papers_update_rule_step_by_step() -> None:
    """Three groups, four configurations (strided / sequential, tau 0 or 1, alpha 0 or 0.5, P 2 or 4) run one after
    another on one ``ft``: every group's local parameters after every inner step, and the final global copy, are
    bitwise the reference's."""
    steps, groups = 11, 3
    res = _run(groups, {"steps": steps, "runs": [dict(c) for c, _ in _ORACLE]})
    for k, (cfg, frags) in enumerate(_ORACLE):
        traj, theta_g = reference(groups, steps, sync_every=cfg["sync_every"], fragments=frags,
                                  delay=cfg["fragment_sync_delay"], alpha=cfg["fragment_update_alpha"])
        for r in res:
            assert r["fragments"][k] == frags, (cfg, r["fragments"][k])
            got = r["trajectories"][k]
            assert len(got) == len(traj), (cfg, len(got), len(traj))
            for n, (g, w) in enumerate(zip(got, traj, strict=True)):
                assert _bits(g) == _bits(w[r["member"]]), f"config {k}, member {r['member']}: differs after step {n + 1}"
            assert _bits(r["globals"][k]) == _bits(theta_g), f"config {k}: global copy differs"
            syncs = r["syncs"][k]
            tau, spacing = cfg["fragment_sync_delay"], cfg["sync_every"] // cfg["num_fragments"]
            assert [s.issued_at for s in syncs] == list(range(spacing, steps + 1, spacing))
            assert all(s.applied_at == min(s.issued_at + tau, steps) and s.contributors == groups and s.attempts == 1
                       for s in syncs), syncs
            assert [s.fragment for s in syncs] == [(i // spacing - 1) % len(frags) for i in range(spacing, steps + 1, spacing)]


@pytest.mark.slow
def test_one_fragment_without_delay_is_diloco() -> None:
    """P = 1, tau = 0, alpha = 0, fp32, blocks left to the default: bitwise the same as ft.DiLoCo at the same H."""
    steps, h = 6, 2
    res = _run(2, {"steps": steps, "runs": [{"sync_every": h, "blocks": False}, f"diloco:{h}"]})
    traj, _ = reference(2, steps, sync_every=h, fragments=[list(range(N_PARAMS))], delay=0, alpha=0.0)
    for r in res:
        assert _bits(r["trajectories"][0][-1]) == _bits(r["trajectories"][1][-1]) == _bits(traj[-1][r["member"]])
        assert r["step_count"] == 2 * steps // h


@pytest.mark.slow
@pytest.mark.parametrize("tau", [1, 0])
def test_the_exchange_overlaps_the_inner_steps(tau: int) -> None:
    """Group 1 sleeps 1 s before inner step 2, where fragment 0 is issued: group 0's exchange cannot finish before
    group 1 joins it. With tau = 1 group 0's steps never wait for it -- step 2 (the issue)
    returns at once, and only step 3, where the result is due, waits; the same run with tau = 0 waits at step 2."""
    sleep = 1.0
    res = _run(2, {"steps": 4, "slow": {"member": 1, "step": 2, "sleep": sleep},
                   "runs": [{"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": tau}]})
    times = res[0]["step_s"][0]
    assert res[0]["syncs"][0][0].wait_s > 0.5 * sleep, res[0]["syncs"][0][0]
    if tau:
        assert times[1] < 0.25 * sleep and times[2] > 0.5 * sleep, f"the issue step waited: {times}"
    else:
        assert times[1] > 0.5 * sleep, f"tau = 0 did not wait at the issue: {times}"


def _dequantized_mean(fmt: str, frags: list[list[int]], **options: Any) -> Any:
    """The compressed reduction's meaning: every group's fragment pseudo-gradient, flattened in parameter order, is
    quantized and read back (torchnext.lowp, separately tested against torchao), and the results are added in fp32
    in group order and divided by the number of groups."""
    from torchnext.lowp import quantize

    def average(p: int, deltas: list[list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        acc = None
        for d in deltas:
            flat = torch.cat([d[j].reshape(-1) for j in frags[p]]).to(torch.float32)
            q = flat.to(torch.bfloat16).float() if fmt == "bf16" else quantize(flat, fmt, **options).dequantize(torch.float32)
            acc = q if acc is None else acc + q
        assert acc is not None
        acc = acc / len(deltas)
        out, off = {}, 0
        for j in frags[p]:
            k = int(np.prod(SHAPES[j]))
            out[j] = acc[off:off + k].reshape(SHAPES[j]).to(deltas[0][j].dtype)  # read back into the parameter dtype
            off += k
        return out

    return average


_FORMATS = {"bf16": ("bf16", {}), "mxfp8": ("mxfp8_e4m3", {}), "mxfp4": ("mxfp4", {}), "nvfp4": ("nvfp4", {"recipe": "te"})}


@pytest.mark.slow
def test_compressed_outer_gradients_are_reduced_in_fp32_bitwise_the_same_on_every_rank() -> None:
    """bf16, mxfp8, mxfp4 and nvfp4 outer gradients on three groups: the global copy and the local parameters are
    bitwise the same on every group after every step, and equal to the reference whose mean is the fp32 sum of the
    quantized-and-read-back pseudo-gradients -- so a rank used its peers' codes and its own, not its fp32 original."""
    steps, groups, frags = 9, 3, [[0, 2], [1, 3]]
    base = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    res = _run(groups, {"steps": steps, "dtypes": ["float32"] * N_PARAMS,
                        "runs": [{**base, "outer_dtype": d} for d in _FORMATS]})
    fp32_traj, _ = reference(groups, steps, sync_every=4, fragments=frags, delay=1, alpha=0.5, dtypes=FP32)
    for k, (name, (fmt, options)) in enumerate(_FORMATS.items()):
        traj, theta_g = reference(groups, steps, sync_every=4, fragments=frags, delay=1, alpha=0.5, dtypes=FP32,
                                  average=_dequantized_mean(fmt, frags, **options))
        assert _bits(traj[-1][0]) != _bits(fp32_traj[-1][0]), f"{name}: the compressed reference is not compressed"
        for r in res:
            assert _bits(r["globals"][k]) == _bits(res[0]["globals"][k]), f"{name}: global copies differ across ranks"
            assert _bits(r["globals"][k]) == _bits(theta_g), f"{name}, member {r['member']}: global copy differs"
            for n, (g, w) in enumerate(zip(r["trajectories"][k], traj, strict=True)):
                assert _bits(g) == _bits(w[r["member"]]), f"{name}, member {r['member']}: differs after step {n + 1}"
            assert all(s.contributors == groups for s in r["syncs"][k])


# ------------------------------------------------------------------------------------------------------ faults
_EXCHANGE = ("all_reduce", "all_gather_single")  # fp32 all-reduces (one per dtype bucket), else one all-gather
_FT_CFG = {"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
_FT_FRAGS = [[0, 2], [1, 3]]


def _snapshot(sd: StreamingDiLoCo) -> dict[str, Any]:
    momentum = []
    for opt in sd.outer_optimizers:
        st = opt.state_dict()["state"]
        momentum.append([st[i]["momentum_buffer"].numpy().copy() for i in sorted(st)])
    return {"global": [g.numpy().copy() for g in sd.global_params], "momentum": momentum,
            "outer_steps": sd.outer_steps, "inner_steps": sd.inner_steps}


def _ft_member(ctx: RankContext, addr: str, token: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One replica group under faults. ``spec``: groups, steps, outer_dtype, kill ({"member", "step", "where":
    inside|hang|idle}: inside/hang -- the exchange issued at that inner step; idle -- before that inner step), rejoin
    (the inner step before which member 0 lets the replacement group in and waits for its generation)."""
    groups, steps = spec["groups"], spec["steps"]
    member = ctx.rank
    joiner = member >= groups
    if joiner:
        ctx.store.wait(["down"], timedelta(seconds=60))
    model = _Model()
    algos: list[StreamingDiLoCo] = []
    ft = _ft(ctx, addr, token, algos)
    if joiner:
        ctx.store.set("registered", "1")
    sd = StreamingDiLoCo(ft, model, StreamingDiLoCoConfig(**_FT_CFG, outer_dtype=spec["outer_dtype"]),
                         blocks=list(model.ws))
    algos.append(sd)
    out: dict[str, Any] = {"member": member, "statuses": []}
    if member == 0 and spec.get("rejoin"):
        def on_reconfigure(info: Any) -> None:
            if info.joiners and member not in info.joiners:  # the donor: what it just sent
                out["sent"] = _snapshot(sd)
        ft.on_reconfigure(on_reconfigure)
    if joiner:
        ft.join()
        out["received"] = _snapshot(sd)
    sd.join()
    if joiner:
        out["joined_at"] = sd.inner_steps
        out["joined_in_flight"] = sd.in_flight
    kill = spec.get("kill")
    survivors = [m for m in range(groups) if not kill or m != kill["member"]]
    inner = torch.optim.SGD(model.parameters(), lr=LR_IN)
    syncs = []
    try:
        while sd.inner_steps < steps:
            n = sd.inner_steps + 1
            if kill and n == kill["step"]:
                if kill["where"] == "idle" and member == kill["member"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                if kill["where"] != "idle":
                    _arm(ctx, ft, kill, member, survivors, out["statuses"])
            if member == 0 and spec.get("rejoin") == n:
                ctx.store.set("down", "1")
                ctx.store.wait(["registered"], timedelta(seconds=60))
                deadline = time.monotonic() + 30
                while ft._newest_gen <= ft.generation:  # the grown generation is announced: entered at the issue
                    if time.monotonic() > deadline:
                        raise RuntimeError("no grown generation announced within 30 s")
                    time.sleep(0.01)
            model([_coef(member, n, j) for j in range(N_PARAMS)]).backward()
            inner.step()
            inner.zero_grad()
            rec = sd.step()
            if rec is not None:
                syncs.append(rec)
                if kill and kill["where"] == "hang" and member == 0 and rec.issued_at == kill["step"]:
                    os.kill(int(ctx.store.get("hung_pid")), signal.SIGCONT)  # redone and committed: resume it
        rec = sd.drain()
        if rec is not None:
            syncs.append(rec)
    except MembershipError as exc:  # the hung member, resumed: the others went on without it
        ft.close()
        out.update(removed=f"{type(exc).__name__}: {exc}", params=[p.detach().numpy().copy() for p in model.parameters()])
        return out
    ft.finish()
    out.update(params=[p.detach().numpy().copy() for p in model.parameters()],
               globals=[g.numpy().copy() for g in sd.global_params], syncs=syncs, step_count=ft.step_count)
    return out


def _arm(ctx: RankContext, ft: FaultTolerant, kill: dict[str, Any], member: int, survivors: list[int],
         statuses: list[str]) -> None:
    """Hooks on this generation's communicator for the exchange issued at this inner step. Survivors record how
    their exchange ops ended and tell the store once they issued them (``in/<m>``); the doomed member, from the pre
    hook of its first exchange op -- once every survivor's is in flight (they went on with their inner steps) --
    is SIGKILLed (``inside``) or SIGSTOPped (``hang``: removed after the heartbeat timeout; member 0 resumes it
    once the redone synchronization committed)."""
    if member != kill["member"]:
        def pre(info: Any) -> None:
            if info.op in _EXCHANGE:
                ctx.store.set(f"in/{member}", "1")

        def post(a: Any) -> None:
            if a.info.op in _EXCHANGE:
                statuses.append(a.status.name)

        ft.register_pre_hook(pre)
        ft.register_post_hook(post)
        return
    fired: list[int] = []

    def doom(info: Any) -> None:
        if info.op in _EXCHANGE and not fired:
            fired.append(1)
            ctx.store.wait([f"in/{m}" for m in survivors], timedelta(seconds=30))
            time.sleep(0.05)
            if kill["where"] == "hang":
                ctx.store.set("hung_pid", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(os.getpid(), signal.SIGKILL)

    ft.register_pre_hook(doom)


def _ft_run(groups: int, spec: dict[str, Any], *, extra: int = 0, allow_exit: tuple[int, ...] = (),
            grow_timeout_s: float = 30.0) -> list[Any]:
    cfg = MembershipConfig(min_size=1, initial_size=groups, grow_timeout_s=grow_timeout_s, **_PATIENT)
    with Coordinator(CoordinatorConfig(membership=cfg)) as coord:
        return run_ranks(_ft_member, groups + extra, args=(coord.address, coord.token, {"groups": groups, **spec}),
                         timeout=120, allow_exit=allow_exit)


@pytest.mark.slow
@pytest.mark.parametrize(("where", "outer_dtype"), [("inside", "fp32"), ("inside", "mxfp4"), ("hang", "fp32")])
def test_group_lost_during_the_overlapped_exchange_is_redone_with_the_live_groups(where: str, outer_dtype: str) -> None:
    """Member 2 is SIGKILLed -- or SIGSTOPped -- inside the exchange issued at inner step 4 (fragment 1), after the
    other two issued theirs and went on training. At step 5, where it is due, it cannot commit; the survivors apply
    nothing of it and redo it at once with the two live groups, from the pseudo-gradients taken at step 4. A hung
    member, resumed afterwards, learns it was removed."""
    steps = 9
    res = _ft_run(3, {"steps": steps, "outer_dtype": outer_dtype, "kill": {"member": 2, "step": 4, "where": where}},
                  allow_exit=(2,))
    if where == "hang":
        assert "removed" in res[2]["removed"], res[2]
    else:
        assert isinstance(res[2], RankExited)
    average = None if outer_dtype == "fp32" else _dequantized_mean(outer_dtype, _FT_FRAGS)
    traj, theta_g = reference(3, steps, sync_every=4, fragments=_FT_FRAGS, delay=1, alpha=0.5, average=average,
                              contributors=lambda n: [0, 1, 2] if n < 4 else [0, 1])
    for r in res[:2]:
        assert r["statuses"] and "COMPLETED" not in r["statuses"], r["statuses"]  # the first attempt was cut short
        syncs = r["syncs"]
        assert [s.issued_at for s in syncs] == [2, 4, 6, 8] and [s.contributors for s in syncs] == [3, 2, 2, 2]
        assert syncs[1].attempts >= 2 and syncs[1].applied_at == 5 and syncs[1].generation > 1, syncs[1]
        assert _bits(r["params"]) == _bits(traj[-1][r["member"]]), f"member {r['member']}: a partial or lost outer step"
        assert _bits(r["globals"]) == _bits(theta_g)


@pytest.mark.slow
def test_joiner_mid_fragment_receives_every_fragments_global_copy_and_outer_state() -> None:
    """Group 1 dies before inner step 4 (nothing in flight: the exchange of step 2 was applied at step 3); group 0
    goes on alone; a replacement group (member 2) is healed at the
    issue of step 6 (fragment 0, due at step 7): it receives both fragments' global copies and momentum, the schedule's
    position, and takes part in the overlapped exchange under way (zeros, not counted), then contributes."""
    steps = 11
    res = _ft_run(2, {"steps": steps, "outer_dtype": "fp32", "rejoin": 6,
                      "kill": {"member": 1, "step": 4, "where": "idle"}},
                  extra=1, allow_exit=(1,), grow_timeout_s=0.3)
    assert isinstance(res[1], RankExited)
    donor, joiner = res[0], res[2]
    sent, got = donor["sent"], joiner["received"]
    assert got["inner_steps"] == sent["inner_steps"] == 6 and got["outer_steps"] == sent["outer_steps"] == (1, 1)
    assert _bits(got["global"]) == _bits(sent["global"])
    assert [len(m) for m in got["momentum"]] == [2, 2], "an outer optimizer's momentum was not healed"
    for a, b in zip(got["momentum"], sent["momentum"], strict=True):
        assert _bits(a) == _bits(b)
    assert joiner["joined_at"] == 6 and joiner["joined_in_flight"] == 0
    traj, theta_g = reference(3, steps, sync_every=4, fragments=_FT_FRAGS, delay=1, alpha=0.5,
                              contributors=lambda n: [0, 1] if n < 4 else [0] if n <= 6 else [0, 2], joins={2: 6})
    for r in (donor, joiner):
        assert _bits(r["params"]) == _bits(traj[-1][r["member"]]), f"member {r['member']} differs from the reference"
        assert _bits(r["globals"]) == _bits(theta_g)
    assert [s.contributors for s in joiner["syncs"]] == [1, 2, 2]
    assert [(s.issued_at, s.contributors) for s in donor["syncs"]] == [(2, 2), (4, 1), (6, 1), (8, 2), (10, 2)]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sync_every": 0}, "sync_every must be an int >= 1"),
    ({"sync_every": 4, "num_fragments": 0}, "num_fragments must be an int >= 1"),
    ({"sync_every": 6, "num_fragments": 4}, "must be a multiple of num_fragments=4"),
    ({"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 2}, r"fragment_sync_delay must be an int in \[0, "),
    ({"sync_every": 4, "fragment_sync_delay": -1}, "fragment_sync_delay must be an int"),
    ({"sync_every": 4, "fragment_update_alpha": 1.5}, r"fragment_update_alpha must be a number in \[0, 1\]"),
    ({"sync_every": 4, "fragment_pattern": "random"}, "fragment_pattern must be one of"),
    ({"sync_every": 4, "outer_dtype": "int4"}, "unknown outer_dtype 'int4'"),
    ({"sync_every": 4, "outer_lr": -1.0}, "StreamingDiLoCoConfig.outer_lr must be a finite number > 0"),
])
def test_bad_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StreamingDiLoCoConfig(**kwargs)


def test_bad_blocks_name_what_is_wrong() -> None:
    cfg = StreamingDiLoCoConfig(sync_every=4, num_fragments=2)
    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=1, initial_size=1))) as coord:
        holder: list[StreamingDiLoCo] = []
        ft = FaultTolerant(FaultTolerantConfig(coordinator=coord.address, token=coord.token),
                           state_dict=lambda: holder[0].state_dict(),
                           load_state_dict=lambda s: holder[0].load_state_dict(s), join=False)
        try:
            model = _Model()
            with pytest.raises(ValueError, match=r"parameters \[3\] of model are in no block"):
                StreamingDiLoCo(ft, model, cfg, blocks=list(model.ws)[:3])
            with pytest.raises(ValueError, match=r"parameter 0 \(\(3, 4\)\) is in two blocks"):
                StreamingDiLoCo(ft, model, cfg, blocks=[model.ws[0], *model.ws])
            with pytest.raises(ValueError, match="not among model's parameters"):
                StreamingDiLoCo(ft, model, cfg, blocks=[nn.Linear(2, 2), *model.ws])
            with pytest.raises(ValueError, match="2 blocks cannot make num_fragments=4"):
                StreamingDiLoCo(ft, list(model.ws)[:2], StreamingDiLoCoConfig(sync_every=4, num_fragments=4))
            with pytest.raises(TypeError, match="config must be a StreamingDiLoCoConfig"):
                StreamingDiLoCo(ft, model, DiLoCoConfig(sync_every=2))  # type: ignore[arg-type]
            sd = StreamingDiLoCo(ft, model, cfg)
            holder.append(sd)
            with pytest.raises(RuntimeError, match=r"StreamingDiLoCo.step\(\) before join\(\)"):
                sd.step()
            with pytest.raises(ValueError, match="not a StreamingDiLoCo state"):
                sd.load_state_dict({"kind": "diloco"})
            sd.join()
            assert [sd.step() for _ in range(4)][1::2] != [None, None] and sd.outer_steps == (1, 1)
            assert ft.step_count == 2
            ft.finish()
        finally:
            ft.close()
