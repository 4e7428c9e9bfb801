"""``TorchnextProcessGroup``: a ``torch.distributed.ProcessGroup`` whose every op runs on torchnext Communicators.

Everything torch reaches through a process group -- ``dist.*`` with ``group=``, ``DistributedDataParallel``, FSDP2
over a ``DeviceMesh``, DTensor, functional collectives (eager and compiled) -- then gets what hangs on a
Communicator: pre/post/abort hooks, the Flight Recorder, per-op timeouts, peer-failure detection and an ``abort()``
that unblocks every op in flight. One Communicator per device type (``cpu``: Gloo; ``cuda``: NCCL where available);
a tensor on a device the group has no Communicator for raises ``ValueError`` naming the device and the group.

Op mapping (torch's method -> the Communicator op; every one is issued ``async_op=True`` and returned as a
:class:`~torchnext.comms.process_group.work.GroupWork`)::

    allreduce([t])                -> all_reduce(t, op)          allreduce_coalesced(ts)   -> all_reduce per tensor
    broadcast([t])                -> broadcast(t, root)         reduce([t])               -> reduce(t, root, op)
    allgather([outs], [t])        -> all_gather(outs, t)        _allgather_base(o, t)     -> all_gather_single(o, t)
    allgather_coalesced, allgather_into_tensor_coalesced        -> one all_gather[_single] per tensor
    reduce_scatter([o], [ins])    -> reduce_scatter(o, ins)     _reduce_scatter_base(o,i) -> reduce_scatter_single(o, i)
    reduce_scatter_tensor_coalesced                              -> one reduce_scatter_single per tensor
    alltoall(outs, ins)           -> all_to_all(outs, ins)      alltoall_base(o, i, os, is) -> all_to_all_single
    gather, scatter, barrier, send, recv, recv_anysource        -> the ops of the same name

``PREMUL_SUM`` (``dist._make_nccl_premul_sum(factor)``, ``ReduceOp.PREMUL_SUM(factor)``: what FSDP2 reduces
gradients with once a gradient divide factor is set) runs as NCCL defines it: every rank's contribution is
pre-multiplied by ``factor`` (a Python number, or a one-element tensor) and the products summed::

    out = sum(x_r * factor for r in ranks)   # x_r * factor: torch's mul in x's dtype, on each rank, then SUM

on every reduction (allreduce[_coalesced], reduce, reduce_scatter[_tensor[_coalesced]]); an in-place op scales
its own tensor (its contents are replaced by the result anyway), a reduce-scatter scales a copy of its input.
Floating and complex dtypes only (``TypeError`` otherwise, as the product of an integer and a factor is no integer).

With ``TORCHNEXT_NATIVE_PG=1`` the CPU ops run on the native data path whenever nothing asks for Python per op
(:mod:`torchnext.comms.process_group.native`): same results, errors and Flight Recorder entries, torch's per-op cost.

Failures (see :mod:`torchnext.comms.process_group.work`): a failed op raises from ``wait()``; its future never
raises; and once the communicator is errored or aborted, every later call into the group raises the original
failure's class (``PeerFailure``, ``CommTimeout``, ``CommAborted``) naming the op it refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchnext.comms.communicator import Communicator
from torchnext.comms.errors import CommError, PeerFailure
from torchnext.comms.process_group import native as _native
from torchnext.comms.process_group.profiling import annotate
from torchnext.comms.process_group.work import GroupWork
from torchnext.comms.reduce_op import ReduceOp
from torchnext.comms.work import Work

__all__ = ["BACKEND_NAME", "TorchnextProcessGroup"]

BACKEND_NAME = "torchnext"
"""The name torch knows the backend by: ``dist.init_process_group(backend="torchnext")``."""

_LOG = logging.getLogger("torchnext.comms")
_UNSET_MS = -1  # c10d's "no timeout given" in an options object
_UNSET_TD = timedelta(milliseconds=_UNSET_MS)  # the same, compared without two total_seconds() calls (hot path)


def _timeout(opts: Any) -> timedelta | None:
    td = getattr(opts, "timeout", None)
    if td is None or td == _UNSET_TD or td.total_seconds() * 1000 <= _UNSET_MS or td.total_seconds() == 0:
        return None
    return td


def _only(tensors: Sequence[Any], op: str, what: str = "tensors") -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{op}: torchnext process groups take one tensor per call (one device per process), "
                         f"got {len(tensors)} {what}")
    return tensors[0]


def _again(err: BaseException, op: str, comm: Communicator) -> CommError:
    """A fresh exception of ``err``'s class for a later call ``op`` (``err`` as its cause)."""
    cls = type(err) if isinstance(err, CommError) else CommError
    detail = err.detail if isinstance(err, CommError) else str(err)
    ctx = {"op": op, "comm_name": comm.name, "rank": comm.rank, "ranks": comm.ranks}
    text = f"refused: an earlier op of this group failed ({detail})"
    exc: CommError
    try:
        exc = cls(text, **ctx)  # type: ignore[arg-type]
    except TypeError:  # a subclass with another signature
        exc = CommError(text, **ctx)  # type: ignore[arg-type]
    if isinstance(err, PeerFailure) and isinstance(exc, PeerFailure):
        exc.peer = err.peer
    exc.__cause__ = err
    return exc


class TorchnextProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed.ProcessGroup`` over torchnext Communicators (one per device type).

    Build it with ``dist.init_process_group(backend="torchnext")`` / ``dist.new_group(...)`` (see
    :mod:`torchnext.comms.process_group.backend`) or ``comm.as_process_group()``; it stays the same object for the
    communicators' whole life, so DDP, FSDP2 and DeviceMesh may hold on to it. ``rank()``/``size()`` (and C++'s
    ``getRank``/``getSize``) are the Communicator's. ``communicator(device_type)`` gives the Communicator behind a
    device; ``abort()`` aborts them all (every op in flight raises ``CommAborted`` at once); ``shutdown()`` (what
    ``dist.destroy_process_group`` calls) shuts them down.
    """

    _native: _native._Native | None = None
    """The native data path (``TORCHNEXT_NATIVE_PG=1``), else None."""

    def __init__(self, comms: Mapping[str, Communicator], *, description: str = "") -> None:
        if not comms:
            raise ValueError("TorchnextProcessGroup needs at least one Communicator")
        main = comms["cpu"] if "cpu" in comms else next(iter(comms.values()))
        for device, comm in comms.items():
            if not isinstance(comm, Communicator):
                raise TypeError(f"communicator for {device!r} must be a torchnext Communicator, got {comm!r}")
            if (comm.rank, comm.size) != (main.rank, main.size):
                raise ValueError(f"the {device} communicator is rank {comm.rank} of {comm.size}; the group's "
                                 f"main one rank {main.rank} of {main.size}")
        super().__init__(main.rank, main.size)  # type: ignore[call-arg]
        self._comms: dict[str, Communicator] = dict(comms)
        self._main = main
        self._cpu: Communicator | None = self._comms.get("cpu")  # the hot path's one lookup (see _comm_for)
        self._group_name = ""
        self._group_desc = description or main.name
        self._lock = threading.Lock()
        self._warned = False
        self._issuing = threading.Lock()
        """Serializes the issue of ops from several threads (torch's own groups accept that; a Communicator raises):
        held only while an op is handed to the Communicator, never while it runs."""
        if type(self) is TorchnextProcessGroup:  # the fault-tolerant subclass attaches per generation
            self._native = _native.attach(self)

    # ------------------------------------------------------------------------------------------- identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getRank(self) -> int:
        return self._main.rank

    def getSize(self) -> int:
        return self._main.size

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        devices = ", ".join(f"{d}: {c.backend}" for d, c in self._comms.items())
        return f"TorchnextProcessGroup(name={self._group_name!r}, rank={self.getRank()}, size={self.getSize()}, {devices})"

    def communicator(self, device_type: str = "cpu") -> Communicator:
        """The Communicator serving tensors of ``device_type``."""
        comm = self._comms.get(device_type)
        if comm is None:
            raise ValueError(f"torchnext group {self._group_name!r} has no backend for {device_type} tensors "
                             f"(it has {sorted(self._comms)})")
        return comm

    @property
    def native(self) -> bool:
        """Whether the group's ops run on the native data path now (see :mod:`torchnext.comms.process_group.native`)."""
        return self._native is not None and self._native.on_native

    @property
    def communicators(self) -> dict[str, Communicator]:
        """device type -> Communicator."""
        return dict(self._comms)

    def errored(self) -> BaseException | None:
        """The first failure of any of the group's communicators (or its abort), else None."""
        if self._native is not None:
            self._native.sync_failure()
        return next((e for e in (c.errored() for c in self._comms.values()) if e is not None), None)

    # ------------------------------------------------------------------------------------------- lifecycle
    def abort(self, reason: str | None = None, *, cause: BaseException | None = None) -> None:
        """Abort every communicator of the group: ops in flight raise ``CommAborted`` at once (also from C++:
        torch's ``_abort_process_group``, with no arguments). ``reason`` and ``cause``: as in
        :meth:`Communicator.abort <torchnext.comms.Communicator.abort>`."""
        for comm in self._comms.values():
            comm.abort(f"process group aborted{f': {reason}' if reason else ''}", cause=cause)

    def shutdown(self) -> None:
        """Shut the communicators down (``dist.destroy_process_group`` calls it)."""
        for comm in self._comms.values():
            comm.shutdown()

    def set_timeout(self, timeout: timedelta) -> None:
        """The default timeout of the group's later ops (every Communicator's :meth:`~torchnext.comms.Communicator
        .set_timeout`); what ``ProcessGroup.set_timeout``, ``dist.set_timeout`` (torch >= 2.14) and, once torchnext
        is imported, ``torch.distributed.distributed_c10d._set_pg_timeout`` do to a torchnext group."""
        for comm in self.communicators.values():
            comm.set_timeout(timeout)
        if self._native is not None:
            self._native.set_timeout(timeout)

    def _set_default_timeout(self, timeout: timedelta) -> None:
        self.set_timeout(timeout)

    def _get_sequence_number_for_group(self) -> int:
        if self._native is not None:
            self._native.to_python_counters()
        return int(self._main._op_counter)

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to agree on: torchnext numbers ops per communicator, from the first op on."""

    # ------------------------------------------------------------------------------------------ internals
    def _comm_for(self, t: Any, op: str) -> Communicator:
        """The Communicator for ``t``'s device (``t=None``: the group's main one), refusing once it is errored."""
        if isinstance(t, torch.Tensor) and t.is_cpu:  # the hot path: a CPU tensor, a healthy CPU communicator
            cpu = self._cpu
            if cpu is not None and cpu.errored() is None:
                return cpu
        if t is None:
            comm: Communicator | None = self._main
        elif not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        else:
            comm = self._comms.get(t.device.type)
        if comm is None:
            raise ValueError(f"{op}: a tensor on {t.device}, but torchnext group {self._group_name!r} has backends "
                             f"only for {sorted(self._comms)} tensors")
        err = comm.errored()
        if err is not None:
            raise _again(err, op, comm)
        return comm

    def _note_swallowed(self, work: Work) -> None:
        """A failed op completed a future that must not raise: say it once; the next call raises."""
        if not self._warned:
            self._warned = True
            _LOG.warning("torchnext group %r: %s failed while torch waited on its future (%s); its outputs were "
                         "marked invalid (NaN) and the next call into the group raises", self._group_name, work.op,
                         work.exception())

    def _run(self, op: str, device_tensor: Any, issue: Callable[[Communicator], Any], result: list[Any]) -> GroupWork:
        """Issue ``issue(comm)`` on the Communicator for ``device_tensor``'s device and wrap what it returns (the
        one place a subclass changes what a failure means: :class:`torchnext.ft.FaultTolerantProcessGroup`)."""
        comm = self._comm_for(device_tensor, op)
        with self._issuing, annotate(op):
            return GroupWork(self, issue(comm), result)

    def _run_inplace(self, op: str, tensors: list[torch.Tensor],
                     issue: Callable[[Communicator, list[torch.Tensor]], Any]) -> GroupWork:
        """An op that writes its result into its own ``tensors`` (all_reduce, reduce, broadcast):
        ``issue(comm, tensors)``. Here on the caller's tensors; :class:`torchnext.ft.FaultTolerantProcessGroup`
        issues it on private staging copies instead."""
        comm = self._comm_for(tensors[0], op)
        with self._issuing, annotate(op):
            return GroupWork(self, issue(comm, tensors), tensors)

    # ------------------------------------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:  # type: ignore[override]
        if len(tensors) != 1:
            _only(tensors, "allreduce")
        (op, factor), td = _reduce_op(opts), _timeout(opts)
        if factor is not None:
            return self._run_inplace("all_reduce", tensors, lambda c, s: c.all_reduce(
                _premul_(s[0], factor, "allreduce"), op, async_op=True, timeout=td))
        return self._run_inplace("all_reduce", tensors, lambda c, s: c.all_reduce(s[0], op, async_op=True, timeout=td))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:
        if not tensors:
            raise ValueError("allreduce_coalesced: no tensors")
        (op, factor), td = _reduce_op(opts), _timeout(opts)
        return self._run_inplace("all_reduce", tensors, lambda c, s: [
            c.all_reduce(_premul_(t, factor, "allreduce_coalesced"), op, async_op=True, timeout=td) for t in s])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> GroupWork:  # type: ignore[override]
        _only(tensors, "reduce")
        root, (op, factor), td = int(opts.rootRank), _reduce_op(opts), _timeout(opts)
        return self._run_inplace("reduce", tensors, lambda c, s: c.reduce(
            _premul_(s[0], factor, "reduce"), root, op, async_op=True, timeout=td))

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> GroupWork:
        out = _only(output_tensors, "reduce_scatter", "outputs")
        ins = _only(input_tensors, "reduce_scatter", "input lists")
        (op, factor), td = _reduce_op(opts), _timeout(opts)
        if factor is not None:
            ins = [_premul(t, factor, "reduce_scatter") for t in ins]
        return self._run("reduce_scatter", out, lambda c: c.reduce_scatter(out, ins, op, async_op=True, timeout=td),
                         output_tensors)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> GroupWork:
        (op, factor), td = _reduce_op(opts), _timeout(opts)
        if factor is not None:
            input = _premul(input, factor, "reduce_scatter_single")
        return self._run("reduce_scatter_single", output,
                         lambda c: c.reduce_scatter_single(output, input, op, async_op=True, timeout=td), [output])

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> GroupWork:
        if len(outputs) != len(inputs) or not outputs:
            raise ValueError(f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
        (op, factor), td = _reduce_op(opts), _timeout(opts)
        if factor is not None:
            inputs = [_premul(t, factor, "reduce_scatter_tensor_coalesced") for t in inputs]
        return self._run("reduce_scatter_single", outputs[0], lambda c: [
            c.reduce_scatter_single(o, i, op, async_op=True, timeout=td) for o, i in zip(outputs, inputs, strict=True)
        ], outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    # --------------------------------------------------------------------------------------- data movement
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:  # type: ignore[override]
        _only(tensors, "broadcast")
        root, td = (0 if opts is None else int(opts.rootRank)), _timeout(opts)
        return self._run_inplace("broadcast", tensors, lambda c, s: c.broadcast(s[0], root, async_op=True, timeout=td))

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:
        t = _only(input_tensors, "allgather", "inputs")
        outs = _only(output_tensors, "allgather", "output lists")
        td = _timeout(opts)
        return self._run("all_gather", t, lambda c: c.all_gather(outs, t, async_op=True, timeout=td), output_tensors)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> GroupWork:
        td = _timeout(opts)
        return self._run("all_gather_single", input,
                         lambda c: c.all_gather_single(output, input, async_op=True, timeout=td), [output])

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> GroupWork:
        """``output_lists[r][i] = rank r's input_list[i]`` (torch's layout: one list per rank)."""
        if not input_list:
            raise ValueError("allgather_coalesced: no input tensors")
        if any(len(outs) != len(input_list) for outs in output_lists):
            raise ValueError(f"allgather_coalesced: every output list (one per rank) needs {len(input_list)} tensors")
        td = _timeout(opts)

        def issue(c: Communicator) -> Any:
            if len(output_lists) != c.size:
                raise ValueError(f"allgather_coalesced: expected {c.size} output lists (one per rank), "
                                 f"got {len(output_lists)}")
            return [c.all_gather([outs[i] for outs in output_lists], t, async_op=True, timeout=td)
                    for i, t in enumerate(input_list)]

        return self._run("all_gather", input_list[0], issue, output_lists)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> GroupWork:
        if len(outputs) != len(inputs) or not inputs:
            raise ValueError(f"allgather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
        td = _timeout(opts)
        return self._run("all_gather_single", inputs[0], lambda c: [
            c.all_gather_single(o, i, async_op=True, timeout=td) for o, i in zip(outputs, inputs, strict=True)
        ], outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> GroupWork:
        if not input_tensors:
            raise ValueError("alltoall: no input tensors")
        td = _timeout(opts)
        return self._run("all_to_all", input_tensors[0],
                         lambda c: c.all_to_all(output_tensors, input_tensors, async_op=True, timeout=td), output_tensors)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> GroupWork:
        out_splits, in_splits, td = list(output_split_sizes) or None, list(input_split_sizes) or None, _timeout(opts)
        return self._run("all_to_all_single", input, lambda c: c.all_to_all_single(
            output, input, out_splits, in_splits, async_op=True, timeout=td), [output])

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any) -> GroupWork:
        t = _only(input_tensors, "gather", "inputs")
        root, td = int(opts.rootRank), _timeout(opts)

        def issue(c: Communicator) -> Any:
            outs = _only(output_tensors, "gather", "output lists") if c.rank == root else None
            return c.gather(t, outs, root, async_op=True, timeout=td)

        return self._run("gather", t, issue, output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any) -> GroupWork:
        t = _only(output_tensors, "scatter", "outputs")
        root, td = int(opts.rootRank), _timeout(opts)

        def issue(c: Communicator) -> Any:
            ins = _only(input_tensors, "scatter", "input lists") if c.rank == root else None
            return c.scatter(t, ins, root, async_op=True, timeout=td)

        return self._run("scatter", t, issue, output_tensors)

    def barrier(self, opts: Any = None) -> GroupWork:
        td = _timeout(opts)
        return self._run("barrier", None, lambda c: c.barrier(async_op=True, timeout=td), [])

    # ------------------------------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> GroupWork:
        t = _only(tensors, "send")
        return self._run("send", t, lambda c: c.send(t, dst, tag, async_op=True), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> GroupWork:
        t = _only(tensors, "recv")
        return self._run("recv", t, lambda c: c.recv(t, src, tag, async_op=True), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> GroupWork:
        t = _only(tensors, "recv")
        return self._run("recv", t, lambda c: c.recv(t, None, tag, async_op=True), tensors)

    recvAnysource = recv_anysource


Factor = float | torch.Tensor
_SUM_ONLY: tuple[ReduceOp, None] = (ReduceOp.SUM, None)


def _reduce_op(opts: Any) -> tuple[ReduceOp, Factor | None]:
    """The op of ``opts`` and, for ``PREMUL_SUM``, its factor (the op is then SUM of the pre-multiplied tensors)."""
    if opts is None:
        return _SUM_ONLY
    op = opts.reduceOp
    if op == _C10D_SUM:  # the hot path: 0.5 us, a fifth of the general lookup (pybind enum hashing is slow)
        return _SUM_ONLY
    if getattr(op, "op", None) == _C10D_PREMUL_SUM:
        return ReduceOp.SUM, _premul_factor(op.factor)
    return ReduceOp.from_c10d(op), None


def _premul_factor(factor: object) -> Factor:
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not (factor.is_floating_point() or factor.is_complex()):
            raise ValueError(f"PREMUL_SUM: the factor tensor must hold one floating-point element, got shape "
                             f"{tuple(factor.shape)} {factor.dtype}")
        return factor.reshape(())
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"PREMUL_SUM: the factor must be a number or a one-element tensor, got {factor!r}")
    return float(factor)


def _check_premul(t: torch.Tensor, where: str) -> None:
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{where}: PREMUL_SUM needs a floating dtype, got {t.dtype}")


def _premul_(t: torch.Tensor, factor: Factor | None, where: str) -> torch.Tensor:
    """``t *= factor`` in place (None: unchanged); ``t`` is the op's own in/out tensor."""
    if factor is None:
        return t
    _check_premul(t, where)
    return t.mul_(factor.to(t.device) if isinstance(factor, torch.Tensor) else factor)


def _premul(t: torch.Tensor, factor: Factor, where: str) -> torch.Tensor:
    """``t * factor`` in a new tensor of ``t``'s dtype (a reduce-scatter's input stays the caller's)."""
    _check_premul(t, where)
    return torch.mul(t, factor.to(t.device) if isinstance(factor, torch.Tensor) else factor).to(t.dtype)


_C10D_SUM = dist.ReduceOp.SUM
_C10D_PREMUL_SUM = dist.ReduceOp.PREMUL_SUM
