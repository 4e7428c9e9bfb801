"""Streaming DiLoCo: DiLoCo by fragments, each synchronized at its own time, overlapped with the inner steps.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the parameters into ``P`` fragments. Fragment
``p`` takes its outer step every ``H`` inner steps like DiLoCo, but the fragments are staggered by ``s = H / P``
steps, so a synchronization moves ``1 / P`` of the model; its exchange runs while the next ``tau`` inner steps do;
and the result is mixed into the local parameters with weight ``alpha``. Reference, for every replica group ``m``
(``n`` counts inner steps from 1; ``theta_g[p]`` is fragment ``p``'s global copy, the same on every group)::

    theta[m] = inner_step(theta[m])                                      # step n, inside the group
    for p in fragments:
        if n % H == ((p + 1) * s) % H:                                   # fragment p's turn: issue
            delta[m] = theta_g[p] - theta[m][p]                          # its pseudo-gradient, taken now
            start  all-reduce of delta over the groups                   # nonblocking; compressed: outer_dtype
        if n == issued_at[p] + tau:                                      # tau inner steps later: complete
            avg = sum(delta[m] for m in contributing) / len(contributing)
            theta_g[p] = outer_opt[p](theta_g[p], grad=avg)              # Nesterov SGD, one per fragment
            theta[m][p] = alpha * theta[m][p] + (1 - alpha) * theta_g[p]  # alpha = 0: theta[m][p] = theta_g[p]

With ``P = 1``, ``tau = 0``, ``alpha = 0`` and fp32 this is :class:`~torchnext.ft.DiLoCo` exactly (tested bitwise).
``0 <= tau < s``: at most one fragment is in flight, and it completes before the next one is issued. Which
parameters form a fragment: the ``blocks`` (modules or single parameters, by default every parameter on its own)
grouped ``sequential``-ly (contiguous runs) or ``strided`` (block ``i`` in fragment ``i % P``, the paper's better
pattern).

Outer-gradient compression (``outer_dtype``, :mod:`torchnext.ft.compression`): fp32 is all-reduced as DiLoCo does;
bf16, mxfp8, mxfp4 and nvfp4 are encoded with :mod:`torchnext.lowp`, all-gathered as codes + scales, and every rank
decodes and sums them in fp32 in rank order -- bitwise the same global copy on every rank.

Fault semantics (as DiLoCo's, per fragment)
-------------------------------------------
* A fragment's synchronization is one fault-tolerant step (``ft.step_count`` counts them), held open across the
  ``tau`` inner steps: it is *entered* at the issue (a pending generation is entered then, joiners healed), the
  collective is started, and the training thread goes on; ``tau`` steps later it waits for the collective (usually
  long done), votes (two-phase commit) and applies the outer step only if every live group committed. Inner steps
  never touch ``ft`` meanwhile; an in-flight collective is never waited for by them.
* A group dying, or hanging, during the overlapped collective makes the step uncommittable (the heartbeat thread
  aborts the generation; the collective's buffers are quarantined). At the completion point nothing is written --
  global copy, outer optimizer, local parameters -- and the fragment's synchronization is redone at once, blocking,
  in the next generation with the live groups, from the **same** pseudo-gradients taken at the issue (the ``tau``
  steps since are kept in the local parameters). A partial average is never applied.
* Healing: :meth:`StreamingDiLoCo.state_dict` holds, for this rank's shards, every fragment's **global copy** and
  **outer optimizer state**, the inner step count (the schedule's position), the commit counts, and whether a
  fragment's synchronization is open (and when it completes). A joiner's local parameters become the global
  copies; if its donor was inside a fragment's synchronization the joiner takes part in it from :meth:`join`
  (sending zeros, not counted): still overlapped if the donor was at its issue, at once if at a redo.
  A joiner contributes from the next fragment synchronization on (its parameters trained since the heal).

Usage::

    ft = FaultTolerant(cfg, join=False, state_dict=lambda: {"sd": sd.state_dict(), "inner": opt.state_dict()},
                       load_state_dict=lambda s: (sd.load_state_dict(s["sd"]), opt.load_state_dict(s["inner"])))
    sd = StreamingDiLoCo(ft, model, StreamingDiLoCoConfig(sync_every=100, num_fragments=4,
                         fragment_sync_delay=5, fragment_update_alpha=0.5, outer_dtype="mxfp4"),
                         blocks=model.layers)           # every parameter of model in exactly one block
    sd.join()
    while sd.inner_steps < total_steps:
        loss_fn(model(next(batches))).backward(); opt.step(); opt.zero_grad()
        sd.step()                                       # issues / completes fragment synchronizations
    sd.drain()                                          # the last one in flight, then ft.finish()
    ft.finish()

Do not run other ``ft.step()`` s while a StreamingDiLoCo trains: one of its synchronizations is open most of the time.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchnext.ft.compression import OuterCodec, OuterDType, outer_codec
from torchnext.ft.diloco import (
    OuterOptimizerFactory,
    _Bucket,
    _buckets,
    _check_outer,
    _check_sync_every,
    _check_unjoined,
    _make_outer,
    _parameters,
)
from torchnext.ft.fault_tolerant import FaultTolerant
from torchnext.ft.state import local
from torchnext.ft.step import Step

__all__ = ["FragmentPattern", "FragmentSync", "StreamingDiLoCo", "StreamingDiLoCoConfig"]

_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # pybind converts the RedOpType
_ALIGN = 16  # bytes: every segment of a gathered payload starts aligned (views as bf16 / fp32 need it)


class FragmentPattern(str, enum.Enum):
    """How the blocks are grouped into fragments."""

    SEQUENTIAL = "sequential"
    """Contiguous runs: blocks ``[0, k)`` in fragment 0, ``[k, 2k)`` in fragment 1, ..."""
    STRIDED = "strided"
    """Block ``i`` in fragment ``i % P`` (every fragment spans the depth of the model)."""


@dataclass(kw_only=True, slots=True)
class StreamingDiLoCoConfig:
    """The schedule, the mixing, the compression and the outer optimizer of :class:`StreamingDiLoCo`."""

    sync_every: int
    """H: inner steps between two outer steps of one fragment (>= 1, a multiple of ``num_fragments``)."""
    num_fragments: int = 1
    """P: fragments, synchronized ``H / P`` inner steps apart (>= 1)."""
    fragment_pattern: FragmentPattern | str = FragmentPattern.STRIDED
    """How blocks are grouped into fragments: ``"strided"`` or ``"sequential"``."""
    fragment_sync_delay: int = 0
    """tau: inner steps the exchange overlaps (0 <= tau < H / P; 0: blocking, as DiLoCo)."""
    fragment_update_alpha: float = 0.0
    """alpha in [0, 1]: weight of the local parameters when the new global copy is mixed in (0: replace)."""
    outer_dtype: OuterDType | str = OuterDType.FP32
    """Wire format of the pseudo-gradients: ``"fp32"``, ``"bf16"``, ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``."""
    outer_lr: float = 0.7
    """Learning rate of each fragment's outer ``torch.optim.SGD`` (> 0)."""
    outer_momentum: float = 0.9
    """Its momentum, in [0, 1)."""
    outer_nesterov: bool = True
    """Nesterov momentum (needs ``outer_momentum > 0``)."""
    outer_optimizer: OuterOptimizerFactory | None = None
    """Instead of SGD: ``factory(fragment_global_params) -> Optimizer``, called once per fragment."""

    def __post_init__(self) -> None:
        name = "StreamingDiLoCoConfig"
        _check_sync_every(name, self.sync_every)
        p = self.num_fragments
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"{name}.num_fragments must be an int >= 1, got {p!r}")
        if self.sync_every % p:
            raise ValueError(f"{name}: sync_every={self.sync_every} must be a multiple of num_fragments={p} "
                             "(fragments are synchronized sync_every / num_fragments inner steps apart)")
        try:
            self.fragment_pattern = FragmentPattern(self.fragment_pattern)
        except ValueError:
            raise ValueError(f"{name}.fragment_pattern must be one of {[x.value for x in FragmentPattern]}, got "
                             f"{self.fragment_pattern!r}") from None
        tau, spacing = self.fragment_sync_delay, self.sync_every // p
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < spacing:
            raise ValueError(f"{name}.fragment_sync_delay must be an int in [0, sync_every / num_fragments = "
                             f"{spacing}) (one fragment in flight at a time), got {tau!r}")
        a = self.fragment_update_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"{name}.fragment_update_alpha must be a number in [0, 1], got {a!r}")
        self.outer_dtype = outer_codec(self.outer_dtype).dtype  # raises on an unknown name
        _check_outer(name, self.outer_lr, self.outer_momentum, self.outer_nesterov, self.outer_optimizer)


@dataclass(frozen=True, slots=True)
class FragmentSync:
    """One committed fragment synchronization (returned by :meth:`StreamingDiLoCo.step`; also ``last_sync``)."""

    fragment: int
    """Which fragment."""
    outer_step: int
    """This fragment's outer step index (0 for its first)."""
    issued_at: int
    """Inner step at which its pseudo-gradients were taken and the exchange started."""
    applied_at: int
    """Inner step at which it was applied (``issued_at + tau``, unless a joiner caught up)."""
    generation: int
    """The generation it committed in."""
    contributors: int
    """Groups whose pseudo-gradient was averaged."""
    attempts: int
    """Fault-tolerant steps it took (1 without a failure)."""
    payload_bytes: int
    """Bytes this rank handed to the collective (fp32: the flat buffers all-reduced; else its gathered payload)."""
    wait_s: float
    """Seconds the training thread waited for the collective at the completion point (0 when it was done)."""


@dataclass(eq=False)
class _Fragment:
    index: int
    members: tuple[int, ...]
    """Indices into the parameter list."""
    globals_: list[torch.Tensor]
    buckets: list[_Bucket]
    outer: torch.optim.Optimizer
    outer_steps: int = 0


@dataclass(eq=False)
class _Open:
    """A fragment synchronization whose fault-tolerant step is open."""

    fragment: int
    issued_at: int
    due: int
    contributing: bool
    sends: list[torch.Tensor]
    """What this rank contributes (kept for a redo: fp32 flats, or one gathered payload)."""
    step: Step | None = None
    works: list[Any] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)
    attempts: int = 0


class StreamingDiLoCo:
    """Streaming DiLoCo over the live replica groups of ``ft`` (see the module docstring).

    Args:
        ft: a :class:`FaultTolerant` built with ``join=False`` and a ``state_dict``/``load_state_dict`` that
            include this object's.
        model: the module (its parameters) or the parameters to synchronize (plain tensors or DTensors sharded
            inside the replica group), floating point.
        config: the schedule, mixing, compression and outer optimizer.
        blocks: the units fragments are made of: modules or single parameters covering every parameter of
            ``model`` exactly once, in model order (e.g. ``[model.embed, *model.layers, model.head]``); default:
            every parameter on its own. At least ``num_fragments`` of them.

    Raises:
        TypeError / ValueError: bad arguments (named), as :class:`~torchnext.ft.DiLoCo`, and blocks that miss or
            repeat a parameter, or fewer blocks than fragments.
    """

    _kind = "streaming_diloco"

    def __init__(self, ft: FaultTolerant, model: nn.Module | Iterable[torch.Tensor], config: StreamingDiLoCoConfig,
                 *, blocks: Sequence[nn.Module | torch.Tensor] | None = None) -> None:
        name = type(self).__name__
        if not isinstance(config, StreamingDiLoCoConfig):
            raise TypeError(f"{name}: config must be a StreamingDiLoCoConfig, got {type(config).__name__}")
        _check_unjoined(name, ft)
        self._ft = ft
        self.config = config
        self._params = _parameters(name, ft, model)
        self._codec: OuterCodec = outer_codec(config.outer_dtype)
        groups = _group_blocks(name, self._params, blocks, config.num_fragments,
                               FragmentPattern(config.fragment_pattern))
        self._spacing = config.sync_every // config.num_fragments
        self._fragments: list[_Fragment] = []
        for p, members in enumerate(groups):
            globals_ = [local(self._params[i].detach()).detach().clone() for i in members]
            opt = _make_outer(name + "Config", config.outer_optimizer, config.outer_lr, config.outer_momentum,
                              config.outer_nesterov, globals_)
            self._fragments.append(_Fragment(index=p, members=tuple(members), globals_=globals_,
                                             buckets=_buckets(globals_), outer=opt))
        self._n = 0
        self._open: _Open | None = None
        self._mid: tuple[int, int] | None = None  # (fragment, due) while its ft.step is open: healed into joiners
        self._catch_up: tuple[int, int] | None = None
        self._loaded = False
        self.last_sync: FragmentSync | None = None
        """The last committed fragment synchronization on this member."""

    # ------------------------------------------------------------------------------------------------ public
    @property
    def inner_steps(self) -> int:
        """Inner steps taken (``step()`` calls; healed into a joiner: the schedule's position, the same on every
        live group)."""
        return self._n

    @property
    def outer_steps(self) -> tuple[int, ...]:
        """Committed outer steps of each fragment."""
        return tuple(f.outer_steps for f in self._fragments)

    @property
    def fragments(self) -> tuple[tuple[int, ...], ...]:
        """Each fragment's parameters, as indices into ``model``'s parameter list."""
        return tuple(f.members for f in self._fragments)

    @property
    def global_params(self) -> tuple[torch.Tensor, ...]:
        """The global copy, one tensor per parameter (this rank's local shard), in parameter order."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        for f in self._fragments:
            for i, g in zip(f.members, f.globals_, strict=True):
                out[i] = g
        return tuple(out)

    @property
    def outer_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """Each fragment's outer optimizer (over its part of :attr:`global_params`)."""
        return tuple(f.outer for f in self._fragments)

    @property
    def in_flight(self) -> int | None:
        """The fragment whose synchronization is under way (issued, not yet applied), or None."""
        return None if self._open is None else self._open.fragment

    def schedule(self, n: int) -> int | None:
        """The fragment issued at inner step ``n`` (None if none): ``p`` with ``n % H == ((p + 1) * H / P) % H``."""
        if n < 1 or n % self._spacing:
            return None
        return (n // self._spacing - 1) % len(self._fragments)

    def join(self) -> None:
        """``ft.join()``; then, if this member was healed from a donor inside a fragment's synchronization, take
        part in it (sending zeros, not counted). Idempotent; call it before the first inner step.

        Raises:
            RuntimeError: this member was healed but the healed state did not include :meth:`state_dict`.
        """
        ft = self._ft
        ft.join()
        name = type(self).__name__
        if not self._loaded and ft.heals_received:
            raise RuntimeError(f"{name}: member {ft.member_id} was healed, but its load_state_dict did not call "
                               f"{name}.load_state_dict(): put its state_dict() into FaultTolerant's state")
        if self._catch_up is not None:
            p, due = self._catch_up
            self._catch_up = None
            self._begin(p, issued_at=self._n, due=max(due, self._n), contributing=False)

    def step(self) -> FragmentSync | None:
        """Count one inner step (call it after the inner optimizer's step): complete the fragment synchronization
        due now, then issue the one scheduled now (see the module docstring). Returns the synchronization that
        committed in this call, or None. Never waits for an exchange that is not due.

        Raises:
            MembershipError: membership ended (``RemovedFromGroup``, ``QuorumLost``, ...), from ``ft``.
        """
        self._check_joined("step")
        self._n += 1
        done = None
        if self._open is not None and self._n >= self._open.due:
            done = self._complete()
        p = self.schedule(self._n)
        if p is not None:
            done = self._begin(p, issued_at=self._n, due=self._n + self.config.fragment_sync_delay,
                               contributing=True) or done
        return done

    def drain(self) -> FragmentSync | None:
        """Complete the synchronization in flight now (waiting for it), e.g. after the last inner step and before
        ``ft.finish()``. Returns it, or None when none was in flight."""
        if self._open is None:
            return None
        return self._complete()

    def state_dict(self) -> dict[str, Any]:
        """What a joiner heals (module docstring): every fragment's global copy (the tensors themselves) and outer
        optimizer state, the inner step count, the commit counts, the open synchronization (or None)."""
        return {"kind": self._kind, "fragments": len(self._fragments),
                "global": [list(f.globals_) for f in self._fragments],
                "outer": [f.outer.state_dict() for f in self._fragments],
                "outer_steps": [f.outer_steps for f in self._fragments], "inner_steps": self._n,
                "mid_sync": None if self._mid is None else list(self._mid)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` from a peer: global copies, outer optimizer states, the schedule's position;
        the local parameters become the global copy; an open synchronization is taken part in by :meth:`join`.

        Raises:
            ValueError: not this class's state, another fragment layout, or tensors of other shapes or dtypes.
        """
        name = type(self).__name__
        if not isinstance(state, dict) or state.get("kind") != self._kind:
            raise ValueError(f"{name}.load_state_dict: not a {name} state (kind "
                             f"{state.get('kind') if isinstance(state, dict) else type(state).__name__!r})")
        src = state["global"]
        if state.get("fragments") != len(self._fragments) or len(src) != len(self._fragments):
            raise ValueError(f"{name}.load_state_dict: {state.get('fragments')} fragments for {len(self._fragments)}")
        for f, ts in zip(self._fragments, src, strict=True):
            if len(ts) != len(f.globals_):
                raise ValueError(f"{name}.load_state_dict: fragment {f.index} has {len(ts)} tensors, "
                                 f"{len(f.globals_)} expected")
            for i, dst, t in zip(f.members, f.globals_, ts, strict=True):
                if t.shape != dst.shape or t.dtype != dst.dtype:
                    raise ValueError(f"{name}.load_state_dict: global tensor of parameter {i} is {tuple(t.shape)} "
                                     f"{t.dtype}, its local shard is {tuple(dst.shape)} {dst.dtype}")
        with torch.no_grad():
            for f, ts, outer, k in zip(self._fragments, src, state["outer"], state["outer_steps"], strict=True):
                for dst, t in zip(f.globals_, ts, strict=True):
                    if dst.data_ptr() != t.data_ptr():
                        dst.copy_(t)
                f.outer.load_state_dict(outer)
                f.outer_steps = int(k)
                for i, g in zip(f.members, f.globals_, strict=True):
                    local(self._params[i].detach()).copy_(g)
        self._n = int(state["inner_steps"])
        mid = state["mid_sync"]
        self._catch_up = None if mid is None else (int(mid[0]), int(mid[1]))
        self._open = None
        self._mid = None
        self._loaded = True

    # ---------------------------------------------------------------------------------------------- internals
    def _check_joined(self, op: str) -> None:
        name = type(self).__name__
        ft = self._ft
        if not ft.members:
            raise RuntimeError(f"{name}.{op}() before join(): join first (before the first inner step), so that a "
                               "joining group is healed and takes part in a synchronization under way")
        if ft._in_step and self._open is None:
            raise RuntimeError(f"{name}.{op}() inside `with ft.step()`: its synchronizations are fault-tolerant "
                               "steps of their own; call it outside any other step")
        if self._catch_up is not None:
            raise RuntimeError(f"{name}.{op}(): member {ft.member_id} was healed in the middle of a synchronization "
                               "and has not taken part in it: call join() (not only ft.join()) first")

    def _begin(self, p: int, *, issued_at: int, due: int, contributing: bool) -> FragmentSync | None:
        """Take fragment ``p``'s pseudo-gradients, enter its fault-tolerant step, start the exchange; complete it
        at once when it is due now (tau = 0, or a joiner catching up on a redo)."""
        sends = self._payload(self._fragments[p], contributing)
        self._open = _Open(fragment=p, issued_at=issued_at, due=due, contributing=contributing, sends=sends)
        self._mid = (p, due)  # a donor healing a joiner in this step's entry: the joiner takes part in it
        self._launch()
        if due <= self._n:
            return self._complete()
        return None

    def _launch(self) -> None:
        """One attempt: enter a fault-tolerant step (a pending generation first) and start the collective(s)."""
        op = self._open
        assert op is not None
        while True:
            op.attempts += 1
            st = self._ft.step()
            st.__enter__()
            try:
                pg = self._ft.process_group
                if self._codec.gathered:
                    (send,) = op.sends
                    out = torch.empty(pg.size() * send.numel(), dtype=torch.uint8, device=send.device)
                    op.works, op.outs = [pg._allgather_base(out, send)], [out]
                else:
                    flats = [s.clone() for s in op.sends]  # the caller's tensor is marked invalid on a failure
                    op.works, op.outs = [pg.allreduce([f], _SUM) for f in flats], flats
            except BaseException as exc:
                if st.__exit__(type(exc), exc, exc.__traceback__):
                    continue  # a transient failure: entered the next generation; attempt again
                self._open = None
                self._mid = None
                raise
            op.step = st
            return

    def _complete(self) -> FragmentSync:
        """Wait for the open synchronization, vote, apply it if committed; else redo it (blocking) in the next
        generation until it commits."""
        op = self._open
        assert op is not None
        t0 = time.monotonic()
        while True:
            st = op.step
            assert st is not None
            record: FragmentSync | None = None
            try:
                for w in op.works:
                    w.wait()  # a failure is recorded, not raised: the step then cannot commit
                waited = time.monotonic() - t0
                if st.commit():
                    record = self._apply(op, waited)
                    self._mid = None  # before the step's end: a joiner healed there starts from here
            except BaseException as exc:
                if not st.__exit__(type(exc), exc, exc.__traceback__):
                    self._open = None
                    self._mid = None
                    raise
            else:
                st.__exit__(None, None, None)
            if record is not None:
                self._open = None
                self.last_sync = record
                return record
            self._launch()  # in the generation the failed attempt's end entered

    def _payload(self, f: _Fragment, contributing: bool) -> list[torch.Tensor]:
        """This rank's contribution: fp32 codec -- one flat per dtype bucket, pseudo-gradients ``global - local``
        and a last element counting contributors (DiLoCo's layout); gathered codecs -- one uint8 payload, each
        bucket's encoding in an aligned segment, then a segment whose first byte is the contributor flag."""
        with torch.no_grad():
            deltas = []
            for b in f.buckets:
                flat = torch.zeros(b.numel + 1, dtype=b.dtype, device=f.globals_[b.members[0]].device)
                if contributing:
                    for j, off in zip(b.members, b.offsets, strict=True):
                        g = f.globals_[j]
                        torch.sub(g.reshape(-1), local(self._params[f.members[j]].detach()).reshape(-1),
                                  out=flat[off:off + g.numel()])
                    flat[-1] = 1
                deltas.append(flat)
            if not self._codec.gathered:
                return deltas
            segs = [_padded(self._codec.encode(flat[:-1].to(torch.float32))) for flat in deltas]
            flag = torch.zeros(_ALIGN, dtype=torch.uint8, device=deltas[0].device)
            flag[0] = int(contributing)
            return [torch.cat([*segs, flag])]

    def _apply(self, op: _Open, waited: float) -> FragmentSync:
        """After the commit: average, outer step on the fragment's global copy, mix into the local parameters."""
        f = self._fragments[op.fragment]
        grads: list[torch.Tensor] = [torch.empty(0)] * len(f.globals_)
        with torch.no_grad():
            if self._codec.gathered:
                count, sums = self._gathered_sums(f, op.outs[0], op.sends[0].numel())
                for b, acc in zip(f.buckets, sums, strict=True):
                    if count:
                        acc.div_(count)
                    for j, off in zip(b.members, b.offsets, strict=True):
                        g = f.globals_[j]
                        grads[j] = acc[off:off + g.numel()].to(g.dtype).view(g.shape)
            else:
                counts = {float(flat[-1].item()) for flat in op.outs}
                if len(counts) != 1 or not all(math.isfinite(c) and c >= 0 and c == int(c) for c in counts):
                    raise RuntimeError(f"StreamingDiLoCo: a committed synchronization of fragment {f.index} has "
                                       f"contributor counts {counts} (expected one non-negative integer; a bug)")
                count = int(counts.pop())
                for b, flat in zip(f.buckets, op.outs, strict=True):
                    if count:
                        flat.div_(count)
                    for j, off in zip(b.members, b.offsets, strict=True):
                        g = f.globals_[j]
                        grads[j] = flat[off:off + g.numel()].view(g.shape)
            if count:
                for g, d in zip(f.globals_, grads, strict=True):
                    g.grad = d
                try:
                    f.outer.step()
                finally:
                    for g in f.globals_:
                        g.grad = None
            alpha = float(self.config.fragment_update_alpha)
            for i, g in zip(f.members, f.globals_, strict=True):
                p = local(self._params[i].detach())
                if alpha == 0:
                    p.copy_(g)
                else:
                    p.lerp_(g, 1 - alpha)
        record = FragmentSync(fragment=f.index, outer_step=f.outer_steps, issued_at=op.issued_at, applied_at=self._n,
                              generation=self._ft.generation, contributors=count, attempts=op.attempts,
                              payload_bytes=sum(s.numel() * s.element_size() for s in op.sends), wait_s=waited)
        f.outer_steps += 1
        return record

    def _gathered_sums(self, f: _Fragment, out: torch.Tensor, row: int) -> tuple[int, list[torch.Tensor]]:
        """Decode every contributing rank's payload and add them in fp32, in rank order (bitwise the same on
        every rank). Returns (contributors, one fp32 sum per bucket)."""
        rows = out.view(-1, row)
        flags = rows[:, row - _ALIGN]
        if not bool(((flags == 0) | (flags == 1)).all()):
            raise RuntimeError(f"StreamingDiLoCo: a committed synchronization of fragment {f.index} has contributor "
                               f"flags {flags.tolist()} (expected 0 or 1 per rank; a bug)")
        sums = [torch.zeros(b.numel, dtype=torch.float32, device=out.device) for b in f.buckets]
        count = 0
        for r in range(rows.shape[0]):
            if not int(flags[r]):
                continue
            count += 1
            start = 0
            for b, acc in zip(f.buckets, sums, strict=True):
                n = self._codec.wire_bytes(b.numel)
                acc.add_(self._codec.decode(rows[r, start:start + n], b.numel))
                start += _round_up(n)
        return count, sums


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _padded(t: torch.Tensor) -> torch.Tensor:
    pad = _round_up(t.numel()) - t.numel()
    return torch.cat([t, t.new_zeros(pad)]) if pad else t


def _group_blocks(name: str, params: list[torch.Tensor], blocks: Sequence[nn.Module | torch.Tensor] | None,
                  num_fragments: int, pattern: FragmentPattern) -> list[list[int]]:
    """Parameter indices of each fragment: the blocks (default: one per parameter) grouped by ``pattern``."""
    index = {id(p): i for i, p in enumerate(params)}
    units: list[list[int]]
    if blocks is None:
        units = [[i] for i in range(len(params))]
    else:
        if isinstance(blocks, (nn.Module, torch.Tensor)) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"{name}: blocks must be a sequence of modules or parameters, got one "
                            f"{type(blocks).__name__}")
        units, seen = [], set()
        for k, blk in enumerate(blocks):
            if not isinstance(blk, (nn.Module, torch.Tensor)):
                raise TypeError(f"{name}: block {k} is a {type(blk).__name__}, not a module or a parameter")
            ps = list(blk.parameters()) if isinstance(blk, nn.Module) else [blk]
            ids = []
            for t in ps:
                i = index.get(id(t))
                if i is None:
                    raise ValueError(f"{name}: block {k} ({type(blk).__name__}) holds a parameter {tuple(t.shape)} "
                                     "that is not among model's parameters")
                if i in seen:
                    raise ValueError(f"{name}: parameter {i} ({tuple(params[i].shape)}) is in two blocks")
                seen.add(i)
                ids.append(i)
            if not ids:
                raise ValueError(f"{name}: block {k} ({type(blk).__name__}) has no parameters")
            units.append(ids)
        missing = [i for i in range(len(params)) if i not in seen]
        if missing:
            raise ValueError(f"{name}: parameters {missing[:8]} of model are in no block; list every parameter's "
                             "module (e.g. blocks=[model.embed, *model.layers, model.head])")
    if len(units) < num_fragments:
        raise ValueError(f"{name}: {len(units)} blocks cannot make num_fragments={num_fragments} fragments")
    if pattern is FragmentPattern.STRIDED:
        chunks = [units[p::num_fragments] for p in range(num_fragments)]
    else:
        base, extra = divmod(len(units), num_fragments)
        chunks, start = [], 0
        for p in range(num_fragments):
            size = base + (1 if p < extra else 0)
            chunks.append(units[start:start + size])
            start += size
    return [sorted(i for u in chunk for i in u) for chunk in chunks]

