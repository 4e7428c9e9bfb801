"""``FaultTolerant``: a Communicator that survives member failures, reconfigures in place and heals joiners.

Usage (every process runs the same loop; a replacement process runs it too and joins at the next generation)::

    ft = FaultTolerant(FaultTolerantConfig(coordinator="127.0.0.1:29400", token=TOKEN, min_size=2),
                       state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
                       load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["optim"])))
    while ft.step_count < total_steps:
        with ft.step() as step:              # applies any pending generation (rebuild, heal) first
            loss = model(batch(ft.step_count)).sum(); loss.backward()
            for p in model.parameters():
                ft.all_reduce(p.grad, ReduceOp.AVG)   # ft.<op> = the current generation's Communicator op
            if step.commit():                 # two-phase commit through the coordinator
                opt.step()
            opt.zero_grad()
        # a step failed by a transient error (PeerFailure, CommAborted, a refused commit, ...) was swallowed by
        # the context: the group reconfigured and healed; ft.step_count did not move, so the loop simply retries
        # the step (at most config.max_retries times in a row, then RetriesExhausted). A deterministic error
        # (CollectiveMismatch, an exception of the loop's own code) is raised on every member instead.
    ft.finish()                               # the job's end: leaving is not a failure

Semantics
---------
* ``step.commit()`` / ``ft.should_commit()`` returns True only when **every** member of the current generation
  finished the step's collectives and voted; the coordinator then counts the step (``ft.step_count += 1`` on every
  member). It returns False when the generation changed meanwhile; nothing is counted and the step is retried.
  A committed step is never lost (survivors all received the decision before any later generation) nor applied
  twice (the count is per generation and checked against the coordinator's at every reconfiguration).
* ``FaultTolerantConfig(defer_commit=True)``: ``step.commit()`` votes and returns True provisionally; the decision
  is awaited at the next commit and a refused step is revoked (``load_state_dict`` of a copy taken when its attempt
  began; ``step_count`` goes back). End the loop with ``while ft.step_count < total or not ft.confirm()``. Exact
  semantics: :mod:`torchnext.ft.provisional`.
* Reconfiguration: when the coordinator announces generation ``g + 1`` with ``abort``, the heartbeat thread aborts
  this member's Communicator at once (an in-flight collective raises ``CommAborted`` within milliseconds, it never
  waits for a collective timeout), then the main thread builds the Communicator of ``g + 1`` under the store
  prefix ``torchnext/<name>.g<g+1>/`` with ranks renumbered by sorted member id, heals the joiners from the donor,
  and runs the ``on_reconfigure`` callbacks. A further failure during all this restarts it with ``g + 2``.
* ``generation``, ``members`` (stable ids), ``member_id``, ``rank``, ``size`` describe the current generation.
* Tensors of an op cancelled by a reconfiguration get fresh storage (``set_``) before the op raises, so a late
  write by the abandoned backend (a resumed hung peer can complete the old collective) can never reach them; their
  content is unspecified (views taken earlier keep the old storage).
* Split children (``ft.split``/``ft.split_by_color``) are **invalidated** at every reconfiguration: their ops raise
  ``CommAborted`` naming the superseded generation. Split again in an ``on_reconfigure`` callback.
* What ends a step attempt is classified (:mod:`torchnext.ft.errors`, :mod:`torchnext.ft.step`): transient
  failures are retried, deterministic errors raised on every member without a new generation.
* Fatal conditions raise :class:`~torchnext.ft.membership.MembershipError` subclasses from any call:
  ``RemovedFromGroup`` ("you were removed"), ``CoordinatorLost``, ``QuorumLost``, ``JobFinished`` (another member
  called ``finish()`` and this one tried to commit a later step).
* End of training: ``ft.finish()`` after the last step (every member). Departures after it are not failures.

Thread-safety: one training thread uses the object; the heartbeat thread only aborts communicators.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchnext.comms.cancellable_store import CancellableStore
from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CommError
from torchnext.comms.hooks import HookList, RemovableHandle
from torchnext.ft.config import FaultTolerantConfig, Reconfiguration
from torchnext.ft.errors import quiet_abort
from torchnext.ft.healing import HealStats, recv_state, send_state
from torchnext.ft.member import ARRIVED_AFTER, MemberClient
from torchnext.ft.membership import JobFinished, QuorumLost, RemovedFromGroup
from torchnext.ft.provisional import Provisional, StateSnapshots, StepRevoked
from torchnext.ft.quarantine import quarantine_cancelled
from torchnext.ft.session import connect as connect_session
from torchnext.ft.session import plan as plan_session
from torchnext.ft.step import Step, _FailedAttempts

__all__ = ["COMMITS_KEPT", "RECONFIGURATIONS_KEPT", "TRAIL_KEPT", "FaultTolerant"]

COMMITS_KEPT = 10_000
"""Commits a member keeps in ``commit_times`` (a long job's memory stays flat: ~1.5 MB at the bound)."""
RECONFIGURATIONS_KEPT = 1_000
"""Generations a member keeps in ``reconfigurations`` (one per fault it lived through)."""
TRAIL_KEPT = 64
"""Membership events a member keeps in ``trail`` (interrupts, announcements, entries, reports), for diagnostics: the
last of them are in the message of a ``QuorumLost`` raised while waiting for a generation."""

_OPS = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "reduce_scatter", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "batch_p2p", "barrier",
    "register_pre_hook", "register_post_hook", "register_abort_hook",
})


class FaultTolerant:
    """Fault-tolerant communicator; see the module docstring. Construction joins the group and returns once this
    member is part of a generation (healed when it joined a running job)."""

    def __init__(
        self,
        config: FaultTolerantConfig | None = None,
        *,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], object] | None = None,
        step: int = 0,
        join: bool = True,
    ) -> None:
        from torchnext._config import env_config

        cfg = config or FaultTolerantConfig()
        if not isinstance(cfg, FaultTolerantConfig):
            raise TypeError(f"config must be a FaultTolerantConfig, got {type(cfg).__name__}")
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("pass both state_dict and load_state_dict (healing needs both), or neither")
        if cfg.defer_commit and state_dict is None:
            raise ValueError("FaultTolerantConfig(defer_commit=True) needs state_dict and load_state_dict: a step "
                             "applied before its decision is reverted from a copy of the state when it is refused")
        env = env_config()
        address = cfg.coordinator or env.ft_coordinator
        token = cfg.token or env.ft_token
        if not address:
            raise ValueError("no coordinator address: set FaultTolerantConfig.coordinator or TORCHNEXT_FT_COORDINATOR")
        if not token:
            raise ValueError("no job token: set FaultTolerantConfig.token or TORCHNEXT_FT_TOKEN")
        self.config = cfg
        self._state_fn = state_dict
        self._load_fn = load_state_dict
        self._lock = threading.Lock()
        self._comm: Communicator | None = None
        self._children: list[Communicator] = []
        self._gen: dict[str, Any] | None = None
        self._held: dict[str, Any] | None = None  # the newest generation fully entered (healed): reported on failover
        self._pending: dict[str, Any] | None = None
        self._newest_gen = 0
        self._interrupt_at: dict[int, float] = {}
        # the last failure report: (generation, the client's failover count when it was sent, reason)
        self._reported: tuple[int, int, str] = (-1, 0, "")
        self._step = step
        self._callbacks: HookList[Reconfiguration] = HookList("reconfigure")
        self._attempted = 0
        self._closed = False
        self._in_step = False
        self._finished_step: int | None = None
        self._step_error: BaseException | None = None  # a deterministic error ft.process_group recorded in the step
        self._failed_attempts = _FailedAttempts()
        self._refusal = ""  # why the last should_commit() returned False
        self.reconfigurations: deque[Reconfiguration] = deque(maxlen=RECONFIGURATIONS_KEPT)
        """The last :data:`RECONFIGURATIONS_KEPT` generations this member entered (oldest first)."""
        self.heals_received = 0
        """How many times this member joined a generation and received the committed state from a donor."""
        self.fault_hook: Callable[[str], None] | None = None
        """Testing seam (``torchnext.testing``): called with ``"reconfigure"`` before a generation's Communicator is
        built and ``"healing"`` on the donor before it streams state."""
        self.trail: deque[str] = deque(maxlen=TRAIL_KEPT)
        """The last :data:`TRAIL_KEPT` membership events seen by this member, oldest first, each
        ``"<seconds since monotonic zero> <event>"`` (diagnostics; any thread appends)."""
        self.commit_times: deque[tuple[int, int, float]] = deque(maxlen=COMMITS_KEPT)
        """``(generation, committed step count, time.monotonic())`` of the last :data:`COMMITS_KEPT` commits."""
        self.replica_group, self.group_rank, self.group_size = _replica_group(cfg, env.ft_replica_group)
        if cfg.defer_commit and self.group_size > 1:
            raise ValueError(f"FaultTolerantConfig(defer_commit=True) with replica groups of {self.group_size} ranks "
                             "is not supported yet: a 240-fault soak of FT-HSDP with deferral stalled after a "
                             "coordinator failover (not yet explained); use it with one rank per replica group "
                             "(FT-DDP), or leave defer_commit off")
        self._local_groups: list[Any] = []  # aborted when this member's group is removed (see register_local_group)
        self._process_group: Any = None
        self._vote: dict[str, int] | None = None  # a vote sent and not yet decided (reported on failover)
        self._in_place = False  # the last attempt committed with no generation in its decision (see _begin_attempt)
        self._vote_lock = threading.Lock()  # one vote per attempt: _vote_early (any thread) or should_commit
        self._early_voted = False  # this attempt's vote was attempted: no early vote any more
        self._early_vote: int | None = None  # the generation _vote_early voted in (ft.process_group refuses ops
        # while it is set), for should_commit
        self.early_votes = 0
        """How many of this member's votes were sent before ``step.commit()`` (``DistributedDataParallel(
        vote_early=True)``; diagnostics)."""
        self._provisional: Provisional | None = None  # defer_commit: the step applied before its decision
        self._snapshots = StateSnapshots()
        self.revoked_steps = 0
        """How many steps applied provisionally (``defer_commit``) were refused and reverted (diagnostics)."""
        self.lockstep_rounds = 0
        """How many replica-group agreement all_reduces this member ran (:meth:`_lockstep`; diagnostics): one per
        attempt with ``group_session=False``, after the first and after failed attempts only in a group session."""
        _preload_gil_heavy_imports()
        common: dict[str, Any] = dict(
            member_id=cfg.member_id, step=step, connect_timeout_s=cfg.connect_timeout_s,
            coordinator_timeout_s=cfg.coordinator_timeout_s, on_interrupt=self._on_interrupt,
            failover_timeout_s=cfg.failover_timeout_s, report=self._member_report,
        )
        session = plan_session(cfg, replica_group=self.replica_group, group_rank=self.group_rank,
                               group_size=self.group_size)
        self.session = session.role
        """``"leader"`` / ``"follower"``: this member is in its replica group's group session (protocol 4: the
        leader holds the group's one coordinator connection); ``"flat"``: its own connection (``session_why``)."""
        self.session_why = session.why
        self._client: MemberClient = connect_session(session, cfg, address, token, replica_group=self.replica_group,
                                                     group_rank=self.group_rank, group_size=self.group_size, **common)
        self._joined = False
        try:
            cfg.check_timeouts(heartbeat_interval_s=self._client.heartbeat_interval_s,
                               heartbeat_timeout_s=self._client.heartbeat_timeout_s,
                               quorum_timeout_s=self._client.quorum_timeout_s,
                               grow_timeout_s=self._client.grow_timeout_s,
                               group_heartbeat_interval_s=self._client.group_heartbeat_interval_s,
                               group_heartbeat_timeout_s=self._client.group_heartbeat_timeout_s)
            if join:
                self.join()
        except BaseException:
            self.close()
            raise

    def join(self) -> None:
        """Enter the first generation (healed when this member joins a running job); idempotent, and implicit at
        construction unless ``join=False``. Construct with ``join=False`` when the state to heal into exists only
        after ``ft`` does -- FSDP2 shards the model over :meth:`device_mesh`, which needs ``ft`` -- then shard, then
        ``join()`` (the first ``ft.step()`` joins too). The member is registered with the coordinator meanwhile:
        the others wait for it (at most ``timeout_s``) while they build the generation's Communicator."""
        if self._joined:
            return
        try:
            self._settle(need_new=True, timeout=self.config.join_timeout_s)
        except BaseException:
            self.close()
            raise
        self._joined = True

    # ------------------------------------------------------------------------------------------------ public
    @property
    def comm(self) -> Communicator:
        """The current generation's Communicator (raises the fatal error if membership ended)."""
        self._raise_fatal()
        if self._comm is None:
            raise RuntimeError("FaultTolerant is not part of a generation (closed?)")
        return self._comm

    @property
    def member_id(self) -> int:
        return self._client.member_id

    @property
    def generation(self) -> int:
        return 0 if self._gen is None else int(self._gen["gen"])

    @property
    def members(self) -> tuple[int, ...]:
        """Member ids of the current generation (every rank of every replica group), sorted."""
        return () if self._gen is None else tuple(self._gen["members"])

    @property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The current generation's replica groups (member ids by group rank), in rank order."""
        if self._gen is None:
            return ()
        return tuple(tuple(int(m) for m in g) for g in _groups(self._gen))

    @property
    def rank(self) -> int:
        """This replica group's rank in the current generation (= this member's rank in :attr:`comm`)."""
        return next(i for i, g in enumerate(self.replica_groups) if self.member_id in g)

    @property
    def size(self) -> int:
        """Number of replica groups in the current generation (= the size of :attr:`comm`)."""
        return len(self.replica_groups)

    @property
    def step_count(self) -> int:
        """Committed steps (the same on every member of a generation)."""
        return self._step

    def __getattr__(self, name: str) -> Any:
        if name in _OPS:
            return getattr(self.comm, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def split(self, ranks: list[int], name: str | None = None) -> Communicator | None:
        """``comm.split`` of the current generation; the child is invalidated (aborted) at the next reconfiguration."""
        child = self.comm.split(ranks, name)
        if child is not None:
            with self._lock:
                self._children.append(child)
        return child

    def split_by_color(self, color: int | None, key: int = 0, *, name: str | None = None) -> Communicator | None:
        """``comm.split_by_color`` of the current generation; invalidated at the next reconfiguration."""
        child = self.comm.split_by_color(color, key, name=name)
        if child is not None:
            with self._lock:
                self._children.append(child)
        return child

    def register_local_group(self, group: Any) -> None:
        """Register ``group`` (a Communicator or a process group: this replica group's own, e.g. its FSDP shard
        group; :func:`~torchnext.ft.device_mesh` registers it). It is aborted when this member's replica group is
        removed or membership ends, so that an op blocked on a lost sibling raises instead of waiting for its
        timeout (a torchnext group or Communicator: ``CommAborted`` whose ``__cause__`` is the
        :class:`~torchnext.ft.MembershipError` that ``ft`` raises from then on -- an inner step outside
        ``ft.step()`` may meet it first); and the first one registered keeps the group's ranks in lockstep: every
        ``ft.step()`` attempt begins in the same generation on all of them (one small all_reduce on it per attempt,
        see :meth:`_lockstep`). Register it on every rank of the group, before the first step."""
        if not hasattr(group, "abort"):
            raise TypeError(f"register_local_group: {group!r} has no abort()")
        with self._lock:
            self._local_groups.append(group)

    @property
    def process_group(self) -> Any:
        """The replicate dimension as a ``torch.distributed`` process group: one stable object across generations
        (DDP, FSDP2 and DeviceMesh hold on to it) whose ``size()`` is the live number of replica groups; see
        :class:`torchnext.ft.FaultTolerantProcessGroup`."""
        if self._process_group is None:
            from torchnext.ft.process_group import FaultTolerantProcessGroup

            self._process_group = FaultTolerantProcessGroup(self)
        return self._process_group

    def on_reconfigure(self, callback: Callable[[Reconfiguration], object]) -> RemovableHandle:
        """Call ``callback(Reconfiguration)`` after every generation this member enters (after healing)."""
        if not callable(callback):
            raise TypeError(f"on_reconfigure: callback must be callable, got {callback!r}")
        return self._callbacks.add(callback)

    def step(self) -> Step:
        """Context manager for one step attempt (see the module docstring); joins first if not yet joined."""
        self.join()
        return Step(self)

    def should_commit(self) -> bool:
        """Vote that this member completed the current step's collectives; wait for the coordinator's decision.

        Reference::

            if my communicator is broken or a new generation is pending: return False
            send vote(generation, step_count) unless vote() already sent it; wait for the decision or a new generation
            on commit: step_count += 1; return True        else: return False

        Raises ``RemovedFromGroup``/``CoordinatorLost``/``QuorumLost`` when membership ended. With
        ``FaultTolerantConfig(defer_commit=True)`` the decision is awaited one step later and True is provisional
        (:mod:`torchnext.ft.provisional`).
        """
        if self.config.defer_commit:
            return self._commit_provisionally()
        with self._vote_lock:  # an early vote in progress on another thread finishes first; none starts after this
            self._early_voted = True
            gen = self._early_vote if self._early_vote is not None else self.vote()
            self._early_vote = None
        if gen is None:
            return False
        try:
            ev = self._await_decision(gen, self._step)
            if ev is None:
                return False
            with self._lock:
                self._step += 1
                self._in_place = ev.get("next") is None
            self._counted(gen, ev)
            return True
        finally:
            with self._lock:
                self._vote = None

    def confirm(self) -> bool:
        """Await the decision of the step applied provisionally (``FaultTolerantConfig(defer_commit=True)``, see
        :mod:`torchnext.ft.provisional`). True: it was committed, or no step is provisional (always, without
        ``defer_commit``). False: it was refused -- its optimizer update was reverted (``load_state_dict`` of the
        state before it) and ``step_count`` is one lower, so the loop trains that step again. Raises
        ``RemovedFromGroup``/``CoordinatorLost``/``QuorumLost`` when membership ended. A revocation counts as a
        failed attempt of its step (``FaultTolerantConfig.max_retries``)."""
        return self._confirm(count=True)

    def _confirm(self, *, count: bool) -> bool:
        """:meth:`confirm`; ``count``: a revocation counts as a failed attempt (False where the attempt that
        noticed it fails and is counted instead)."""
        p = self._provisional
        if p is None:
            return True
        if p.decision is not None:
            ev: dict[str, Any] | None = p.decision
        elif p.refusal is not None:
            self._refusal, ev = p.refusal, None
        else:
            ev = self._await_decision(p.gen, p.step)
        if ev is None:
            self._revoke(self._refusal, count=count)
            return False
        self._confirmed(ev)
        return True

    def _await_decision(self, gen: int, step: int) -> dict[str, Any] | None:
        """Read events until the decision of the vote ``(gen, step)``: the decision, or None (``_refusal`` says why)
        when a new generation or a quorum wait came first, or nothing within ``timeout_s`` (reported)."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            ev = self._client.next_event(deadline - time.monotonic())
            if ev is None:
                self._refusal = f"no commit decision within {self.config.timeout_s}s"
                self._report(self._refusal)
                return None
            kind = ev["t"]
            if kind == "decision" and ev["gen"] == gen and ev["step"] == step:
                return ev
            if kind == "gen":
                self._note_gen(ev)
                self._refusal = f"generation {ev['gen']} announced before the decision ({ev.get('reason')})"
                return None
            if kind == "wait":
                self._refusal = f"the coordinator is waiting for a quorum ({ev.get('reason')})"
                return None
            if kind == "fatal":
                self._raise_fatal()

    def _counted(self, gen: int, ev: dict[str, Any] | None) -> None:
        """Record the commit that made ``step_count`` what it is (``ev``: its decision; None when a generation's
        committed count told it) and note the generation the decision named, if any."""
        self.commit_times.append((gen, self._step, time.monotonic()))
        if ev is not None and ev.get("next") is not None:
            self._note_gen({**ev["next"], ARRIVED_AFTER: ev[ARRIVED_AFTER]})

    def _commit_provisionally(self) -> bool:
        """``should_commit`` with ``defer_commit``: see :mod:`torchnext.ft.provisional`."""
        if not self._confirm(count=False):  # this attempt fails: Step counts it
            self._snapshots.discard()  # taken on top of the revoked step
            return False
        gen = self.vote()
        if gen is None:
            self._snapshots.discard()
            return False
        snapshot = self._snapshots.done()  # begun when the attempt began (ft.step()): normally finished long ago
        if snapshot is None:  # should_commit() called outside ft.step(): copy the state now
            self._begin_snapshot()
            snapshot = self._snapshots.done()
        with self._lock:
            self._provisional = Provisional(gen=gen, step=self._step, snapshot=snapshot)
            self._step += 1
        return True

    def _begin_snapshot(self) -> None:
        """``defer_commit``: start copying the state on the snapshot thread (at ``ft.step()``, after the attempt's
        generation was settled: the state before this attempt's optimizer update; the copy overlaps forward and
        backward, which read the state but do not write it)."""
        assert self._state_fn is not None  # checked at construction
        self._snapshots.begin(self._state_fn())

    def _confirmed(self, ev: dict[str, Any] | None) -> None:
        """The provisional step was committed (``ev``: its decision; None: a generation counted it)."""
        p = self._provisional
        assert p is not None
        with self._lock:
            self._provisional = None
            self._vote = None
        self._snapshots.release(p.snapshot)
        self._failed_attempts.reset()
        self._counted(p.gen, ev)

    def _revoke(self, why: str, *, count: bool = True) -> None:
        """The provisional step was refused: load the state from before its optimizer update; ``step_count`` goes
        back; with ``count``, a failed attempt of that step."""
        p = self._provisional
        assert p is not None and self._load_fn is not None
        self._trace(f"revoke step {p.step} ({why[:120]})")
        self._snapshots.discard()  # a copy still being taken reads the state loaded here (and is stale)
        self._load_fn(p.snapshot)  # never released: the loader may keep its tensors
        with self._lock:
            self._step = p.step
            self._provisional = None
            self._vote = None
        self.revoked_steps += 1
        if count:
            self._failed_attempts.add(p.step, p.gen, f"revoked after it was applied: {why}")

    def _settle_provisional(self, gen: int, committed: int) -> None:
        """Entering generation ``gen``, announced with ``committed`` steps: it tells the provisional step's fate
        (before this member heals anyone from its state)."""
        p = self._provisional
        if p is None:
            return
        if committed == p.step + 1:
            self._confirmed(None)
        elif committed == p.step:
            self._revoke(f"generation {gen} was announced with {committed} committed steps")

    def vote(self) -> int | None:
        """Send this member's vote for the current step now and return its generation; :meth:`should_commit`
        then only waits for the decision. None (no vote sent) when the step cannot commit: the communicator is
        broken or a newer generation is pending (reported). Raises the deterministic error ``ft.process_group``
        recorded in this attempt, if any. Any thread may call it (``DistributedDataParallel(vote_early=True)``
        calls it when the last bucket is reduced); :meth:`should_commit` sends the vote itself when nobody did."""
        self._raise_fatal()
        if self._process_group is not None:
            self._process_group._drain_native()  # a failed op of its native path that nobody waited on
        recorded = self._step_error
        if recorded is not None:
            raise recorded  # a deterministic error ft.process_group recorded: the step cannot succeed on retry
        comm = self._comm
        if comm is None or comm.errored() is not None or self._newest_gen > self.generation:
            broken = comm.errored() if comm is not None else None
            self._refusal = (f"generation {self.generation} broken before the vote"
                             + (f" ({type(broken).__name__}: {broken})" if broken is not None else ""))
            self._report("communicator broken before the vote")
            return None
        gen = self.generation
        with self._lock:
            self._vote = {"gen": gen, "step": self._step}
        self._client.send({"t": "vote", "gen": gen, "step": self._step})
        return gen

    def _vote_early(self) -> None:
        """Vote from the thread that saw the step's last collective complete (``DistributedDataParallel``'s
        ``vote_early``); once per attempt, inside a step only. A vote not sent here is sent by ``should_commit``.
        Never with ``defer_commit``: the vote must follow the previous step's decision, awaited at the commit."""
        if self.config.defer_commit:
            return
        with self._vote_lock:
            with self._lock:
                if not self._in_step or self._early_voted or self._step_error is not None:
                    return
                self._early_voted = True
            try:
                gen = self.vote()
            except BaseException:
                return
            self._early_vote = gen
            if gen is not None:
                self.early_votes += 1
                if self._process_group is not None:  # its native path refuses ops from now on, as its Python one
                    self._process_group._hold_python()

    def close(self) -> None:
        """Leave the group (the others reconfigure without this member) and release resources. Idempotent.
        At the end of training use :meth:`finish` instead, so the others do not reconfigure."""
        self._leave(finished=False)

    def finish(self) -> None:
        """Leave at the end of the job: call it after the last committed step (outside ``ft.step()``).

        The coordinator then records the job as finished at the committed step ``S``: this and every later departure
        (``finish``, ``close``, a crash) changes nothing for the others — no new generation, no abort — so members may
        leave in any order without a final barrier. A member still training afterwards gets :class:`JobFinished` at
        its next vote; joins are refused. Finishing while others already voted for a later step is an ordinary
        :meth:`close`. Releases resources like :meth:`close`; idempotent."""
        if self._in_step:
            raise RuntimeError("FaultTolerant.finish() inside ft.step(): finish after the last step's `with` block")
        if not self.confirm():
            raise StepRevoked(f"member {self.member_id}: step {self._step}, applied before its decision "
                              f"(defer_commit), was refused ({self._refusal}) and reverted: train it again before "
                              "finish() (while ft.step_count < total or not ft.confirm(): ...)")
        self._leave(finished=True)

    def _leave(self, *, finished: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close(graceful=True, finished=finished)
        with self._lock:
            comm, self._comm = self._comm, None
            children, self._children = self._children, []
        for c in [*children, *([comm] if comm is not None else [])]:
            quiet_abort(c, "FaultTolerant closed")
        if self._process_group is not None:
            self._process_group._close()
        self._snapshots.close()

    def __enter__(self) -> FaultTolerant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------- internals
    def _check_not_finished(self, cause: BaseException | None = None) -> None:
        """Raise :class:`JobFinished` if another member finished the job and this one is past the finished step."""
        done = self._finished_step
        if done is not None and self._step >= done:
            raise JobFinished(f"member {self.member_id}: the job finished at step {done} (another member called "
                              f"finish()); step {self._step} cannot commit") from cause

    def _raise_fatal(self, cause: BaseException | None = None) -> None:
        fatal = self._client.fatal
        if fatal is not None:
            if cause is not None:
                raise fatal from cause
            raise fatal

    def _record_step_error(self, exc: BaseException) -> None:
        """``ft.process_group`` met a deterministic error (it records failures instead of raising them): the step
        ends with it -- ``step.commit()`` raises it, and so does the ``with ft.step()`` block. The first one wins."""
        with self._lock:
            if self._in_step and self._step_error is None:
                self._step_error = exc

    def _end_job(self, code: str, reason: str) -> bool:
        """Ask the coordinator to end the job with ``code`` (one of ``membership.END_CODES``): every member gets
        ``fatal`` -- no new generation. False when membership had already ended (nobody to tell)."""
        if self._closed or self._client.fatal is not None:
            return False
        self._client.send({"t": "fail", "gen": self.generation, "reason": reason[:500], "end": code})
        return True

    def _on_interrupt(self, msg: dict[str, Any]) -> None:
        """Heartbeat thread: a new generation (abort), quorum wait, removal, fatal or lost coordinator; or the
        job's end (``finished``), which aborts only a step begun after the finished step."""
        now = time.monotonic()
        self._trace(f"interrupt {msg['t']}" + (f" gen {msg['gen']}" if "gen" in msg else "")
                    + (f" ({str(msg.get('reason'))[:120]})" if msg.get("reason") else ""))
        if msg["t"] == "finished":
            with self._lock:
                self._finished_step = int(msg["step"])
                beyond = self._in_step and self._step >= self._finished_step
                targets = [*self._children, *([self._comm] if self._comm is not None else [])] if beyond else []
            for c in targets:
                quiet_abort(c, f"the job finished at step {msg['step']} (member {msg.get('by')} finished)")
            return
        with self._lock:
            if msg["t"] == "gen":
                self._newest_gen = max(self._newest_gen, int(msg["gen"]))
                self._interrupt_at[int(msg["gen"])] = now
                reason = f"generation {msg['gen']} announced ({msg.get('reason')})"
            else:  # the client counted it (MemberClient.interruptions): a build announced before it is stale
                reason = str(msg.get("reason") or msg["t"])
            targets = [*self._children, *([self._comm] if self._comm is not None else [])]
            out = msg["t"] in ("removed", "fatal") or msg.get("final")
            if out:  # out: its own groups' ops must not wait
                targets += self._local_groups
            self._children = []
        cause = self._client.fatal if out else None  # set before this call: the error every later ft call raises
        for c in targets:
            quiet_abort(c, reason, cause)

    def _member_report(self) -> dict[str, Any]:
        """Heartbeat thread, on failover: what this member knows (see :mod:`torchnext.ft.election`)."""
        # Only a generation this member fully entered counts: a joiner whose heal the coordinator's death interrupted
        # does not hold the state yet (its step may even equal the committed one, e.g. resumed from a checkpoint).
        with self._lock:
            gen, step, vote, p = self._held, self._step, self._vote, self._provisional
        if p is not None:  # defer_commit: a step applied before its decision
            if p.decision is None:
                step = p.step  # not known committed: it counts as its vote only, as a vote awaiting its decision does
            else:
                vote = None  # decided (kept for confirm()): committed, as after a decision received at commit
        entered = None if gen is None else {k: gen[k] for k in ("gen", "term", "groups", "quorum", "step", "joiners")}
        if entered is not None and entered["quorum"] == entered["groups"]:
            del entered["quorum"]  # the receiver derives it (GENERATION_REF): the hello must fit the coordinator's line
        return {"step": step, "synced": gen is not None, "entered": entered, "vote": None if vote is None else dict(vote)}

    def _trace(self, what: str) -> None:
        self.trail.append(f"{time.monotonic():.3f} {what}")

    def _recent(self, n: int = 16) -> str:
        """The last ``n`` trail entries and this member's generation counters, for an error message."""
        return (f" [generation {self.generation}, attempted {self._attempted}, newest announced {self._newest_gen}, "
                f"pending {None if self._pending is None else self._pending['gen']}, coordinator "
                f"{self._client.address} ({self._client.role}, term {self._client.term}, failovers "
                f"{self._client.failovers}); last events: {' | '.join(list(self.trail)[-n:])}]")

    def _note_gen(self, msg: dict[str, Any]) -> None:
        self._trace(f"announced gen {msg['gen']}")
        with self._lock:
            self._newest_gen = max(self._newest_gen, int(msg["gen"]))
        if self._pending is None or msg["gen"] > self._pending["gen"]:
            self._pending = msg

    def _drain(self) -> None:
        while True:
            ev = self._client.next_event(0)
            if ev is None:
                return
            kind = ev["t"]
            if kind == "gen":
                self._note_gen(ev)
            elif kind == "fatal":
                self._raise_fatal()
            p = self._provisional
            if p is not None and p.decision is None and p.refusal is None:  # keep its fate for confirm()
                if kind == "decision" and ev["gen"] == p.gen and ev["step"] == p.step:
                    p.decision = ev
                elif kind == "gen":
                    p.refusal = f"generation {ev['gen']} announced before the decision ({ev.get('reason')})"
                elif kind == "wait":
                    p.refusal = f"the coordinator is waiting for a quorum ({ev.get('reason')})"

    def _report(self, reason: str, *, gen: int | None = None) -> None:
        """Tell the coordinator generation ``gen`` is broken -- by default the one this member is in; a generation
        whose build failed is reported as itself (this member is still in an older one, whose report the
        coordinator would ignore: the others then waited for that build until their deadline). Once per
        generation; not if a newer one is known."""
        gen = self.generation if gen is None else gen
        if gen and self._reported[0] != gen and self._newest_gen <= gen:
            self._reported = (gen, self._client.failovers, reason[:300])
            self._trace(f"report gen {gen} broken ({reason[:120]})")
            self._client.send({"t": "fail", "gen": gen, "reason": reason[:300]})

    def _report_again_after_failover(self) -> None:
        """A failure report made around a failover can be lost: sent to the coordinator that died, or to a standby
        before it took office (it drops them: no generation exists there yet), and a member's failover report
        does not carry it. Once a coordinator is in office since the report, report again (the coordinator
        ignores a report of a generation it already replaced)."""
        gen = self.generation
        reported_gen, failovers, reason = self._reported
        if gen and reported_gen == gen and self._newest_gen <= gen and self._client.failovers != failovers:
            self._reported = (gen, self._client.failovers, reason)
            self._trace(f"report gen {gen} broken again after failover {self._client.failovers}")
            self._client.send({"t": "fail", "gen": gen, "reason": f"(again, after a failover) {reason}"[:300]})

    def _settle(self, *, need_new: bool, timeout: float | None = None) -> None:
        """Bring this member into the newest generation announced; with ``need_new`` wait for one newer than the
        current (the current is broken). Failures while entering a generation wait for the next one."""
        limit = self.config.reconfigure_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._in_place = False  # settling may change the generation: the next attempt agrees by _lockstep
        while True:
            self._raise_fatal()
            self._client.news.clear()
            self._drain()
            msg = self._pending
            if msg is not None and msg["gen"] > max(self.generation, self._attempted):
                self._attempted = int(msg["gen"])  # a generation is entered at most once (its store prefix is single-use)
                self._trace(f"enter gen {msg['gen']}")
                # the build is called off by an interruption after this announcement arrived, not by one before
                # it (a standby's first generation comes after the lost coordinator's; judged from the moment this
                # thread looked, a failover that ran meanwhile made every member wait for a generation after it)
                if self._enter(msg, int(msg[ARRIVED_AFTER]), deadline):
                    self._trace(f"entered gen {msg['gen']}")
                    need_new = False
                else:
                    self._trace(f"gen {msg['gen']} not entered")
                    need_new = True
                continue
            if not need_new:
                return
            self._report_again_after_failover()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QuorumLost(f"member {self.member_id}: no new generation within {limit}s after generation "
                                 f"{self.generation} broke (is the coordinator's quorum reachable?)" + self._recent())
            self._client.news.wait(min(remaining, 0.5))

    def _begin_attempt(self) -> None:
        """Bring this member to the generation its next step attempt runs in (at ``ft.step()``).

        The ranks of a replica group must begin every attempt in the same generation (see :meth:`_lockstep`). After
        a commit they already agree without a collective: every rank of the group read the same coordinator
        messages up to the decision, in the same order (a group session relays them as they came; a decision
        exists only if every rank voted, and a generation announced before it refuses the commit at every rank).
        So after a commit whose decision named no new generation, the next attempt starts in the committed
        generation as is -- an announcement that arrived after the decision is left for after this attempt (it
        aborted the generation's Communicator: the attempt fails at its first fault-tolerant op, at every rank,
        and the one after it agrees as below). Reference::

            if last attempt committed and its decision had no "next" and this group has local groups:
                pass                                              # no settle, no all_reduce
            else:
                settle into the newest generation announced; _lockstep()  # one tiny all_reduce per round

        A member without replica-group siblings (``group_size == 1`` or no local group registered) settles as
        before: nothing of its own pairs op by op with another rank's attempt. Only a group session (the leader
        relays one stream to its followers) agrees this way; a replica group whose ranks each hold their own
        coordinator connection (``group_session=False``) runs :meth:`_lockstep` at every attempt, since around a
        coordinator failover the old coordinator's decision may have reached only some of them.
        """
        with self._lock:
            in_place, self._in_place = self._in_place, False
        if in_place and self._agrees_without_lockstep():
            self._raise_fatal()
            return
        self._settle(need_new=False)
        self._lockstep()

    def _agrees_without_lockstep(self) -> bool:
        """A replica group whose ranks read one relayed stream (a group session): flat sessions of one group's
        ranks can part around a coordinator failover (the old coordinator's decision reached some of them only)."""
        return (self.group_size > 1 and bool(self._local_groups) and self._comm is not None
                and self.session in ("leader", "follower"))

    def _after_commit(self) -> None:
        """At the end of a committed attempt (``ft.step()``'s exit): settle into a generation announced meanwhile,
        unless the next attempt begins in place (see :meth:`_begin_attempt`) -- then settling here would let one
        rank of the group move on while a sibling, which has not read the announcement yet, stays."""
        with self._lock:
            in_place = self._in_place
        if in_place and self._agrees_without_lockstep():
            return
        self._settle(need_new=False)

    def _lockstep(self) -> None:
        """The ranks of this replica group start every step attempt in the same generation (run at ``ft.step()``).

        A replica group's own collectives (its FSDP shard group: all-gathers, reduce-scatters) pair op by op, in
        any generation; the fault-tolerant ones belong to one. Without agreement, a rank that settled before a new
        generation's announcement arrived begins the attempt in the old generation while its sibling begins it in
        the new one: their shard-group ops still pair, but their attempts no longer do, and every later generation
        stalls on an op timeout (seen in the HSDP chaos test). Reference, on the group registered with
        :meth:`register_local_group` (the first one; one tiny all_reduce per round, usually one round)::

            while True:
                hi, lo = max over the group of generation, min over the group of generation
                if hi == lo: return
                if generation < hi: catch up to generation >= hi      # its announcement is on its way
        """
        if self.group_size <= 1 or not self._local_groups:
            return
        group = self._local_groups[0]
        while True:
            t = torch.tensor([self.generation, -self.generation], dtype=torch.int64)
            self.lockstep_rounds += 1
            try:
                if isinstance(group, Communicator):
                    group.all_reduce(t, "max")
                else:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            except (CommError, RuntimeError) as exc:  # a sibling is gone: this group's verdict is on its way
                self._await_verdict(exc)
            hi, lo = int(t[0]), -int(t[1])
            if hi == lo:
                return
            self._catch_up(hi)

    def _catch_up(self, gen: int) -> None:
        """Enter generation ``gen`` (or a newer one) whose announcement a sibling has already seen."""
        limit = self.config.reconfigure_timeout_s
        deadline = time.monotonic() + limit
        while self.generation < gen:
            self._settle(need_new=False)
            if self.generation >= gen:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QuorumLost(f"member {self.member_id}: generation {gen}, which a rank of replica group "
                                 f"{self.replica_group} entered, was not announced here within {limit}s"
                                 + self._recent())
            self._client.news.wait(min(remaining, 0.05))

    def _await_verdict(self, exc: BaseException) -> None:
        """A replica-group collective failed: a sibling died, so this group is being removed. Raise the
        coordinator's verdict (``RemovedFromGroup``, ...) once it arrives; ``exc`` if none comes in time."""
        deadline = time.monotonic() + self.config.timeout_s
        while time.monotonic() < deadline:
            self._raise_fatal()
            self._drain()
            self._client.news.wait(0.05)
            self._client.news.clear()
        raise exc

    def _enter(self, msg: dict[str, Any], epoch: int, deadline: float) -> bool:
        """Build generation ``msg``'s Communicator, heal, run callbacks. False if interrupted or failed."""
        gen = int(msg["gen"])
        members = [int(m) for m in msg["members"]]
        groups = _groups(msg)
        me = self.member_id
        marks = {"start": time.monotonic()}
        if gen in self._interrupt_at:
            marks["interrupt"] = self._interrupt_at[gen]
        if me not in members:
            raise RemovedFromGroup(f"you were removed: member {me} is not in generation {gen} {members}")
        self._settle_provisional(gen, int(msg["step"]))
        if len(groups) < self.config.min_size:
            raise QuorumLost(f"generation {gen} has {len(groups)} replica group(s), fewer than min_size="
                             f"{self.config.min_size}")
        mine = next(g for g in groups if me in g)
        gr = mine.index(me)
        peers = [g[gr] for g in groups]  # rank gr of every replica group: this member's replicate Communicator
        with self._lock:
            old, self._comm = self._comm, None
            children, self._children = self._children, []
        for c in [*children, *([old] if old is not None else [])]:
            quiet_abort(c, f"superseded by generation {gen}")
        if self.fault_hook is not None:
            self.fault_hook("reconfigure")
        comm = self._build(gen, tuple(peers), groups.index(mine), epoch, deadline)
        if comm is None:
            return False
        self._gen = msg
        self._pending = None
        marks["built"] = time.monotonic()
        healed: HealStats | None = None
        joiners = [int(j) for j in msg["joiners"]]
        donor = int(msg["donors"][gr]) if "donors" in msg else int(msg["donor"])  # shard by shard
        peer_joiners = [j for j in joiners if j in peers]
        try:
            if peer_joiners and self._state_fn is not None:
                healed = self._heal(comm, peers, donor, peer_joiners, int(msg["step"]))
        except CommError as exc:
            self._report(f"healing failed: {exc}")
            return False
        if me not in joiners and self._step != int(msg["step"]):
            raise RuntimeError(f"member {me}: local committed step count {self._step} differs from generation "
                               f"{gen}'s {msg['step']} (a commit was lost or applied twice: this is a bug)")
        if me in joiners:
            self._step = int(msg["step"])
        marks["healed"] = time.monotonic()
        info = Reconfiguration(
            generation=gen, members=tuple(members), rank=groups.index(mine), size=len(groups), step=self._step,
            donor=donor, joiners=tuple(joiners), reason=str(msg.get("reason", "")), healed=healed, timings=marks,
            groups=tuple(tuple(g) for g in groups),
        )
        with self._lock:
            self._held = msg
        if me in joiners and healed is not None:
            self.heals_received += 1
        self.reconfigurations.append(info)
        for cb in self._callbacks.snapshot:
            cb(info)
        return True

    def _build(self, gen: int, members: tuple[int, ...], rank: int, epoch: int,
               deadline: float) -> Communicator | None:
        """Connect generation ``gen``'s Communicator in a helper thread; give up (None) when a newer generation, a
        quorum wait or a fatal error arrives first. An abandoned build is aborted when it finishes. Its ``ranks``
        are the member ids."""
        size = len(members)
        cfg = self.config
        box: dict[str, Any] = {}
        done = threading.Event()
        news = self._client.news

        def build() -> None:
            try:
                # A store connection of its own (a TCPStore client serialises its requests), cancellable: a build
                # superseded while it waits for a member that died ends at once, instead of holding its thread,
                # connection and half-built backend for the whole timeout.
                store = CancellableStore(dist.TCPStore(self._client.store_host, self._client.store_port, None,
                                                       False, timeout=timedelta(seconds=cfg.timeout_s)))
                with self._lock:
                    box["store"] = store
                    if box.get("abandoned"):  # abandoned while this connected: nothing to wait for
                        store.cancel(f"generation {gen} was abandoned before its build connected")
                name = f"{cfg.name}.g{gen}" + (f".r{self.group_rank}" if self.group_size > 1 else "")
                c = Communicator(store, rank, size, backend=cfg.backend, name=name,
                                 timeout=timedelta(seconds=cfg.timeout_s), device=cfg.device,
                                 global_ranks=members, check_collectives=cfg.check_collectives)
                c.register_post_hook(quarantine_cancelled)
                with self._lock:
                    if box.get("abandoned"):
                        quiet_abort(c, "abandoned build")
                    else:
                        box["comm"] = c
            except BaseException as exc:
                # only its text is reported: its frames (this one holds the build's store client; the half-built
                # Communicator's holds its backend's sockets) would otherwise stay alive in a cycle through ``box``
                box["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                done.set()
                news.set()

        threading.Thread(target=build, name=f"torchnext-ft-build[g{gen}]", daemon=True).start()
        while True:
            with self._lock:
                stale = (self._newest_gen > gen or self._client.interruptions != epoch
                         or self._client.fatal is not None)
                if stale or done.is_set():
                    comm = box.get("comm")
                    if stale:
                        self._trace(f"build of gen {gen} abandoned (newest announced {self._newest_gen}, "
                                    f"interruptions {self._client.interruptions} vs {epoch} at its announcement, "
                                    f"fatal {self._client.fatal is not None})")
                        box["abandoned"] = True
                        _cancel_build(box, f"superseded before use (generation {gen})")
                        if comm is not None:
                            quiet_abort(comm, f"superseded before use (generation {gen})")
                        return None
                    if comm is not None:
                        self._comm = comm
                        return comm
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._trace(f"build of gen {gen}: the reconfiguration deadline passed")
                with self._lock:
                    box["abandoned"] = True
                    _cancel_build(box, f"generation {gen}: the reconfiguration deadline passed")
                self._report(f"building generation {gen} ran out of the reconfiguration deadline", gen=gen)
                return None
            news.clear()
            if not done.is_set() and self._newest_gen <= gen:
                news.wait(min(remaining, 0.5))
        self._report(f"building generation {gen} failed: {box.get('error')}", gen=gen)
        return None

    def _heal(self, comm: Communicator, members: list[int], donor: int, joiners: list[int], step: int) -> HealStats | None:
        me = self.member_id
        assert self._state_fn is not None and self._load_fn is not None
        droot = members.index(donor)
        broadcast = len(joiners) > 1 and set(joiners) == set(members) - {donor}
        if me == donor:
            if self.fault_hook is not None:
                self.fault_hook("healing")
            state = self._state_fn()
            if broadcast:
                return send_state(comm, state, step=step, dst=None, chunk_bytes=self.config.heal_chunk_bytes)
            stats = None
            for j in joiners:
                stats = send_state(comm, state, step=step, dst=members.index(j), chunk_bytes=self.config.heal_chunk_bytes)
            return stats
        if me in joiners:
            with torch.no_grad():
                state, got_step, stats = recv_state(comm, src=droot, broadcast=broadcast, into=self._state_fn())
            if got_step != step:
                raise RuntimeError(f"healing: donor {donor} sent step {got_step}, generation says {step}")
            self._load_fn(state)
            return stats
        return None


def _cancel_build(box: dict[str, Any], why: str) -> None:
    """Call off an abandoned build's store waits (it then raises in its thread and releases what it made)."""
    store = box.get("store")
    if store is not None:
        store.cancel(why)


def _preload_gil_heavy_imports() -> None:
    """Import ``torch._dynamo`` before the heartbeat thread starts. ``torch.optim`` and ``torch.compile`` import it on
    first use; the import runs seconds and holds the GIL for up to ~0.8 s at a time on a loaded 2-core machine
    (measured: 4 processes, load 6) -- longer than the default heartbeat timeout (0.6 s), so a member that creates
    its optimizer after joining was removed for "missed heartbeats". Done here, it costs nothing extra (every
    optimizer pays it anyway) and happens before this member is on the clock."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # an optional warm-up; a broken dynamo shows up where it is really used
        pass


def _groups(msg: dict[str, Any]) -> list[list[int]]:
    """A generation message's replica groups (member ids by group rank), in rank order; one per member before
    replica groups existed."""
    if "groups" in msg:
        return [[int(m) for m in g] for g in msg["groups"]]
    return [[int(m)] for m in msg["members"]]


def _replica_group(cfg: FaultTolerantConfig, env_group: int) -> tuple[int | None, int, int]:
    """(replica group id or None, group rank, group size) from the config, else ``TORCHNEXT_FT_REPLICA_GROUP`` and
    torchrun's RANK/WORLD_SIZE (one torchrun job per replica group)."""
    group = cfg.replica_group if cfg.replica_group is not None else (env_group if env_group >= 0 else None)
    if group is None:
        if (cfg.group_rank or 0) != 0 or (cfg.group_size or 1) != 1:
            raise ValueError("FaultTolerantConfig.group_rank/group_size need a replica_group")
        return None, 0, 1
    rank, size = cfg.group_rank, cfg.group_size
    if rank is None or size is None:
        from torchnext._config import dist_env

        try:
            env = dist_env()
        except ValueError as exc:
            raise ValueError(f"replica group {group}: set FaultTolerantConfig.group_rank and group_size, or run under "
                             f"torchrun (one torchrun job per replica group): {exc}") from None
        rank = env.rank if rank is None else rank
        size = env.world_size if size is None else size
    if not 0 <= rank < size:
        raise ValueError(f"replica group {group}: group_rank={rank} must be in [0, group_size={size})")
    return group, rank, size


