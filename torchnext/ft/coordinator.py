"""The coordinator: hosts the job's ``TCPStore`` and the membership service, outside every rank.

Run it as a process (``torchnext coordinator --host 127.0.0.1 --port 29400``) or in-process for launchers and tests::

    with Coordinator(CoordinatorConfig(membership=MembershipConfig(min_size=2, initial_size=4))) as coord:
        launch_ranks(coordinator=coord.address, token=coord.token)      # ranks use FaultTolerant(...)

What it does:

* binds **only** to ``host`` (default 127.0.0.1): the membership port and the store port (c10d ``TCPStore``, on a
  listening socket we bind ourselves and hand to it, because ``TCPStore`` alone would listen on every interface);
* authenticates every member with the job token (a shared secret; challenge and response both ways, the token
  never crosses the wire) -- JSON lines only, schema-checked, no pickle (:mod:`~torchnext.ft.service`);
* keeps one persistent connection per member: a crash closes it (seen in ~1 ms); a member that stops sending
  heartbeats is declared failed after ``heartbeat_timeout_s``; the decisions are :class:`~.membership.Membership`'s;
* pings every member each heartbeat interval so members notice a dead or hung coordinator.

Failover: give members several addresses (``TORCHNEXT_FT_COORDINATOR=host1:port1,host2:port2``) and run a
**standby** at the others (``torchnext coordinator --standby``, same ``TORCHNEXT_FT_TOKEN``). A standby is not in
office: it refuses new members and waits for members that lost their coordinator; once their reports satisfy the
takeover rule (:mod:`~torchnext.ft.election`) it takes office with a higher term, rebuilds the job's state from
the reports and serves the next generations from its own store. A restarted coordinator must be started as a
standby too (a plain start begins a new job and refuses to resume one).

Trust boundary: the store (torch's ``TCPStore``) has no authentication. Anyone who can reach its port can read and
write the keys of every generation. It is bound to ``host`` only; keep that interface on the job's private network.
Secrets never go through it: the job token is only used in HMAC proofs on the membership port.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchnext.ft.membership import MembershipConfig
from torchnext.ft.service import MembershipService

__all__ = ["Coordinator", "CoordinatorConfig", "add_arguments", "bound_store", "run"]


@dataclass(kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and how it decides."""

    host: str = "127.0.0.1"
    """Interface to bind (membership and store). Keep the default unless ranks run on other machines."""
    port: int = 0
    """Membership port (0: a free port, see ``Coordinator.port``)."""
    store_port: int = 0
    """TCPStore port (0: a free port; members learn it from the coordinator)."""
    token: str | None = None
    """Job token members must present (None: a random one, see ``Coordinator.token``; a standby needs the job's)."""
    standby: bool = False
    """Start as a standby: not in office until members that lost their coordinator report (see the module
    docstring)."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """Failure detection and quorum policy."""

    def __post_init__(self) -> None:
        if self.standby and not self.token:
            raise ValueError("CoordinatorConfig(standby=True) needs the job's token (the members' TORCHNEXT_FT_TOKEN)")
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise ValueError("CoordinatorConfig.token must be a non-empty string")


class Coordinator:
    """In-process coordinator: ``start()`` (or ``with``) launches its thread; ``stop()`` closes everything.

    Read-only views (thread-safe snapshots): ``in_office``, ``term``, ``generation``, ``members``, ``step``,
    ``history()``.
    """

    def __init__(self, config: CoordinatorConfig | None = None) -> None:
        self.config = config or CoordinatorConfig()
        if not isinstance(self.config, CoordinatorConfig):
            raise TypeError(f"config must be a CoordinatorConfig, got {type(self.config).__name__}")
        self.token = self.config.token or secrets.token_hex(16)
        self._service: MembershipService | None = None
        self._store: Any = None
        self._stopped = False
        self.port = 0
        self.store_port = 0

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Coordinator:
        cfg = self.config
        self._store = bound_store(cfg.host, cfg.store_port)
        self.store_port = self._store.port
        self._service = MembershipService(host=cfg.host, port=cfg.port, token=self.token, store_port=self.store_port,
                                          membership=cfg.membership, standby=cfg.standby)
        self.port = self._service.port
        self._service.start()
        return self

    def stop(self) -> None:
        """Close every connection and the store (members fail over, or see ``CoordinatorLost``). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._service is not None:
            self._service.stop()
        self._store = None

    def __enter__(self) -> Coordinator:
        return self.start() if self._service is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` of the membership service (what members are given)."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def serving(self) -> bool:
        """The service thread is alive (it is, unless stopped: no input ends it)."""
        return self._service is not None and self._service.alive()

    @property
    def stalls(self) -> int:
        """How many times the coordinator's own loop was descheduled and forgave missed heartbeats (at most once per
        two heartbeat timeouts)."""
        return 0 if self._service is None else self._service.stalls

    def _view(self, fn: Callable[[Any], Any], default: Any) -> Any:
        svc = self._service
        if svc is None:
            return default
        with svc.lock:
            return default if svc.state is None else fn(svc.state)

    @property
    def in_office(self) -> bool:
        """False for a standby until it took office."""
        return bool(self._view(lambda st: True, False))

    @property
    def term(self) -> int:
        """Term of office (0 while standing by)."""
        return int(self._view(lambda st: st.term, 0))

    @property
    def generation(self) -> int:
        return int(self._view(lambda st: st.gen, 0))

    @property
    def members(self) -> tuple[int, ...]:
        return tuple(self._view(lambda st: st.members, ()))

    @property
    def step(self) -> int:
        """Committed steps."""
        return int(self._view(lambda st: st.step, 0))

    @property
    def finished_step(self) -> int | None:
        """The committed step at which the job finished (a member called ``FaultTolerant.finish``), else None."""
        return self._view(lambda st: st.finished_step, None)

    def outcome(self) -> str | None:
        """None while the job runs or members are still connected; else ``"finished at step S"`` or ``"failed:
        <reason>"`` (the job is over and every member left)."""
        svc = self._service
        if svc is None:
            return None
        with svc.lock:
            st = svc.state
            if st is None or st.live or svc._by_member:
                return None
            if st.finished_step is not None:
                return f"finished at step {st.finished_step}"
            if st.fatal is not None:
                return f"failed: {st.fatal}"
            return None

    def history(self) -> list[dict[str, Any]]:
        """Reports, takeover, joins, failures, generations, in order, with monotonic timestamps
        (``time.monotonic``)."""
        return [] if self._service is None else self._service.history()

    def wait_until(self, predicate: Callable[[Coordinator], bool], timeout: float) -> bool:
        """Poll ``predicate(self)`` until true (returns True) or ``timeout`` seconds pass (returns False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            time.sleep(0.005)
        return predicate(self)


# ----------------------------------------------------------------------------------------------------- the CLI
def bound_store(host: str, port: int = 0) -> Any:
    """A c10d ``TCPStore`` server listening on ``host`` only (``port`` 0: a free one, in ``.port``). ``TCPStore``
    alone listens on every interface; here we bind the socket and hand it over (``master_listen_fd``)."""
    import torch.distributed as dist

    listener = socket.create_server((host, port), backlog=1024)
    bound = listener.getsockname()[1]
    return dist.TCPStore(host, bound, None, True, timeout=timedelta(seconds=60), wait_for_workers=False,
                         master_listen_fd=listener.detach(), use_libuv=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MembershipConfig()
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29400, help="membership port (default 29400; 0: free port)")
    parser.add_argument("--store-port", type=int, default=0, help="TCPStore port (default: a free port)")
    parser.add_argument("--min-size", type=int, default=d.min_size, help="smallest generation (quorum)")
    parser.add_argument("--initial-size", type=int, default=None, help="members needed for the first generation")
    parser.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s, help="seconds")
    parser.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s, help="seconds")
    parser.add_argument("--quorum-timeout", type=float, default=d.quorum_timeout_s, help="seconds")
    parser.add_argument("--group-heartbeat-interval", type=float, default=None,
                        help="seconds: a follower's heartbeats to its group's leader (group sessions; default: "
                             "--heartbeat-interval)")
    parser.add_argument("--group-heartbeat-timeout", type=float, default=None,
                        help="seconds: a leader declares a silent follower failed after this (default: "
                             "--heartbeat-timeout)")
    parser.add_argument("--relay-min-groups", type=int, default=d.relay_min_groups,
                        help="vote relays (protocol 5) for a generation of at least this many group sessions offering "
                             f"a relay listener (default {d.relay_min_groups})")
    parser.add_argument("--relay-fanout", type=int, default=None,
                        help="sessions per relay chunk (default: max(64, ceil(sqrt(sessions))))")
    parser.add_argument("--standby", action="store_true",
                        help="start as a standby: take office only when members that lost their coordinator report "
                             "to it (needs TORCHNEXT_FT_TOKEN, the job's token)")
    parser.add_argument("--exit-when-done", action=argparse.BooleanOptionalAction, default=True,
                        help="exit once the job is over and every member left: 0 after FaultTolerant.finish(), 1 "
                             "after the job failed (default: on)")


def run(args: argparse.Namespace) -> int:
    """``torchnext coordinator``: serve until SIGINT/SIGTERM, or (``--exit-when-done``, the default) until the job is
    over and every member left: exit 0 when it finished (``FaultTolerant.finish``), 1 when it failed (quorum or state
    lost). The token comes from TORCHNEXT_FT_TOKEN or is generated and printed (members need it). SIGUSR2 prints
    every thread's Python stack to stderr (a stuck coordinator tells where it is stuck)."""
    import faulthandler

    from torchnext._config import env_config

    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)

    try:
        membership = MembershipConfig(
            min_size=args.min_size, initial_size=args.initial_size, heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout, quorum_timeout_s=args.quorum_timeout,
            group_heartbeat_interval_s=args.group_heartbeat_interval,
            group_heartbeat_timeout_s=args.group_heartbeat_timeout,
            relay_min_groups=args.relay_min_groups, relay_fanout=args.relay_fanout,
        )
    except ValueError as exc:
        print(f"torchnext coordinator: {exc}")
        return 2
    token = env_config().ft_token
    try:
        coord = Coordinator(CoordinatorConfig(host=args.host, port=args.port, store_port=args.store_port, token=token,
                                              membership=membership, standby=args.standby))
    except ValueError as exc:
        print(f"torchnext coordinator: {exc}")
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    coord.start()
    role = "standby" if args.standby else "in office"
    print(f"torchnext coordinator listening on {coord.address} (store port {coord.store_port}, {role})", flush=True)
    if token is None:
        print(f"job token: {coord.token} (set TORCHNEXT_FT_TOKEN on the members)", flush=True)
    rc = 0
    try:
        while not stop.wait(0.2):
            outcome = coord.outcome() if args.exit_when_done else None
            if outcome is not None:
                print(f"torchnext coordinator: the job {outcome}; every member left, exiting", flush=True)
                rc = 0 if outcome.startswith("finished") else 1
                break
    finally:
        coord.stop()
    return rc
