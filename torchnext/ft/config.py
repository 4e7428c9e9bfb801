"""What a fault-tolerant member is configured with, and what it reports after each reconfiguration."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchnext.ft.healing import DEFAULT_CHUNK_BYTES, HealStats

__all__ = ["FaultTolerantConfig", "Reconfiguration"]


@dataclass(kw_only=True)
class FaultTolerantConfig:
    """How a member reaches the coordinator and builds each generation's Communicator."""

    coordinator: str | None = None
    """``host:port`` of the coordinator, or an ordered list ``host1:port1,host2:port2`` for failover (the first in
    office is used; on its loss the member tries them in order, see :mod:`torchnext.ft.member`). None:
    ``TORCHNEXT_FT_COORDINATOR``."""
    token: str | None = None
    """Job token (None: ``TORCHNEXT_FT_TOKEN``)."""
    member_id: int | None = None
    """Stable id to ask for (None: assigned by the coordinator). A removed id is never accepted again."""
    min_size: int = 1
    """Refuse (``QuorumLost``) generations smaller than this, in addition to the coordinator's own rule."""
    backend: str = "gloo"
    device: str | None = None
    timeout_s: float = 60.0
    """Default op timeout of each generation's Communicator and bound on a commit decision: a safety net only --
    failures are detected by membership (heartbeats, closed connections) long before."""
    join_timeout_s: float = 60.0
    """Wait at most this long for the first generation."""
    reconfigure_timeout_s: float = 60.0
    """Wait at most this long for the next generation after a failure."""
    connect_timeout_s: float = 10.0
    coordinator_timeout_s: float = 2.0
    """Silence from the coordinator (it pings every heartbeat interval) after which it counts as lost (the member
    fails over)."""
    failover_timeout_s: float = 10.0
    """After losing its coordinator, look this long for one in office (a standby that takes over, a restarted one)
    before ``CoordinatorLost``: a member cut off from the majority stops after this."""
    max_retries: int = 100
    """Failed attempts in a row one step may take before ``ft.step()`` gives up: when the same committed-step count
    fails ``max_retries + 1`` attempts (transient failures -- a peer died, an op was aborted or timed out, the
    commit was refused), the member raises :class:`~torchnext.ft.RetriesExhausted` naming the step and the last
    failures, and ends the job (every other member raises it too). A commit resets the count; 0: the first failure
    raises. Default 100: every real failure costs one attempt and removes its cause (a dead member leaves, a joiner
    heals), so a healthy job fails one step a handful of times at most -- even a large job whose members fail
    together (each simultaneous failure batched into one generation) -- while 100 consecutive failures at one step
    mean a systematic cause (a member that crashes at this step after every restart, a flapping link, an error
    misclassified as transient) that would otherwise cycle through generations forever; at a reconfiguration's
    cost (well under a second to a few seconds) 100 attempts end it within minutes."""
    check_collectives: bool | None = None
    """Consistency mode of every generation's Communicator (``Communicator(..., check_collectives=)``): a collective
    whose members disagree raises ``CollectiveMismatch`` on every member, which ``ft.step()`` re-raises (no retry,
    no new generation). None: ``TORCHNEXT_CHECK_COLLECTIVES`` (see :mod:`torchnext.comms.consistency`)."""
    heal_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    name: str = "ft"
    """Communicator name prefix; generation g is named ``<name>.g<g>`` (``<name>.g<g>.r<rank>`` in replica groups
    of more than one rank: one replicate Communicator per group rank)."""
    replica_group: int | None = None
    """This process's replica group -- the failure domain whose ranks share fate -- or None: a group of its own
    (``TORCHNEXT_FT_REPLICA_GROUP``). One ``torchrun --nproc-per-node S`` per group: group id per torchrun job."""
    group_rank: int | None = None
    """Rank within the replica group (None: torchrun's ``RANK`` when ``replica_group`` is set, else 0)."""
    group_size: int | None = None
    """Ranks per replica group, the same for every group (None: torchrun's ``WORLD_SIZE`` when ``replica_group`` is
    set, else 1)."""

    group_session: bool | None = None
    """Hold a group session (protocol 4, docs/fault_tolerance.md "Membership hierarchy") when this replica group has
    more than one rank: rank 0 (the leader) holds the group's one connection to the coordinator and relays for the
    others over an authenticated local channel; the coordinator's load then grows with replica groups, not ranks.
    None (the default): ``TORCHNEXT_FT_GROUP_SESSION`` (unset: on); False: every rank connects to the coordinator
    itself (flat), as before protocol 4. A group of one rank is always its own session."""
    leader_address: str | None = None
    """``host:port`` where rank 0 of this replica group listens for its other ranks in a group session (the same
    for every rank of the group; ``TORCHNEXT_FT_LEADER_ADDRESS`` when unset). None: derived -- rank 0 binds a free
    port and publishes the address in the store of the default process group, when that group is exactly this
    replica group (``init_process_group(rank=group_rank, world_size=group_size)`` before ``FaultTolerant``, as
    FSDP2/HSDP, DiLoCo and torchtitan do); without such a store the member connects flat (logged, and
    :attr:`FaultTolerant.session` says why). Ignored for a group of one rank or with ``group_session=False``."""
    defer_commit: bool = False
    """Await each step's commit decision one step later, its optimizer update applied provisionally and revoked if
    the decision is a refusal (:mod:`torchnext.ft.provisional`: the exact semantics): the coordinator round trip
    leaves the step's critical path, for one more copy of the state (``state_dict``/``load_state_dict`` are then
    required) and one more attempt per refused step. End the loop with ``while ft.step_count < total or not
    ft.confirm()``. One rank per replica group only (``group_size > 1`` is refused: see the module)."""

    def __post_init__(self) -> None:
        if self.group_session is not None and not isinstance(self.group_session, bool):
            raise ValueError(f"FaultTolerantConfig.group_session must be None or a bool, got {self.group_session!r}")
        if self.leader_address is not None:
            host, _, port = str(self.leader_address).rpartition(":")
            if not isinstance(self.leader_address, str) or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ValueError(f"FaultTolerantConfig.leader_address must be 'host:port', got {self.leader_address!r}")
        for f in ("timeout_s", "join_timeout_s", "reconfigure_timeout_s", "connect_timeout_s", "coordinator_timeout_s",
                  "failover_timeout_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"FaultTolerantConfig.{f} must be a positive number of seconds, got {v!r}")
        if not isinstance(self.min_size, int) or self.min_size < 1:
            raise ValueError(f"FaultTolerantConfig.min_size must be an int >= 1, got {self.min_size!r}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"FaultTolerantConfig.max_retries must be an int >= 0, got {self.max_retries!r}")
        if not isinstance(self.defer_commit, bool):
            raise ValueError(f"FaultTolerantConfig.defer_commit must be a bool, got {self.defer_commit!r}")
        if self.check_collectives is not None and not isinstance(self.check_collectives, bool):
            raise ValueError(f"FaultTolerantConfig.check_collectives must be None or a bool, got "
                             f"{self.check_collectives!r}")
        if self.heal_chunk_bytes <= 0:
            raise ValueError(f"FaultTolerantConfig.heal_chunk_bytes must be positive, got {self.heal_chunk_bytes}")
        for f, low in (("replica_group", 0), ("group_rank", 0), ("group_size", 1)):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"FaultTolerantConfig.{f} must be None or an int >= {low}, got {v!r}")
        if self.group_rank is not None and self.group_size is not None and self.group_rank >= self.group_size:
            raise ValueError(f"FaultTolerantConfig.group_rank={self.group_rank} must be < group_size={self.group_size}")

    def check_timeouts(self, *, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                       quorum_timeout_s: float | None, grow_timeout_s: float | None,
                       group_heartbeat_interval_s: float | None = None,
                       group_heartbeat_timeout_s: float | None = None) -> None:
        """The timeout hierarchy, checked against the coordinator's settings when joining (docs/fault_tolerance.md).
        Each rule names the two values it compares::

            coordinator_timeout_s  >  2 * heartbeat_interval_s   # one late ping never ends membership
            failover_timeout_s     >  heartbeat_timeout_s         # outwait a standby's wait for the last reports
            timeout_s              >  heartbeat_timeout_s         # a hang is removed before an op times out on it
            reconfigure_timeout_s  >= quorum_timeout_s            # members outwait the coordinator's quorum wait
            join_timeout_s         >  grow_timeout_s              # a joiner outwaits the coordinator's forced grow
            # a group session (protocol 4: the welcome carries the local level's settings)
            coordinator_timeout_s  >  2 * group_heartbeat_interval_s  # a follower: one late relay never ends it
            timeout_s              >  group_heartbeat_timeout_s   # a hung follower is reported before an op times out

        Raises:
            ValueError: a rule is broken (healing or reconfiguration would otherwise dead-lock or give up early).
        """
        rules = [
            ("coordinator_timeout_s", self.coordinator_timeout_s, ">", "2 * heartbeat_interval_s",
             2 * heartbeat_interval_s, "the member would declare the coordinator lost after one late ping"),
            ("failover_timeout_s", self.failover_timeout_s, ">", "heartbeat_timeout_s", heartbeat_timeout_s,
             "a standby waits up to heartbeat_timeout_s for the last members' reports before taking office"),
            ("timeout_s", self.timeout_s, ">", "heartbeat_timeout_s", heartbeat_timeout_s,
             "a hung member must be removed before the survivors' ops time out on it"),
        ]
        if quorum_timeout_s is not None:
            rules.append(("reconfigure_timeout_s", self.reconfigure_timeout_s, ">=", "quorum_timeout_s",
                          quorum_timeout_s, "members would give up while the coordinator still waits for joiners"))
        if grow_timeout_s is not None:
            rules.append(("join_timeout_s", self.join_timeout_s, ">", "grow_timeout_s", grow_timeout_s,
                          "a joiner would give up before the coordinator grows the group to admit it"))
        if group_heartbeat_interval_s is not None:
            rules.append(("coordinator_timeout_s", self.coordinator_timeout_s, ">", "2 * group_heartbeat_interval_s",
                          2 * group_heartbeat_interval_s,
                          "a follower would declare its leader lost after one late relayed ping"))
        if group_heartbeat_timeout_s is not None:
            rules.append(("timeout_s", self.timeout_s, ">", "group_heartbeat_timeout_s", group_heartbeat_timeout_s,
                          "a hung follower must be reported by its leader before the survivors' ops time out on it"))
        for name, value, rel, other, bound, why in rules:
            ok = value > bound if rel == ">" else value >= bound
            if not ok:
                raise ValueError(f"timeout hierarchy: FaultTolerantConfig.{name}={value} must be {rel} the "
                                 f"coordinator's {other}={bound} ({why})")


@dataclass(frozen=True)
class Reconfiguration:
    """What an ``on_reconfigure`` callback receives (also kept in ``ft.reconfigurations``)."""

    generation: int
    members: tuple[int, ...]
    """Every member of the generation (all ranks of all replica groups), sorted."""
    rank: int
    """This replica group's rank among the generation's groups (= the rank in the replicate Communicator)."""
    size: int
    """Number of replica groups in the generation."""
    step: int
    donor: int
    joiners: tuple[int, ...]
    reason: str
    healed: HealStats | None
    """Transfer stats when this member sent or received state, else None."""
    timings: dict[str, float] = field(default_factory=dict)
    """``time.monotonic()`` marks: ``interrupt`` (heartbeat thread got the generation; absent for a grow),
    ``start``, ``built``, ``healed``."""
    groups: tuple[tuple[int, ...], ...] = ()
    """The generation's replica groups (member ids by group rank), in rank order."""
