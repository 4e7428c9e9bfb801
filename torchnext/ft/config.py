"""What a fault-tolerant member is configured with, and what it reports after each reconfiguration."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchnext.ft.healing import DEFAULT_CHUNK_BYTES, HealStats

__all__ = ["FaultTolerantConfig", "Reconfiguration"]


@dataclass(kw_only=True)
class FaultTolerantConfig:
    """How a member reaches the coordinator and builds each generation's Communicator."""

    coordinator: str | None = None
    """``host:port`` of the coordinator (None: ``TORCHNEXT_FT_COORDINATOR``)."""
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
    """Silence from the coordinator (it pings every heartbeat interval) after which ``CoordinatorLost`` is raised."""
    heal_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    name: str = "ft"
    """Communicator name prefix; generation g is named ``<name>.g<g>``."""

    def __post_init__(self) -> None:
        for f in ("timeout_s", "join_timeout_s", "reconfigure_timeout_s", "connect_timeout_s", "coordinator_timeout_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"FaultTolerantConfig.{f} must be a positive number of seconds, got {v!r}")
        if not isinstance(self.min_size, int) or self.min_size < 1:
            raise ValueError(f"FaultTolerantConfig.min_size must be an int >= 1, got {self.min_size!r}")
        if self.heal_chunk_bytes <= 0:
            raise ValueError(f"FaultTolerantConfig.heal_chunk_bytes must be positive, got {self.heal_chunk_bytes}")


@dataclass(frozen=True)
class Reconfiguration:
    """What an ``on_reconfigure`` callback receives (also kept in ``ft.reconfigurations``)."""

    generation: int
    members: tuple[int, ...]
    rank: int
    size: int
    step: int
    donor: int
    joiners: tuple[int, ...]
    reason: str
    healed: HealStats | None
    """Transfer stats when this member sent or received state, else None."""
    timings: dict[str, float] = field(default_factory=dict)
    """``time.monotonic()`` marks: ``interrupt`` (heartbeat thread got the generation; absent for a grow),
    ``start``, ``built``, ``healed``."""
