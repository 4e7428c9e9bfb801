"""torchtitan's trainer, fault tolerant on :mod:`torchnext.ft` (in place of torchtitan's torchft experiment).

One ``torchnext run`` job per replica group (the failure domain), each with ``TORCHNEXT_FT_REPLICA_GROUP=<g>``, and
one coordinator for the job (``torchnext coordinator``; members read ``TORCHNEXT_FT_COORDINATOR`` and
``TORCHNEXT_FT_TOKEN``)::

    torchnext coordinator --port 29400 &                  # prints the token; or export TORCHNEXT_FT_TOKEN first
    TORCHNEXT_FT_REPLICA_GROUP=0 torchnext run --nproc-per-node 2 -m torchtitan.train \\
        --module torchnext.integrations.torchtitan --config llama3_debugmodel_torchnext_ft \\
        --fault_tolerance.replica_groups 2
    TORCHNEXT_FT_REPLICA_GROUP=1 torchnext run --nproc-per-node 2 --max-restarts 3 -m torchtitan.train ...  # idem

Semantics of a training step of :class:`FaultTolerantTrainer` (torchtitan's ``train_step`` unchanged inside)::

    while True:                                         # attempts at step ft.step_count + 1
        with ft.step() as attempt:                      # enters a pending generation first: rebuild, heal joiners
            catch up: trainer.step = ft.step_count + 1; skip this group's batches of the committed steps not yet
                      read (a healed joiner); lr schedulers to ft.step_count
            FSDP2's gradient divide factor = live replica groups (ft.size)
            Trainer.train_step(the same batches on every attempt of a step)
                # FSDP2 over ft.device_mesh(("dp_replicate", "fsdp")): reduce-scatter inside the group,
                # all-reduce across the live groups on ft.process_group
                # optimizers.step() and lr_schedulers.step() run only if attempt.commit() (two-phase commit)
        if attempt.committed: return                    # else: a group died or joined; retry with the same batches

Each replica group reads its own shard of the data: dp_world_size = replica_groups x the group's data-parallel
degree, dp_rank = group x that degree + the rank's. A group that is killed and restarted (``--max-restarts`` of its
launcher) joins again, is healed -- rank r of the group receives rank r's parameter and optimizer shards from rank r
of a live group (:func:`torchnext.ft.state.sharded_state`) -- and trains on from the committed step. What a
``torchft.Manager`` + ``torchft.Optimizer`` + ``ManagedProcessGroup`` do in torchtitan's experiment is this class's
``ft`` (quorum, commit, healing), its commit gate on the optimizers, and ``ft.process_group`` in the mesh.

Semi-synchronous training (``--fault_tolerance.semi_sync_method diloco`` or ``local_sgd``, what torchtitan's
experiment gets from ``torchft.local_sgd``; :mod:`~torchnext.integrations.torchtitan.semi_sync`): FSDP2 shards the
model over the group's own ranks (torchtitan's mesh, not ``ft.device_mesh``), inner steps never touch ``ft``, and
every ``sync_steps`` steps the groups synchronize::

    Trainer.train_step(batches)                     # inner step: forward, backward, clip, AdamW -- inside the group
    semi.step(step)                                 # every sync_steps-th: a fault-tolerant step of its own:
        # pseudo-gradients global - local, averaged over the groups that trained since their last sync, outer
        # Nesterov SGD on the global copy, local := global (DiLoCo); local := mean of the groups' (LocalSGD);
        # with fragments: fragment p every sync_steps steps, staggered, overlapped with fragment_sync_delay steps
    after the last step: the fragment synchronization still in flight

A group killed meanwhile is noticed at the next synchronization, which the others redo without it; a restarted
group is admitted at a synchronization, healed (rank r from rank r of a live group: the global copy, the outer
optimizer state, the schedule's position, and the donor's inner optimizer state), takes part in the
synchronization under way (sending zeros, not counted) and trains on from the job's step. The job's first
generation heals every group from one donor group, so the groups start from the same parameters whatever their
seeds.

Not covered: pipeline, tensor and context parallelism inside a group, checkpoint-based recovery of a whole job (DCP
checkpoints of each group still work).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtitan.trainer import Trainer

from torchnext.ft import FaultTolerant, FaultTolerantConfig, Reconfiguration, device_mesh
from torchnext.ft.state import load_sharded_state, sharded_state
from torchnext.integrations.torchtitan.semi_sync import OuterSyncRecord, SemiSync, semi_sync_config

__all__ = ["FaultTolerance", "FaultTolerantTrainer"]

_LOG = logging.getLogger("torchnext.integrations.torchtitan")


@dataclass(kw_only=True, slots=True)
class FaultTolerance:
    """The ``--fault_tolerance.*`` section of :class:`FaultTolerantTrainer.Config`."""

    replica_groups: int = 1
    """Replica groups of the job: how many shards the data is cut into (one per group). Groups may die and rejoin;
    the data a dead group would have read is not read by the others."""
    min_replica_groups: int = 1
    """Refuse generations with fewer live replica groups (``QuorumLost``)."""
    timeout_s: float = 60.0
    """Op timeout of each generation's Communicator (a safety net: failures are detected by heartbeats)."""
    join_timeout_s: float = 120.0
    """How long a starting group waits for its first generation (semi-sync: a joining group is admitted at the
    next outer synchronization; keep this above the time of ``sync_steps`` steps)."""
    semi_sync_method: str | None = None
    """None: FT-HSDP (gradients all-reduced across the live groups every step). ``"diloco"`` or ``"local_sgd"``:
    semi-synchronous training -- each group trains on its own (FSDP inside the group) and the groups synchronize
    every ``sync_steps`` steps (:mod:`torchnext.integrations.torchtitan.semi_sync`)."""
    sync_steps: int = 5
    """Semi-sync: inner steps between two outer synchronizations (H; of one fragment, with fragments)."""
    should_quantize: bool = False
    """DiLoCo: send the pseudo-gradients in MXFP8 (= ``outer_dtype="mxfp8"``; torchtitan's flag)."""
    outer_dtype: str = "fp32"
    """DiLoCo: wire format of the pseudo-gradients: ``fp32`` (all-reduce), ``bf16``, ``mxfp8``, ``mxfp4``,
    ``nvfp4`` (all-gathered codes, summed in fp32 in rank order)."""
    outer_lr: float = 0.7
    """DiLoCo: learning rate of the outer Nesterov SGD (torchtitan's fixed 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo: its momentum (torchtitan's fixed 0.9)."""
    num_fragments: int = 1
    """DiLoCo: fragments synchronized ``sync_steps / num_fragments`` steps apart (Streaming DiLoCo)."""
    fragment_pattern: str = "strided"
    """DiLoCo: how the model's units are grouped into fragments: ``strided`` or ``sequential``."""
    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """DiLoCo: the modules of each fragment by fqn (every parameter in exactly one); overrides the grouping."""
    fragment_sync_delay: int = 0
    """DiLoCo: inner steps a fragment's exchange overlaps (tau, ``< sync_steps / num_fragments``)."""
    fragment_update_alpha: float = 0.0
    """DiLoCo: weight of the local parameters when the new global copy is mixed in (0: replaced)."""


def _replica_group_from_env() -> int:
    raw = os.environ.get("TORCHNEXT_FT_REPLICA_GROUP", "")
    try:
        group = int(raw)
    except ValueError:
        group = -1
    if group < 0:
        raise ValueError(f"FaultTolerantTrainer: TORCHNEXT_FT_REPLICA_GROUP must be this launcher's replica group "
                         f"(0, 1, ...), got {raw!r}")
    return group


class _Replay:
    """An iterator over ``source`` that can serve the current step's batches again (a retried attempt)."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self.pulled = 0
        """Batches taken from ``source`` so far (this process)."""
        self._step: list[Any] = []
        self._pos = 0

    def new_step(self) -> None:
        self._step, self._pos = [], 0

    def rewind(self) -> None:
        self._pos = 0

    def skip_to(self, pulled: int) -> None:
        while self.pulled < pulled:
            next(self.source)
            self.pulled += 1

    def __iter__(self) -> _Replay:
        return self

    def __next__(self) -> Any:
        if self._pos < len(self._step):
            item = self._step[self._pos]
        else:
            item = next(self.source)
            self.pulled += 1
            self._step.append(item)
        self._pos += 1
        return item


class FaultTolerantTrainer(Trainer):
    """torchtitan's :class:`Trainer` whose data-parallel replicas are torchnext fault-tolerant replica groups (see
    the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
        """Replica groups and timeouts; the coordinator and token come from the environment."""

    ft: FaultTolerant
    step: int

    def __init__(self, config: Config) -> None:
        ftc = config.fault_tolerance
        self.replica_group = _replica_group_from_env()
        if not 0 <= self.replica_group < ftc.replica_groups:
            raise ValueError(f"FaultTolerantTrainer: replica group {self.replica_group} outside "
                             f"--fault_tolerance.replica_groups {ftc.replica_groups}")
        if not 1 <= ftc.min_replica_groups <= ftc.replica_groups:
            raise ValueError(f"FaultTolerantTrainer: min_replica_groups {ftc.min_replica_groups} must be in "
                             f"[1, replica_groups={ftc.replica_groups}]")
        self._semi_config = semi_sync_config(ftc)
        self._attempt: Any = None
        self._replay: _Replay | None = None
        self.semi: SemiSync | None = None
        """DiLoCo / LocalSGD (``--fault_tolerance.semi_sync_method``), else None (FT-HSDP)."""
        self.commits: list[int] = []
        """The steps this process committed (FT-HSDP), in order."""
        self.syncs: list[OuterSyncRecord] = []
        """The outer synchronizations this process took part in (semi-sync), in order."""
        super().__init__(config)
        self._shard_data()
        if self._semi_config is None:
            self._gate_optimizer_steps()
        else:
            self.semi = SemiSync(self.ft, self.model_parts[0], self._semi_config,
                                 fqns_per_fragment=ftc.module_fqns_per_model_fragment)
        self.ft.on_reconfigure(self._log_reconfiguration)
        self._load_checkpoint_before_joining()
        self._join()

    # ------------------------------------------------------------------------------------------- construction
    def init_distributed(self) -> Any:
        """torchtitan's process group for this replica group, then the fault-tolerant member and FSDP2's mesh."""
        parallel_dims = super().init_distributed()
        if dist.get_backend() != "torchnext":
            raise ValueError(f"FaultTolerantTrainer: the replica group's process group is {dist.get_backend()!r}; "
                             "launch each group with `torchnext run` (torchnext process groups)")
        unsupported = {n: getattr(parallel_dims, n) for n in ("dp_replicate", "pp", "tp", "cp", "ep")
                       if getattr(parallel_dims, n) != 1}
        semi = self._semi_config is not None
        if unsupported or parallel_dims.dp_shard < (1 if semi else 2):
            raise ValueError(f"FaultTolerantTrainer: FSDP inside each replica group only (dp_shard >= "
                             f"{1 if semi else 2}, the rest 1); got dp_shard={parallel_dims.dp_shard}, {unsupported}")
        ftc = self.config.fault_tolerance
        self.ft = FaultTolerant(
            FaultTolerantConfig(min_size=ftc.min_replica_groups, timeout_s=ftc.timeout_s,
                                join_timeout_s=ftc.join_timeout_s, replica_group=self.replica_group),
            join=False, state_dict=self._ft_state, load_state_dict=self._ft_load)
        _LOG.info("torchnext ft: replica group %d rank %d membership session: %s (%s)", self.replica_group,
                  self.ft.group_rank, self.ft.session, self.ft.session_why)
        if semi:
            # inner steps stay inside the group: torchtitan's own FSDP mesh over this launch's ranks; its group
            # keeps the ranks in lockstep at each synchronization and is aborted if the group is removed
            self.ft.register_local_group(dist.group.WORLD)
            return parallel_dims
        mesh = device_mesh(self.ft, ("dp_replicate", "fsdp"))
        lookup: Callable[..., Any] = parallel_dims.get_optional_mesh

        def get_optional_mesh(dims: str | list[str]) -> Any:
            """FSDP's mesh ("fsdp") is the fault-tolerant HSDP mesh; every other mesh is torchtitan's."""
            return mesh if dims in ("fsdp", ["fsdp"]) else lookup(dims)

        parallel_dims.get_optional_mesh = get_optional_mesh
        return parallel_dims

    def _shard_data(self) -> None:
        """Rebuild the dataloader so each replica group reads its own shard (torchtitan built it for one group)."""
        config = self.config
        pd = self.parallel_dims
        mesh = pd.get_optional_mesh("batch")  # None for a one-rank group (semi-sync)
        degree, rank = (1, 0) if mesh is None else (mesh.size(), mesh.get_local_rank())
        groups = config.fault_tolerance.replica_groups
        self.dataloader = config.dataloader.build(
            dp_world_size=degree * groups, dp_rank=self.replica_group * degree + rank, tokenizer=self.tokenizer,
            seq_len=config.training.seq_len, local_batch_size=config.training.local_batch_size,
            snapshot_every_n_steps=None)

    def _gate_optimizer_steps(self) -> None:
        """``optimizers.step()`` and ``lr_schedulers.step()`` run only in a committed attempt."""
        opt_step, lr_step = self.optimizers.step, self.lr_schedulers.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self._attempt is not None and not self._attempt.commit():
                return None
            return opt_step(*args, **kwargs)

        def lr_schedulers_step() -> None:
            if self._attempt is None or self._attempt.committed:
                lr_step()

        self.optimizers.step = step
        self.lr_schedulers.step = lr_schedulers_step

    # ---------------------------------------------------------------------------------------------- healing
    def _load_checkpoint_before_joining(self) -> None:
        """Load this group's latest DCP checkpoint now, before joining, and not again in ``train()``.

        torchtitan's ``train()`` loads the latest checkpoint first thing -- after ``__init__``, where a group that
        joins a running job is healed from a live group. Left there, a restarted group with a checkpoint older than
        the job's state (any ``--checkpoint.interval`` shorter than the run) overwrote the healed parameters,
        optimizer state and step with its own stale ones: a silent replica divergence. Loaded before joining, a
        heal overrides it; a group that starts the job keeps what it loaded."""
        checkpointer = self.checkpointer
        checkpointer.load(step=self.config.checkpoint.load_step)

        def loaded_before_joining(step: int = -1) -> bool:
            return False

        checkpointer.load = loaded_before_joining

    def _join(self) -> None:
        """Enter the job (healed from a live group when it runs already); semi-sync: take part in a synchronization
        the donor was inside."""
        if self.semi is not None:
            self.semi.join()
        else:
            self.ft.join()

    def _ft_state(self) -> dict[str, Any]:
        """What a joining group heals: this rank's parameter and optimizer shards; semi-sync: and the global copy,
        the outer optimizer state and the schedule's position (the parameters then become the global copy)."""
        state = sharded_state(self.model_parts[0], *self.optimizers.optimizers)
        if self.semi is None:
            return state
        return {"trainer": state, "semi": self.semi.state_dict()}

    def _ft_load(self, state: dict[str, Any]) -> None:
        if self.semi is None:
            load_sharded_state(state, self.model_parts[0], *self.optimizers.optimizers)
            return
        load_sharded_state(state["trainer"], self.model_parts[0], *self.optimizers.optimizers)
        self.semi.load_state_dict(state["semi"])

    def _log_reconfiguration(self, r: Reconfiguration) -> None:
        healed = f", healed {r.healed}" if r.healed is not None else ""
        _LOG.info("torchnext ft: generation %d, replica groups %s, committed step %d, reason %s%s", r.generation,
                  [list(g) for g in r.groups], r.step, r.reason, healed)

    # --------------------------------------------------------------------------------------------- training
    def _per_step_batches(self) -> int:
        return int(self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches)

    def _catch_up(self, replay: _Replay, committed: int) -> None:
        """Line the trainer up with the job's step count ``committed`` (a healed joiner, or a group that
        restarted): the step, this group's data position, the lr schedule."""
        if self.step == committed + 1:
            return
        _LOG.info("torchnext ft: replica group %d catches up from step %d to %d", self.replica_group, self.step,
                  committed + 1)
        self.step = committed + 1
        replay.new_step()
        replay.skip_to(committed * self._per_step_batches())
        for sched in self.lr_schedulers.schedulers:
            sched.last_epoch = committed - 1
            sched.step()

    def train_step(self, data_iterator: Iterator[Any]) -> None:
        """One committed step (see the module docstring): attempts until one commits; semi-sync: one inner step,
        then the outer synchronization when it is due."""
        if self._replay is None or self._replay.source is not data_iterator:
            self._replay = _Replay(data_iterator)
        replay = self._replay
        replay.new_step()
        if self.semi is not None:
            self._catch_up(replay, self.semi.position)
            if self.step > self.config.training.steps:  # healed at the job's last synchronization: nothing left
                self.step = self.config.training.steps
                return
            super().train_step(replay)
            self._outer_sync()
            return
        while True:
            replay.rewind()
            with self.ft.step() as attempt:
                self._attempt = attempt
                self._catch_up(replay, self.ft.step_count)
                if not self.metrics_processor.data_loading_times:  # a retry reads no batch: no loading time
                    self.metrics_processor.data_loading_times.append(0.0)
                for part in self.model_parts:
                    for module in part.modules():
                        if isinstance(module, FSDPModule):
                            module.set_gradient_divide_factor(float(self.ft.size))
                super().train_step(replay)
                attempt.commit()
            self._attempt = None
            if attempt.committed:
                self.commits.append(self.step)
                _LOG.info("torchnext ft: replica group %d committed step %d (%d replica groups live)",
                          self.replica_group, self.step, self.ft.size)
                return

    def _outer_sync(self) -> None:
        """After inner step ``self.step``: the outer synchronization due now (a fault-tolerant step of its own:
        a failure is retried in the next generation with the live groups), and, after the last step, the one
        still in flight."""
        semi = self.semi
        if semi is None:
            return
        done = [semi.step(self.step)]
        if self.step >= self.config.training.steps:
            done.append(semi.finish(self.step))
        for record in done:
            if record is not None:
                self.syncs.append(record)
                _LOG.info("torchnext ft: replica group %d outer sync %d of fragment %d after step %d (%d replica "
                          "groups contributed, generation %d, %d attempts)", self.replica_group, record.outer_step,
                          record.fragment, record.step, record.contributors, record.generation, record.attempts)

    def close(self) -> None:
        """Leave the job: ``finish()`` after the last step (the others do not reconfigure), else a departure."""
        ft = getattr(self, "ft", None)
        if ft is not None:
            if self.step >= self.config.training.steps:
                ft.finish()
            else:
                ft.close()
        super().close()
