"""One rank of the demo: fault-tolerant training of the MoE language model with torch's FSDP2 or DDP.

Run by ``torchnext demo`` (which launches the ranks and hosts the coordinator), or by hand / torchrun against a
separately started coordinator -- one torchrun job per replica group (HSDP: the group's ranks shard the model)::

    torchnext coordinator --host 127.0.0.1 --port 29400 --min-size 1 --initial-size 2 &   # prints the job token
    export TORCHNEXT_FT_COORDINATOR=127.0.0.1:29400 TORCHNEXT_FT_TOKEN=<token>
    TORCHNEXT_FT_REPLICA_GROUP=0 torchrun --nproc-per-node 2 --master-port 29501 -m torchnext.demo.train &
    TORCHNEXT_FT_REPLICA_GROUP=1 torchrun --nproc-per-node 2 --master-port 29502 -m torchnext.demo.train

Parallelism (``--parallel``):

* ``hsdp`` (default): FSDP2 ``fully_shard`` over :func:`torchnext.ft.device_mesh` -- parameters, gradients and
  AdamW state sharded inside the replica group (its own ``init_process_group(backend="torchnext")``), gradient
  shards averaged across the live replica groups by the fault-tolerant process group. A joining group heals shard
  by shard from a live group.
* ``ddp``: :class:`torchnext.ft.DistributedDataParallel` -- every rank its own replica group.
* ``diloco``: :class:`torchnext.ft.DiLoCo` -- inner FSDP2 steps over the replica group's own ranks (no traffic
  across groups), an outer synchronization across the live groups every ``--sync-every`` steps (the reported
  loss between synchronizations is the group's own). The healed state is the inner shards plus DiLoCo's.

A step is forward/backward on this rank's data shard (the global batch is deterministic per step: shard
``group_index * group_size + group_rank`` of ``groups * group_size``), then a two-phase commit, then the optimizer
step -- only when every current member finished the step. A failed collective inside DDP's or FSDP's hooks is
recorded by the fault-tolerant group, never raised out of backward: the step does not commit, the group
reconfigures, the loop retries. A rank whose replica group was removed (a sibling died or hung) reports
``removed`` and exits cleanly. Progress goes to stdout as JSON lines that the launcher reads; the final line
carries a checksum of this rank's shards and optimizer state (diloco: of what the groups share after a
synchronization) -- counterparts in every replica group must match.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["Parallel", "TrainConfig", "main", "state_digest", "train"]


class Parallel(str, enum.Enum):
    """How the demo parallelizes (module docstring)."""

    HSDP = "hsdp"
    DDP = "ddp"
    DILOCO = "diloco"
    STREAMING_DILOCO = "streaming-diloco"


_OUTER = (Parallel.DILOCO, Parallel.STREAMING_DILOCO)  # inner steps inside the group, outer synchronizations across


@dataclass(kw_only=True)
class TrainConfig:
    """What one rank trains."""

    steps: int = 200
    """Committed steps to train."""
    precision: str = "nvfp4"
    """Weight precision: nvfp4, mxfp8, bf16, fp32."""
    batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 64
    """Characters per sequence."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the model initialisation and of the data stream."""
    out: str = "./torchnext-demo"
    """Output folder (Flight Recorder dumps go to ``<out>/fr``)."""
    min_size: int = 1
    """Fewest replica groups the job accepts."""
    member_id: int | None = None
    """Stable member id to ask the coordinator for (None: assigned)."""
    lowp_backend: str = "eager"
    """``torchnext.lowp.mm.scaled_mm`` backend."""
    standby: bool = False
    """Warm spare: build everything, then wait for a line on stdin before joining the group."""
    parallel: str = "hsdp"
    """``hsdp``, ``ddp`` or ``diloco`` (:class:`Parallel`)."""
    replica_group: int | None = None
    """hsdp/diloco: this rank's replica group (None: ``TORCHNEXT_FT_REPLICA_GROUP``). ddp: unused (every rank is
    its own replica group)."""
    group_rank: int | None = None
    """hsdp/diloco: rank inside the replica group (None: torchrun's ``RANK``)."""
    group_size: int | None = None
    """hsdp/diloco: ranks per replica group (None: torchrun's ``WORLD_SIZE``)."""
    incarnation: int = 0
    """hsdp/diloco: how many times this replica group was restarted (its process group rendezvous under a fresh
    store prefix each time)."""
    store: str | None = None
    """hsdp/diloco: ``host:port`` of a TCPStore (the coordinator's) where the replica group's own process group
    rendezvous under ``demo/g<group>/i<incarnation>``; None: torchrun's ``env://`` rendezvous."""
    sync_every: int = 10
    """diloco: inner steps between outer synchronizations; streaming-diloco: between two of one fragment."""
    fragments: int = 2
    """streaming-diloco: fragments (``sync_every`` must be a multiple), blocks assigned strided; the exchange
    overlaps one inner step (tau = 1, alpha = 0.5) when they are more than one step apart."""
    outer_dtype: str = "fp32"
    """streaming-diloco: wire format of the outer gradients (fp32, bf16, mxfp8, mxfp4, nvfp4)."""

    def __post_init__(self) -> None:
        try:
            self.parallel = Parallel(self.parallel).value
        except ValueError:
            raise ValueError(f"TrainConfig.parallel must be one of {[p.value for p in Parallel]}, got "
                             f"{self.parallel!r}") from None
        for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("min_size", 1), ("sync_every", 1),
                          ("incarnation", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TrainConfig.{name} must be an int >= {low}, got {v!r}")
        if self.store is not None:
            host, _, port = self.store.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"TrainConfig.store must be host:port, got {self.store!r}")


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _resources() -> dict[str, int]:
    """This process's live threads and open file descriptors (``/proc/self``; -1 where there is no ``/proc``): the
    launcher compares a long-lived rank's counts at its first and last step (growth = a leak per fault)."""
    counts: dict[str, int] = {}
    for key, sub in (("threads", "task"), ("fds", "fd")):
        try:
            counts[key] = len(os.listdir(f"/proc/self/{sub}"))
        except OSError:
            counts[key] = -1
    return counts


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().reshape(-1)  # 0-d tensors too
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _shard_group(cfg: TrainConfig) -> tuple[int, int, int]:
    """hsdp/diloco: join this replica group's own torchnext process group; returns (replica group, rank, size)."""
    import torch.distributed as dist

    from torchnext._config import env_config

    group = cfg.replica_group if cfg.replica_group is not None else env_config().ft_replica_group
    if group < 0:
        raise ValueError(f"--parallel {cfg.parallel}: no replica group: pass --replica-group or set "
                         "TORCHNEXT_FT_REPLICA_GROUP (one torchrun job per replica group)")
    timeout = timedelta(seconds=60)
    if cfg.store is None:
        dist.init_process_group("torchnext", timeout=timeout)  # torchrun's env:// rendezvous
    else:
        if cfg.group_rank is None or cfg.group_size is None:
            raise ValueError("--store needs --group-rank and --group-size")
        if not 0 <= cfg.group_rank < cfg.group_size:
            raise ValueError(f"--group-rank {cfg.group_rank} must be in [0, --group-size {cfg.group_size})")
        host, _, port = cfg.store.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group("torchnext", store=dist.PrefixStore(f"demo/g{group}/i{cfg.incarnation}", store),
                                rank=cfg.group_rank, world_size=cfg.group_size, timeout=timeout)
    return group, dist.get_rank(), dist.get_world_size()


def _shard_communicator() -> Any:
    """The Communicator behind the default (shard) process group, or None."""
    import torch.distributed as dist

    from torchnext.comms.process_group import TorchnextProcessGroup

    world = dist.group.WORLD
    return world.communicator("cpu") if isinstance(world, TorchnextProcessGroup) else None


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train until ``cfg.steps`` steps are committed; return this rank's final report. A rank whose replica group
    was removed (a sibling died or hung) emits ``removed`` and returns (``"removed": True``)."""
    import torch.distributed as dist

    from torchnext.comms import CommError, FlightRecorder
    from torchnext.demo.data import VOCAB
    from torchnext.demo.model import ModelConfig, MoETransformerLM, Precision
    from torchnext.ft import FaultTolerant, FaultTolerantConfig, MembershipError, Reconfiguration
    from torchnext.ft.state import load_sharded_state, sharded_state

    parallel = Parallel(cfg.parallel)
    if parallel in _OUTER:
        _require_diloco()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    model = MoETransformerLM(
        ModelConfig(vocab_size=len(VOCAB), precision=Precision(cfg.precision), lowp_backend=cfg.lowp_backend,
                    max_seq_len=max(128, cfg.seq_len))
    )
    fr_dir = Path(cfg.out) / "fr"
    fr_dir.mkdir(parents=True, exist_ok=True)
    sharded = parallel is not Parallel.DDP
    # a warm spare rendezvous with its group's other spares now: only joining the job waits for the wake-up
    group, group_rank, group_size = _shard_group(cfg) if sharded else (None, 0, 1)
    if cfg.standby:
        _warm_up(model, parallel)  # what joining would otherwise spend seconds on, before the wake-up
        _emit("standby", member=cfg.member_id, pid=os.getpid())
        if not sys.stdin.readline():
            _emit("standby_cancelled", member=cfg.member_id)
            _destroy(sharded)
            return {"member": cfg.member_id, "steps": 0, "cancelled": True}
    opts: list[torch.optim.Optimizer] = []  # created after sharding (FSDP2 swaps in DTensor parameters)
    outer: list[Any] = []  # diloco: the DiLoCo (built after sharding, before joining)

    def state_dict() -> Any:
        state = sharded_state(model, *opts)
        return {"local": state, "diloco": outer[0].state_dict()} if outer else state

    def load_state_dict(s: Any) -> None:
        if outer:  # the inner state first: DiLoCo then sets the local parameters to the healed global copy
            load_sharded_state(s["local"], model, *opts)
            outer[0].load_state_dict(s["diloco"])
        else:
            load_sharded_state(s, model, *opts)

    ft: Any = None
    recorder: list[FlightRecorder] = []
    report: dict[str, Any] = {"member": cfg.member_id, "group": group, "group_rank": group_rank}
    t_start = time.monotonic()
    try:
        ft = FaultTolerant(
            FaultTolerantConfig(min_size=cfg.min_size, member_id=cfg.member_id, replica_group=group,
                                group_rank=group_rank if sharded else None,
                                group_size=group_size if sharded else None),
            state_dict=state_dict, load_state_dict=load_state_dict, join=False,
        )
        report["member"] = ft.member_id

        def on_reconfigure(r: Reconfiguration) -> None:
            if not recorder:
                recorder.append(FlightRecorder.attach(ft.comm, capacity=2000, dump_dir=fr_dir,
                                                      generation=r.generation))
            else:
                recorder[0].add_communicator(ft.comm, generation=r.generation)
            _emit("reconfigured", member=ft.member_id, generation=r.generation, members=list(r.members),
                  groups=[list(g) for g in r.groups], size=r.size, step=r.step, reason=r.reason,
                  joiners=list(r.joiners), timings=r.timings, healed=None if r.healed is None else asdict(r.healed))

        ft.on_reconfigure(on_reconfigure)
        if parallel is Parallel.HSDP:
            from torchnext.ft import device_mesh

            net = _fully_shard(model, device_mesh(ft, ("replicate", "shard")))
        elif parallel in _OUTER:
            from torch.distributed.device_mesh import DeviceMesh

            # inner steps shard over this replica group's own ranks only (ft.device_mesh would all-reduce the
            # gradients across the groups every step: HSDP, what DiLoCo exists to avoid)
            net = _fully_shard(model, DeviceMesh.from_group(dist.group.WORLD, "cpu"))  # type: ignore[arg-type]
            ft.register_local_group(dist.group.WORLD)  # a rank blocked on a dead sibling is released
        else:
            from torchnext.ft import DistributedDataParallel

            net = DistributedDataParallel(model, ft, find_unused_parameters=True)  # top-1 routing: unused experts
        opts.append(torch.optim.AdamW(model.parameters(), lr=cfg.lr))
        loop = _Loop(cfg, ft, model, net, opts[0], group_rank, group_size)
        if parallel is Parallel.DILOCO:
            from torchnext.ft import DiLoCo, DiLoCoConfig

            outer.append(DiLoCo(ft, model, DiLoCoConfig(sync_every=cfg.sync_every)))
            outer[0].join()
        elif parallel is Parallel.STREAMING_DILOCO:
            outer.append(_streaming(ft, model, cfg))
            outer[0].join()
        else:
            ft.join()
        first = ft.reconfigurations[-1] if ft.reconfigurations else None
        _emit("joined", member=ft.member_id, group=ft.replica_group, group_rank=group_rank, session=ft.session,
              generation=ft.generation, size=ft.size, step=loop.step_no(outer), pid=os.getpid(),
              healed=None if first is None or first.healed is None else asdict(first.healed))
        t_start = time.monotonic()
        if parallel is Parallel.STREAMING_DILOCO:
            loop.run_streaming(outer[0])
        elif outer:
            loop.run_diloco(outer[0])
        else:
            loop.run()
    except (MembershipError, CommError) as exc:
        # this replica group is out: a sibling died or hung, or this rank hung and was removed; diloco: an inner
        # step's collective on the group's own ranks failed (inner steps run outside any ft.step()) -- the group
        # cannot go on. Elsewhere a CommError outside ft.step() is unexpected: let it crash the rank.
        if isinstance(exc, CommError) and not isinstance(exc, MembershipError) and not outer:
            if ft is not None:
                ft.close()
            _destroy(sharded)
            raise
        _emit("removed", member=report["member"], group=group, error=f"{type(exc).__name__}: {exc}")
        report.update(removed=True, error=f"{type(exc).__name__}: {exc}")
        if ft is not None:
            ft.close()
        _destroy(sharded)
        return report
    except BaseException:
        if ft is not None:
            ft.close()
        _destroy(sharded)
        raise
    if recorder:
        recorder[0].dump(fr_dir, format="json", reason="end")
        recorder[0].dump(fr_dir, format="pickle", reason="end")
        recorder[0].detach()  # the end dumps stand: finishing closes (aborts) the communicator, not a failure
    if sharded:
        _dump_shard_group(Path(cfg.out) / "fr_shard" / f"g{group}.i{cfg.incarnation}")
    # hsdp/ddp: parameters + AdamW state; diloco: what the groups share after a synchronization (parameters, the
    # global copy, the outer optimizer) -- each group's inner AdamW state is its own
    shared = state_dict() if not outer else {"model": sharded_state(model)["model"], "optim": [],
                                             "diloco": outer[0].state_dict()}
    # ``lowp_step`` counts this step's forward calls of a low-precision layer (set_lowp_step resets it at every
    # step): an expert's count depends on how many of this rank's sequences chose it -- not state that persists
    shared["model"] = {k: v for k, v in shared["model"].items() if not k.endswith(".lowp_step")}
    report.update(member=ft.member_id, rank=ft.rank, group=ft.replica_group, group_rank=group_rank,
                  generation=ft.generation, steps=loop.step_no(outer), digest=state_digest(shared),
                  digest_parts={k: state_digest(v) for k, v in shared.items()},
                  wall_s=time.monotonic() - t_start, **_resources())
    _emit("done", **report)
    # Every member committed the last step. finish() tells the coordinator the job is over, so members leave in any
    # order and no departure is taken for a failure (no final barrier needed).
    ft.finish()
    _destroy(sharded)
    return report


class _Loop:
    """The training loops: one fault-tolerant step per training step (hsdp, ddp), or inner steps with an outer
    synchronization every ``sync_every`` (diloco)."""

    def __init__(self, cfg: TrainConfig, ft: Any, model: Any, net: Any, opt: torch.optim.Optimizer, group_rank: int,
                 group_size: int) -> None:
        import torch.distributed as dist

        self.cfg, self.ft, self.model, self.net, self.opt = cfg, ft, model, net, opt
        self.group_rank, self.group_size = group_rank, group_size
        self.shard_pg = dist.group.WORLD if dist.is_initialized() and group_size > 1 else None
        self.t_start = time.monotonic()
        self.tokens = 0

    def step_no(self, outer: list[Any]) -> int:
        """Training steps done: committed steps, or (diloco) synchronizations x sync_every + inner steps since."""
        if outer and isinstance(outer[0].outer_steps, tuple):  # streaming-diloco: the schedule's position
            return int(outer[0].inner_steps)
        if outer:
            return int(outer[0].outer_steps * self.cfg.sync_every + outer[0].inner_steps)
        return int(self.ft.step_count)

    def _forward_backward(self, step_no: int) -> torch.Tensor:
        """This rank's loss at ``step_no`` (backward done); returns the LM loss averaged over the replica group."""
        import torch.distributed as dist

        from torchnext.demo.data import batch_for_step

        ft, cfg = self.ft, self.cfg
        x, y = batch_for_step(step_no, seed=cfg.seed, shard=ft.rank * self.group_size + self.group_rank,
                              num_shards=ft.size * self.group_size, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        self.opt.zero_grad(set_to_none=True)  # every attempt: a failed one may have left gradients
        loss, lm = self.model.loss(x, y, step=step_no, forward=self.net)
        loss.backward()
        stat = torch.tensor([lm])
        if self.shard_pg is not None:
            dist.all_reduce(stat, op=dist.ReduceOp.AVG, group=self.shard_pg)
        return stat

    def _emit_step(self, step: int, loss: float, t0: float, **extra: Any) -> None:
        ft = self.ft
        self.tokens += self.cfg.batch_size * self.cfg.seq_len * ft.size * self.group_size
        _emit("step", member=ft.member_id, step=step, loss=loss, size=ft.size, generation=ft.generation,
              step_s=time.monotonic() - t0, tokens_per_s=self.tokens / max(time.monotonic() - self.t_start, 1e-9),
              **_resources(), **extra)

    def run(self) -> None:
        from torchnext.comms import ReduceOp

        ft = self.ft
        while ft.step_count < self.cfg.steps:
            step_no = ft.step_count
            t0 = time.monotonic()
            with ft.step() as step:
                stat = self._forward_backward(step_no)
                ft.all_reduce(stat, ReduceOp.AVG)  # the mean over every rank of every live replica group
                if step.commit():
                    self.opt.step()
                    self._emit_step(ft.step_count, float(stat), t0)
            if step.error is not None:
                _emit("step_failed", member=ft.member_id, step=step_no,
                      error=f"{type(step.error).__name__}: {step.error}")

    def run_diloco(self, algo: Any) -> None:
        """Inner steps (the reported loss is this replica group's: inner steps do not talk across groups); every
        ``sync_every``-th ends with the outer synchronization, and the last partial interval is synchronized too,
        so that every group ends on the same global copy."""
        while (step_no := self.step_no([algo])) < self.cfg.steps:
            t0 = time.monotonic()
            stat = self._forward_backward(step_no)
            self.opt.step()
            synced = algo.step()
            if not synced and step_no + 1 == self.cfg.steps:
                algo.sync()
                synced = True
            self._emit_step(step_no + 1, float(stat), t0, synced=synced, outer_steps=algo.outer_steps)

    def run_streaming(self, algo: Any) -> None:
        """Inner steps; each ``step()`` issues or completes a fragment's synchronization (overlapped). After the
        last one, the synchronization in flight is completed and every group adopts the global copy, so that the
        groups end on the same parameters (with alpha > 0 the local parameters are a mix until then)."""
        from torchnext.ft.state import local

        while (step_no := self.step_no([algo])) < self.cfg.steps:
            t0 = time.monotonic()
            stat = self._forward_backward(step_no)
            self.opt.step()
            rec = algo.step()
            if step_no + 1 == self.cfg.steps:
                rec = algo.drain() or rec
                with torch.no_grad():
                    for p, g in zip(self.model.parameters(), algo.global_params, strict=True):
                        local(p.detach()).copy_(g)
            self._emit_step(step_no + 1, float(stat), t0, synced=rec is not None, outer_steps=list(algo.outer_steps),
                            fragment=None if rec is None else rec.fragment,
                            outer_bytes=None if rec is None else rec.payload_bytes)


def _streaming(ft: Any, model: Any, cfg: TrainConfig) -> Any:
    """The demo's StreamingDiLoCo: the embeddings, each transformer block and the head are the blocks."""
    from torchnext.ft import StreamingDiLoCo, StreamingDiLoCoConfig

    spacing = cfg.sync_every // cfg.fragments if cfg.sync_every % cfg.fragments == 0 else 0
    config = StreamingDiLoCoConfig(sync_every=cfg.sync_every, num_fragments=cfg.fragments, outer_dtype=cfg.outer_dtype,
                                   fragment_sync_delay=1 if spacing > 1 else 0,
                                   fragment_update_alpha=0.5 if spacing > 1 else 0.0)
    return StreamingDiLoCo(ft, model, config, blocks=[model.tok, model.pos, *model.blocks, model.ln_f, model.head])


def _warm_up(model: torch.nn.Module, parallel: Parallel) -> None:
    """A warm spare's preparation: the imports FaultTolerant, FSDP2, DiLoCo and the optimizer make on first use
    (``torch._dynamo`` alone takes seconds on a loaded machine) and one forward of the model (the low-precision
    kernels' first-use work), so that a woken spare reaches the coordinator, and its first step, at once."""
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor

    import torchnext.ft

    if parallel in _OUTER:
        import torchnext.ft.diloco  # noqa: F401
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).step()  # the optimizer's lazy imports
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.int64))


def _require_diloco() -> None:
    import importlib.util

    if importlib.util.find_spec("torchnext.ft.diloco") is None:
        raise ValueError("--parallel diloco is not available in this build (torchnext.ft.diloco is missing); use "
                         "--parallel hsdp or --parallel ddp")


def state_digest(obj: Any) -> str:
    """SHA-256 of a state -- nested dicts/lists of tensors and plain values (a
    :func:`~torchnext.ft.state.sharded_state`: this rank's shards and optimizer state), dict keys sorted, tensors by
    their bytes -- so equal digests mean bitwise-equal local state."""
    h = hashlib.sha256()

    def walk(o: Any, path: str) -> None:
        if isinstance(o, torch.Tensor):
            h.update(path.encode())
            h.update(_bytes(o))
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                walk(o[k], f"{path}.{k}")
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{path}[{i}]")
        else:
            h.update(f"{path}={o!r}".encode())

    walk(obj, "")
    return h.hexdigest()


def _fully_shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2 over ``mesh``: each block, then the root (hsdp: ``ft.device_mesh`` -- replicate = the fault-tolerant
    group, shard = this replica group's process group; diloco: the replica group's own ranks)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not isinstance(model, FSDPModule):  # pragma: no cover - fully_shard always swaps the class
        raise TypeError("fully_shard did not make the model an FSDPModule")
    # Top-1 routing leaves experts unused on some ranks: without this FSDP2 leaves their gradients out of the
    # block's reduce-scatter, whose sizes then differ between the ranks (gloo aborts the process: "Received data
    # size doesn't match expected size").
    model.set_reduce_scatter_unused_params(True)
    return model


def _dump_shard_group(folder: Path) -> None:
    """Write the shard group's Flight Recorder (the process recorder torch's groups use) to ``folder``."""
    comm = _shard_communicator()
    rec = None if comm is None else comm.extensions.get("flight_recorder")
    if rec is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    rec.dump(folder, format="json", reason="end")


def _destroy(sharded: bool) -> None:
    import torch.distributed as dist

    if sharded and dist.is_initialized():
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchnext.demo.train", description=(__doc__ or "").split("\n\n")[0])
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--precision", choices=["nvfp4", "mxfp8", "bf16", "fp32"], default=d.precision)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--min-size", type=int, default=d.min_size)
    p.add_argument("--member-id", type=int, default=None)
    p.add_argument("--lowp-backend", default=d.lowp_backend)
    p.add_argument("--standby", action="store_true", help="warm spare: join when a line arrives on stdin")
    p.add_argument("--parallel", choices=[x.value for x in Parallel], default=d.parallel)
    p.add_argument("--replica-group", type=int, default=None)
    p.add_argument("--group-rank", type=int, default=None)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--incarnation", type=int, default=d.incarnation)
    p.add_argument("--store", default=None, help="host:port of the TCPStore the replica group rendezvous at")
    p.add_argument("--sync-every", type=int, default=d.sync_every)
    p.add_argument("--fragments", type=int, default=d.fragments)
    p.add_argument("--outer-dtype", default=d.outer_dtype)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
    train(cfg)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
