"""DiLoCo and LocalSGD: train inside each replica group, synchronize across the live groups every H steps.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): each replica group takes *inner* optimizer steps on its own
parameters with its own parallelism -- a plain module, FSDP2 or DDP over the group's own ranks, no traffic across
groups -- and every ``sync_every`` (H) inner steps the groups take one *outer* step together::

    # theta[i]: group i's local parameters; theta_g: the global copy (the same on every group)
    delta = [theta_g - theta[i] for i in contributing]          # pseudo-gradients
    avg = sum(delta) / len(delta)                               # SUM over ft.process_group, / contributors
    theta_g = outer_sgd(theta_g, grad=avg)                      # default SGD(lr=0.7, momentum=0.9, nesterov=True):
    #   buf = avg if first else momentum * buf + avg;  theta_g -= lr * (avg + momentum * buf)
    for i in live_groups:
        theta[i] = theta_g                                      # every group restarts from the new global copy

LocalSGD is the outer-optimizer-free case: ``theta_g = theta_g - avg`` (= the mean of the contributing groups'
parameters, computed through the small pseudo-gradients rather than by summing the parameters themselves).

``contributing`` are the live groups that took an inner step since their parameters were last set to the global
copy; a group that has just joined sends zeros and is not counted (with no faults and no joins every live group
contributes and the division is exactly ``AVG`` over ``ft.process_group``). If no live group contributed, the
synchronization commits without an outer step.

Fault semantics
---------------
* Inner steps never touch ``ft``: no commit, no cross-group op. A failure meanwhile is noticed at the next
  synchronization, which enters the new generation first.
* The synchronization is one fault-tolerant step (``with ft.step()``; :attr:`FaultTolerant.step_count` counts
  synchronizations): pseudo-gradients go to a fresh buffer, are all-reduced on ``ft.process_group`` and applied
  only if the step commits on every live group (two-phase commit). A failure inside it -- a group dies inside the
  all-reduce, or after it but before the vote -- leaves every survivor's local parameters, global copy and outer
  optimizer untouched (nothing is written before the commit), and the synchronization is redone in the next
  generation with the live groups. A partial average is never applied.
* Healing: ``state_dict()`` (put it into the state ``FaultTolerant`` heals) holds, for this rank's shards, the
  **global copy**, the **outer optimizer state** (e.g. SGD's momentum buffers and hyper-parameters), the number
  of outer steps and whether the group is in the middle of a synchronization. A joiner receives exactly that from
  its donor (rank ``r`` of the joining group from rank ``r`` of a live group); :meth:`load_state_dict` sets its
  local parameters to the global copy. It does **not** receive the donor's local parameters' progress since the
  last synchronization (that is the donor's own contribution), nor the inner optimizer's state unless that is in
  the healed state too (it is yours: include it to continue from the donor's, leave it out to start fresh).
  A joiner whose donor was inside a synchronization takes part in it at once from :meth:`join` (sending zeros,
  not counted), so that every group leaves it with the same global copy.

Usage (``ft`` built with ``join=False``, so that healing can fill DiLoCo's state)::

    ft = FaultTolerant(cfg, join=False,
                       state_dict=lambda: {"diloco": diloco.state_dict(), "inner": inner_opt.state_dict()},
                       load_state_dict=lambda s: (diloco.load_state_dict(s["diloco"]),
                                                  inner_opt.load_state_dict(s["inner"])))
    diloco = DiLoCo(ft, model, DiLoCoConfig(sync_every=500))
    diloco.join()                      # ft.join(); a joiner takes part in the synchronization under way
    while ft.step_count < outer_steps:
        loss_fn(model(next(batches))).backward()
        inner_opt.step(); inner_opt.zero_grad()
        diloco.step()                  # every sync_every-th call: the outer synchronization
    ft.finish()

FSDP2: shard the model over the replica group's own ranks (``fully_shard(model, mesh=init_device_mesh("cpu",
(S,)))`` with the group's default process group), not over :func:`~torchnext.ft.device_mesh` -- that mesh
all-reduces gradients across the groups every inner step (HSDP), which DiLoCo exists to avoid (refused with a
``ValueError``; so is a module wrapped in :class:`~torchnext.ft.DistributedDataParallel`). DTensor parameters are
handled through their local shards: rank ``r`` of every group all-reduces its shard on its replicate
communicator, and its global copy and outer optimizer state are shards too. Replicated parameters inside a group
(DDP over the group's ranks) are synchronized by every rank of the group identically. Build the DiLoCo *after*
``fully_shard`` (it holds the parameters FSDP2 swapped in) and ``ft.register_local_group(group)`` the group's own
process group, so that a rank blocked on a dead sibling is released when its group is removed.

Timing: a joining group is admitted at the next synchronization (the survivors enter a new generation only inside
a fault-tolerant step), so it waits up to one interval (``sync_every`` inner steps) in :meth:`join`. Keep
``FaultTolerantConfig.join_timeout_s`` and ``timeout_s`` (a generation's Communicator waits that long for every
member) above the interval on every member; the synchronization warns once (``RuntimeWarning``) when an interval
exceeds half of the smaller. Traffic: one all-reduce of one copy of the parameters (this rank's shards, in their
dtype) per ``sync_every`` inner steps, against one of the gradients per step for DDP.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchnext.ft.ddp import DistributedDataParallel
from torchnext.ft.fault_tolerant import FaultTolerant
from torchnext.ft.state import local

__all__ = ["DiLoCo", "DiLoCoConfig", "LocalSGD", "LocalSGDConfig", "OuterSync"]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # pybind converts the RedOpType


def _check_sync_every(owner: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.sync_every must be an int >= 1 (inner steps between synchronizations), "
                         f"got {value!r}")


@dataclass(kw_only=True, slots=True)
class LocalSGDConfig:
    """How often :class:`LocalSGD` averages the parameters."""

    sync_every: int
    """H: inner steps between two synchronizations (>= 1)."""

    def __post_init__(self) -> None:
        _check_sync_every("LocalSGDConfig", self.sync_every)


_DEFAULT_OUTER = (0.7, 0.9, True)


def _check_outer(owner: str, lr: object, momentum: object, nesterov: object, factory: object) -> None:
    """Validate the outer optimizer fields of ``owner`` (a config class name): SGD's, or a factory instead."""
    if factory is not None:
        if not callable(factory):
            raise ValueError(f"{owner}.outer_optimizer must be a callable (global params -> optimizer), got {factory!r}")
        if (lr, momentum, nesterov) != _DEFAULT_OUTER:
            raise ValueError(f"{owner}: outer_optimizer is given, so outer_lr={lr!r}, outer_momentum={momentum!r}, "
                             f"outer_nesterov={nesterov!r} would be ignored; set one or the other")
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{owner}.outer_lr must be a finite number > 0, got {lr!r}")
    if (isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not math.isfinite(momentum)
            or not 0 <= momentum < 1):
        raise ValueError(f"{owner}.outer_momentum must be in [0, 1), got {momentum!r}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"{owner}.outer_nesterov must be a bool, got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError(f"{owner}: outer_nesterov=True needs outer_momentum > 0 (or set outer_nesterov=False)")


def _make_outer(owner: str, factory: OuterOptimizerFactory | None, lr: float, momentum: float, nesterov: bool,
                params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer over ``params`` (a global copy): ``factory(params)``, else SGD; checked to optimize
    exactly ``params`` in order."""
    opt = factory(params) if factory is not None else torch.optim.SGD(params, lr=lr, momentum=momentum,
                                                                        nesterov=nesterov)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"{owner}.outer_optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer")
    given = [p for group in opt.param_groups for p in group["params"]]
    if len(given) != len(params) or any(a is not b for a, b in zip(given, params, strict=True)):
        raise ValueError(f"{owner}.outer_optimizer must optimize exactly the tensors it is given (the global "
                         f"copy, {len(params)} tensors), in order; it optimizes {len(given)} others")
    return opt


@dataclass(kw_only=True, slots=True)
class DiLoCoConfig:
    """How often :class:`DiLoCo` synchronizes and which outer optimizer it applies (the paper's by default)."""

    sync_every: int
    """H: inner steps between two outer steps (>= 1)."""
    outer_lr: float = 0.7
    """Learning rate of the default outer optimizer, ``torch.optim.SGD`` (> 0)."""
    outer_momentum: float = 0.9
    """Its momentum, in [0, 1)."""
    outer_nesterov: bool = True
    """Nesterov momentum (needs ``outer_momentum > 0``)."""
    outer_optimizer: OuterOptimizerFactory | None = None
    """Instead of SGD: ``factory(global_params) -> torch.optim.Optimizer`` over exactly the tensors it is given (the
    global copy; their ``grad`` is the averaged pseudo-gradient). Leave ``outer_lr``/``outer_momentum``/
    ``outer_nesterov`` at their defaults when you pass one."""

    def __post_init__(self) -> None:
        _check_sync_every("DiLoCoConfig", self.sync_every)
        _check_outer("DiLoCoConfig", self.outer_lr, self.outer_momentum, self.outer_nesterov, self.outer_optimizer)

    def make_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer over ``params`` (the global copy)."""
        if self.outer_optimizer is not None:
            return self.outer_optimizer(params)
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov)


@dataclass(frozen=True, slots=True)
class OuterSync:
    """One committed synchronization (``sync()``'s result, also :attr:`DiLoCo.last_sync`)."""

    outer_step: int
    """Its index: 0 for the first synchronization of the job."""
    generation: int
    """The generation it committed in."""
    groups: tuple[tuple[int, ...], ...]
    """That generation's replica groups (member ids by group rank)."""
    contributors: int
    """Groups whose pseudo-gradient was averaged (the live groups less those that had just joined)."""
    attempts: int
    """Fault-tolerant steps it took (1 without a failure; each failed attempt was redone in a new generation)."""
    seconds: float
    """Wall time from the first attempt to the commit."""


@dataclass(frozen=True, slots=True)
class _Bucket:
    """Parameters of one dtype, packed into one flat buffer for a single all-reduce (+1 element: contributors)."""

    dtype: torch.dtype
    members: tuple[int, ...]
    """Indices into the parameter list."""
    offsets: tuple[int, ...]
    numel: int


class _OuterSynchronizer:
    """What DiLoCo and LocalSGD share: the global copy, the synchronization as a fault-tolerant step, healing."""

    _kind = ""

    def __init__(self, ft: FaultTolerant, model: nn.Module | Iterable[torch.Tensor], sync_every: int) -> None:
        name = type(self).__name__
        _check_unjoined(name, ft)
        self._ft = ft
        self._params = _parameters(name, ft, model)
        self._global = [local(p.detach()).detach().clone() for p in self._params]
        self._buckets = _buckets(self._global)
        self.sync_every = sync_every
        self._inner = 0
        self._outer_steps = 0
        self._in_sync = False
        self._catch_up = False
        self._loaded = False
        self._synced_at: float | None = None
        self._warned = False
        self.last_sync: OuterSync | None = None
        """The last committed synchronization on this member."""

    # ------------------------------------------------------------------------------------------------ public
    @property
    def sync_every(self) -> int:
        """H: inner steps between synchronizations (settable, e.g. for a schedule; keep it the same on every
        group -- a synchronization is a collective across them)."""
        return self._sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        _check_sync_every(type(self).__name__, value)
        self._sync_every = value

    @property
    def inner_steps(self) -> int:
        """Inner steps since the last synchronization (``step()`` calls)."""
        return self._inner

    @property
    def outer_steps(self) -> int:
        """Committed synchronizations (the same on every live group; healed into a joiner)."""
        return self._outer_steps

    @property
    def global_params(self) -> tuple[torch.Tensor, ...]:
        """The global copy: one tensor per parameter (this rank's local shard), the same on every live group."""
        return tuple(self._global)

    def join(self) -> None:
        """``ft.join()``; then, if this member was healed from a donor that was inside a synchronization, take part
        in it at once (sending zeros, not counted). Idempotent; call it before the first inner step.

        Raises:
            RuntimeError: this member was healed but the healed state did not include :meth:`state_dict`.
        """
        ft = self._ft
        ft.join()
        if self._synced_at is None:
            self._synced_at = time.monotonic()
        me = ft.member_id
        if not self._loaded and ft.heals_received:
            raise RuntimeError(f"{type(self).__name__}: member {me} was healed, but its load_state_dict did not call "
                               f"{type(self).__name__.lower()}.load_state_dict(): put {type(self).__name__.lower()}"
                               ".state_dict() into FaultTolerant's state_dict/load_state_dict")
        if self._catch_up:
            self._catch_up = False
            self._sync()

    def step(self) -> bool:
        """Count one inner step (call it after the inner optimizer's step); on every ``sync_every``-th, run the
        outer synchronization (:meth:`sync`). Returns True when it synchronized. Reference::

            self.inner_steps += 1
            if self.inner_steps == self.sync_every:
                self.sync()                    # inner_steps = 0 once it committed
                return True
            return False
        """
        self._check_joined("step")
        self._inner += 1
        if self._inner < self.sync_every:
            return False
        self.sync()
        return True

    def sync(self) -> OuterSync:
        """The outer synchronization now, as one fault-tolerant step, redone in each new generation until it
        commits (see the module docstring). Local parameters change only when it commits. Reference::

            mine = self.inner_steps > 0                    # a group fresh from the global copy does not count
            while True:
                with ft.step() as st:                      # enters a pending generation (heals joiners) first
                    delta = [g - p for g, p in zip(global_params, params)] if mine else zeros
                    n = 1 if mine else 0
                    all_reduce([*delta, n], SUM, group=ft.process_group)   # fresh buffers each attempt
                    if st.commit():                        # every live group finished it
                        if n: outer_step(global_params, grad=[d / n for d in delta])
                        params[:] = global_params; inner_steps = 0; outer_steps += 1
                        return OuterSync(...)
                # not committed: nothing was written; the next attempt runs in the next generation

        Raises:
            MembershipError: membership ended (``RemovedFromGroup``, ``QuorumLost``, ...), from ``ft``.
        """
        self._check_joined("sync")
        return self._sync()

    def _sync(self) -> OuterSync:
        ft = self._ft
        self._check_interval()
        pg = ft.process_group
        contributing = self._inner > 0  # a group fresh from the global copy (a joiner) has nothing to average
        t0 = time.monotonic()
        attempts = 0
        record: OuterSync | None = None
        self._in_sync = True  # a donor healing a joiner now tells it to take part in this synchronization
        while record is None:
            attempts += 1
            with ft.step() as st:
                flats = self._pack(contributing)
                works = [pg.allreduce([flat], _SUM) for flat in flats]
                for work in works:
                    work.wait()  # a failure is recorded, not raised: the step then cannot commit
                if st.commit():
                    count = self._apply(flats)
                    record = OuterSync(outer_step=self._outer_steps, generation=ft.generation,
                                       groups=ft.replica_groups, contributors=count, attempts=attempts,
                                       seconds=time.monotonic() - t0)
                    self._outer_steps += 1
                    self._inner = 0
                    self._in_sync = False  # before the step's end: a joiner healed there starts from here
            # not committed: the step's end entered the next generation; redo with its live groups
        self.last_sync = record
        self._synced_at = time.monotonic()
        return record

    def _check_interval(self) -> None:
        """Warn (once) when the interval between synchronizations nears the FT timeouts: a joiner is admitted only
        at a synchronization and gives up after its ``join_timeout_s``; a generation's Communicator waits at most
        ``timeout_s`` for every member to arrive."""
        if self._synced_at is None or self._warned:
            return
        interval = time.monotonic() - self._synced_at
        cfg = self._ft.config
        name, limit = min((("join_timeout_s", cfg.join_timeout_s), ("timeout_s", cfg.timeout_s)), key=lambda x: x[1])
        if interval > 0.5 * limit:
            self._warned = True
            warnings.warn(f"{type(self).__name__}: {interval:.1f}s of inner steps since the last synchronization "
                          f"(sync_every={self.sync_every}) is more than half of FaultTolerantConfig.{name}={limit}s; "
                          "a joining group waits for the next synchronization to be admitted and gives up after "
                          f"that long: raise {name} (on every member) above the interval, or lower sync_every",
                          RuntimeWarning, stacklevel=4)

    def state_dict(self) -> dict[str, Any]:
        """What a joiner heals (see the module docstring): the global copy (the tensors themselves, so healing
        receives in place), the outer optimizer's ``state_dict()``, the outer step count, whether this member is
        inside a synchronization."""
        return {"kind": self._kind, "global": list(self._global), "outer": self._outer_state(),
                "outer_steps": self._outer_steps, "mid_sync": self._in_sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` from a peer: the global copy and outer optimizer state; the local parameters
        become the global copy; a pending synchronization is taken part in by :meth:`join`.

        Raises:
            ValueError: the state is not this class's, or its tensors differ in number, shape or dtype.
        """
        name = type(self).__name__
        if not isinstance(state, dict) or state.get("kind") != self._kind:
            raise ValueError(f"{name}.load_state_dict: not a {name} state (kind "
                             f"{state.get('kind') if isinstance(state, dict) else type(state).__name__!r})")
        src = state["global"]
        if len(src) != len(self._global):
            raise ValueError(f"{name}.load_state_dict: {len(src)} global tensors for {len(self._global)} parameters")
        for i, (dst, t) in enumerate(zip(self._global, src, strict=True)):
            if t.shape != dst.shape or t.dtype != dst.dtype:
                raise ValueError(f"{name}.load_state_dict: global tensor {i} is {tuple(t.shape)} {t.dtype}, the "
                                 f"parameter's local shard is {tuple(dst.shape)} {dst.dtype}")
        with torch.no_grad():
            for dst, t in zip(self._global, src, strict=True):
                if dst.data_ptr() != t.data_ptr():
                    dst.copy_(t)
            self._load_outer_state(state["outer"])
            self._reset_local()
        self._outer_steps = int(state["outer_steps"])
        self._inner = 0
        self._catch_up = bool(state["mid_sync"])
        self._in_sync = False
        self._loaded = True

    # ---------------------------------------------------------------------------------------------- internals
    def _outer(self, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _outer_state(self) -> dict[str, Any]:
        return {}

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        pass

    def _check_joined(self, op: str) -> None:
        name = type(self).__name__
        if not self._ft.members:
            raise RuntimeError(f"{name}.{op}() before {name.lower()}.join(): join first (before the first inner "
                               "step), so that a joining group is healed and takes part in a synchronization under way")
        if self._ft._in_step:
            raise RuntimeError(f"{name}.{op}() inside `with ft.step()`: the synchronization is a fault-tolerant step "
                               "of its own; call it outside any other step")
        if self._catch_up:
            raise RuntimeError(f"{name}.{op}(): member {self._ft.member_id} was healed in the middle of a "
                               f"synchronization and has not taken part in it: call {name.lower()}.join() (not "
                               "only ft.join()) before the first inner step")

    def _pack(self, contributing: bool) -> list[torch.Tensor]:
        """Fresh flat buffers (one per dtype): pseudo-gradients ``global - local`` (zeros when not contributing),
        and a last element that counts contributors. Fresh each attempt: an aborted op's buffer is quarantined."""
        flats = []
        with torch.no_grad():
            for b in self._buckets:
                flat = torch.empty(b.numel + 1, dtype=b.dtype, device=self._global[b.members[0]].device)
                if contributing:
                    for i, off in zip(b.members, b.offsets, strict=True):
                        g = self._global[i]
                        torch.sub(g.reshape(-1), local(self._params[i].detach()).reshape(-1),
                                  out=flat[off:off + g.numel()])
                    flat[-1] = 1
                else:
                    flat.zero_()
                flats.append(flat)
        return flats

    def _apply(self, flats: list[torch.Tensor]) -> int:
        """After the commit: average, outer step on the global copy, local parameters := global. Returns the
        number of contributors."""
        counts = {float(flat[-1].item()) for flat in flats}
        if len(counts) != 1 or not all(math.isfinite(c) and c >= 0 and c == int(c) for c in counts):
            raise RuntimeError(f"{type(self).__name__}: a committed synchronization has contributor counts {counts} "
                               "(expected one non-negative integer; this is a bug)")
        count = int(counts.pop())
        with torch.no_grad():
            if count > 0:
                grads: list[torch.Tensor] = [torch.empty(0)] * len(self._global)
                for b, flat in zip(self._buckets, flats, strict=True):
                    flat.div_(count)
                    for i, off in zip(b.members, b.offsets, strict=True):
                        g = self._global[i]
                        grads[i] = flat[off:off + g.numel()].view(g.shape)
                self._outer(grads)
            self._reset_local()
        return count

    def _reset_local(self) -> None:
        for p, g in zip(self._params, self._global, strict=True):
            local(p.detach()).copy_(g)


class DiLoCo(_OuterSynchronizer):
    """DiLoCo over the live replica groups of ``ft`` (see the module docstring for the math, the fault semantics
    and what a joiner receives).

    Args:
        ft: a :class:`FaultTolerant` built with ``join=False`` and a ``state_dict``/``load_state_dict`` that
            include this object's.
        model: the module (its parameters) or the parameters to synchronize: plain tensors or DTensors (FSDP2
            inside the replica group), floating point.
        config: ``sync_every`` and the outer optimizer.

    Raises:
        TypeError / ValueError: bad arguments (named), ``ft`` already joined or without state, parameters sharded
            over the fault-tolerant group (HSDP) or a module wrapped in fault-tolerant DDP.
    """

    _kind = "diloco"

    def __init__(self, ft: FaultTolerant, model: nn.Module | Iterable[torch.Tensor], config: DiLoCoConfig) -> None:
        if not isinstance(config, DiLoCoConfig):
            raise TypeError(f"DiLoCo: config must be a DiLoCoConfig, got {type(config).__name__}")
        super().__init__(ft, model, config.sync_every)
        self.config = config
        opt = _make_outer("DiLoCoConfig", config.outer_optimizer, config.outer_lr, config.outer_momentum,
                          config.outer_nesterov, list(self._global))
        self.outer_optimizer = opt
        """The outer optimizer, over :attr:`global_params`."""

    def _outer(self, grads: list[torch.Tensor]) -> None:
        for g, d in zip(self._global, grads, strict=True):
            g.grad = d
        try:
            self.outer_optimizer.step()
        finally:
            for g in self._global:
                g.grad = None

    def _outer_state(self) -> dict[str, Any]:
        return self.outer_optimizer.state_dict()

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        self.outer_optimizer.load_state_dict(state)


class LocalSGD(_OuterSynchronizer):
    """LocalSGD over the live replica groups of ``ft``: every ``sync_every`` inner steps the parameters become the
    mean of the contributing groups' (``theta_g -= mean(theta_g - theta[i])``; see the module docstring). Arguments
    and errors as :class:`DiLoCo`; it keeps a global copy (one tensor per parameter) for healing."""

    _kind = "localsgd"

    def __init__(self, ft: FaultTolerant, model: nn.Module | Iterable[torch.Tensor], config: LocalSGDConfig) -> None:
        if not isinstance(config, LocalSGDConfig):
            raise TypeError(f"LocalSGD: config must be a LocalSGDConfig, got {type(config).__name__}")
        super().__init__(ft, model, config.sync_every)
        self.config = config

    def _outer(self, grads: list[torch.Tensor]) -> None:
        for g, d in zip(self._global, grads, strict=True):
            g.sub_(d)


def _check_unjoined(name: str, ft: object) -> None:
    """``ft`` is a FaultTolerant that has not joined yet and heals through a state_dict: what an outer synchronizer
    named ``name`` needs, so that a joining group receives its state."""
    if not isinstance(ft, FaultTolerant):
        raise TypeError(f"{name}: ft must be a torchnext.ft.FaultTolerant, got {type(ft).__name__}")
    if ft.members:
        raise ValueError(f"{name}: ft has already joined; construct FaultTolerant(..., join=False), build the "
                         f"{name}, then call {name.lower()}.join() -- healing must be able to fill its state")
    if ft.config.defer_commit:
        raise ValueError(f"{name}: FaultTolerantConfig(defer_commit=True) is not supported: the outer step applies "
                         "the averaged pseudo-gradients only after its commit decision, which deferral would make "
                         "provisional (use it with DistributedDataParallel or device_mesh)")
    if ft._state_fn is None:
        raise ValueError(f"{name}: ft has no state_dict/load_state_dict: pass FaultTolerant(state_dict=..., "
                         f"load_state_dict=...) that include {name.lower()}.state_dict() / load_state_dict(), "
                         "or a joining group would start from its own parameters")


def _parameters(name: str, ft: FaultTolerant, model: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(model, DistributedDataParallel):
        raise ValueError(f"{name}: the module is wrapped in torchnext.ft.DistributedDataParallel, which averages "
                         "gradients across replica groups every step; inner steps must stay inside the replica "
                         "group: pass the module itself (or a DDP over the group's own ranks)")
    params: list[torch.Tensor]
    if isinstance(model, nn.Module):
        params = list(model.parameters())
    elif isinstance(model, torch.Tensor):
        raise TypeError(f"{name}: pass a module or an iterable of parameters, not a single tensor")
    else:
        try:
            params = list(model)
        except TypeError:
            raise TypeError(f"{name}: model must be an nn.Module or an iterable of tensors, got "
                            f"{type(model).__name__}") from None
    if not params:
        raise ValueError(f"{name}: no parameters to synchronize")
    seen: set[int] = set()
    ft_group = ft.process_group.group_name
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}: parameter {i} is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point():
            raise ValueError(f"{name}: parameter {i} has dtype {p.dtype}; pseudo-gradients need a floating dtype")
        if id(p) in seen:
            raise ValueError(f"{name}: parameter {i} ({tuple(p.shape)}) is listed twice")
        seen.add(id(p))
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and any(g.group_name == ft_group for g in mesh.get_all_groups()):
            raise ValueError(f"{name}: parameter {i} is a DTensor on a mesh that contains ft.process_group (HSDP: "
                             "its gradients are all-reduced across replica groups every inner step); shard it over "
                             "the replica group's own ranks instead")
    return params


def _buckets(tensors: list[torch.Tensor]) -> list[_Bucket]:
    by: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.dtype, t.device), []).append(i)
    out = []
    for (dtype, _), members in by.items():
        offsets, n = [], 0
        for i in members:
            offsets.append(n)
            n += tensors[i].numel()
        out.append(_Bucket(dtype=dtype, members=tuple(members), offsets=tuple(offsets), numel=n))
    return out
