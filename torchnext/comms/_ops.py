"""The ops of :class:`~torchnext.comms.Communicator` (a mixin, to keep ``communicator.py`` about lifecycle).

Each op validates its arguments, then hands ``launch(timeout) -> [backend Work]`` to ``Communicator._issue``, which
numbers the op, runs hooks, tracks it in flight and waits (sync) or returns the :class:`Work` (async).
Meaning of every op = torch.distributed's; the one-line Python references below use ``xs[r]`` for rank r's tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch

from torchnext.comms import _validate as v
from torchnext.comms.reduce_op import ReduceOp

if TYPE_CHECKING:
    from torchnext.comms.backends import BackendHandle
    from torchnext.comms.work import Work

__all__ = ["CollectiveOps", "P2POp"]

_C10D = torch._C._distributed_c10d
Timeout = float | timedelta | None


@dataclass(frozen=True, slots=True)
class P2POp:
    """One point-to-point op of :meth:`Communicator.batch_p2p`: ``P2POp("send", t, peer)`` / ``P2POp("recv", t, peer)``."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def _options(cls: Callable[[], Any], **attrs: Any) -> Any:
    opts = cls()
    for key, value in attrs.items():
        setattr(opts, key, value)
    return opts


class CollectiveOps:
    """Collective and point-to-point ops. Mixed into :class:`~torchnext.comms.Communicator`."""

    if TYPE_CHECKING:
        _rank: int
        _size: int
        _device: torch.device
        _pg: Any
        _backend: BackendHandle

        def _issue(
            self,
            op: str,
            async_op: bool,
            timeout: Timeout,
            launch: Callable[[timedelta | None], Sequence[Any]],
            inputs: Sequence[torch.Tensor],
            outputs: Sequence[torch.Tensor],
            *,
            root: int | None = None,
            peer: int | None = None,
            reduce_op: ReduceOp | None = None,
            finalize: Callable[[], None] | None = None,
            has_future: bool = True,
            tag: int | None = None,
            batch: tuple[Any, ...] = (),
            splits: tuple[Any, ...] = (),
        ) -> Work | None: ...

        def _opt(self, kind: str, key: object, make: Callable[[], Any], timeout: timedelta | None) -> Any: ...

        def _reduce_args(self, op_name: str, op: object, dtype: torch.dtype) -> tuple[ReduceOp, Any, bool]: ...

    def _divide(self, t: torch.Tensor) -> Callable[[], None]:
        size = self._size
        return lambda: t.div_(size)  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------- reductions
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """In place on every rank: ``tensor = op(xs[0], ..., xs[size-1])``. A sparse COO ``tensor`` is summed as
        the backend does it (Gloo: SUM of COO tensors, the result replaces ``tensor``'s values)."""
        t = v.check_tensor(tensor, "tensor", "all_reduce", self._device, sparse=True)
        rop, c_op, divide = self._reduce_args("all_reduce", op, t.dtype)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            return [pg.allreduce([t], self._opt("allreduce", rop._value_, lambda: _options(_C10D.AllreduceOptions, reduceOp=c_op), td))]

        return self._issue("all_reduce", async_op, timeout, launch, (t,), (t,), reduce_op=rop,
                           finalize=self._divide(t) if divide else None)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """On ``root`` only: ``tensor = op(xs[0], ..., xs[size-1])``; other ranks' tensors are unspecified after."""
        t = v.check_tensor(tensor, "tensor", "reduce", self._device)
        root = v.check_rank(root, self._size, "root", "reduce")
        rop, c_op, divide = self._reduce_args("reduce", op, t.dtype)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            make = lambda: _options(_C10D.ReduceOptions, reduceOp=c_op, rootRank=root, rootTensor=0)  # noqa: E731
            return [pg.reduce([t], self._opt("reduce", (rop._value_, root), make, td))]

        finalize = self._divide(t) if divide and self._rank == root else None
        return self._issue("reduce", async_op, timeout, launch, (t,), (t,), root=root, reduce_op=rop, finalize=finalize)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: Sequence[torch.Tensor],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """``output = op(xs[0][rank], ..., xs[size-1][rank])`` where ``xs[r]`` is rank r's ``input_list``."""
        name = "reduce_scatter"
        out = v.check_tensor(output, "output", name, self._device)
        ins = v.check_list(input_list, "input_list", name, self._device, self._size)
        v.check_same_dtype(name, out, "output", ins, "input_list")
        v.check_same_numel(name, out, "output", ins, "input_list")
        rop, c_op, divide = self._reduce_args(name, op, out.dtype)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            make = lambda: _options(_C10D.ReduceScatterOptions, reduceOp=c_op)  # noqa: E731
            return [pg.reduce_scatter([out], [ins], self._opt("reduce_scatter", rop._value_, make, td))]

        return self._issue(name, async_op, timeout, launch, ins, (out,), reduce_op=rop,
                           finalize=self._divide(out) if divide else None)

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """``output = op over r of xs[r].flatten().chunk(size)[rank]`` (``input.numel() == size * output.numel()``)."""
        name = "reduce_scatter_single"
        out = v.check_tensor(output, "output", name, self._device)
        inp = v.check_tensor(input, "input", name, self._device)
        v.check_same_dtype(name, out, "output", [inp], "input")
        if inp.numel() != self._size * out.numel():
            raise ValueError(
                f"{name}: input has {inp.numel()} elements but must have size * output.numel() = "
                f"{self._size} * {out.numel()} = {self._size * out.numel()}"
            )
        rop, c_op, divide = self._reduce_args(name, op, out.dtype)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            make = lambda: _options(_C10D.ReduceScatterOptions, reduceOp=c_op)  # noqa: E731
            return [pg._reduce_scatter_base(out.view(-1), inp.view(-1), self._opt("reduce_scatter", rop._value_, make, td))]

        return self._issue(name, async_op, timeout, launch, (inp,), (out,), reduce_op=rop,
                           finalize=self._divide(out) if divide else None)

    # ------------------------------------------------------------------------------------------- data movement
    def broadcast(self, tensor: torch.Tensor, root: int, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """In place on every rank: ``tensor = xs[root]``."""
        t = v.check_tensor(tensor, "tensor", "broadcast", self._device)
        root = v.check_rank(root, self._size, "root", "broadcast")
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            make = lambda: _options(_C10D.BroadcastOptions, rootRank=root, rootTensor=0)  # noqa: E731
            return [pg.broadcast([t], self._opt("broadcast", root, make, td))]

        return self._issue("broadcast", async_op, timeout, launch, (t,), (t,), root=root)

    def all_gather(
        self, output_list: Sequence[torch.Tensor], tensor: torch.Tensor, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """``output_list[r] = xs[r]`` on every rank."""
        name = "all_gather"
        t = v.check_tensor(tensor, "tensor", name, self._device)
        outs = v.check_list(output_list, "output_list", name, self._device, self._size)
        v.check_same_dtype(name, t, "tensor", outs, "output_list")
        v.check_same_numel(name, t, "tensor", outs, "output_list")
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            return [pg.allgather([outs], [t], self._opt("allgather", None, _C10D.AllgatherOptions, td))]

        return self._issue(name, async_op, timeout, launch, (t,), outs)

    def all_gather_single(
        self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """``output = torch.cat([xs[r].flatten() for r in range(size)])`` viewed as ``output``'s shape."""
        name = "all_gather_single"
        t = v.check_tensor(tensor, "tensor", name, self._device)
        out = v.check_tensor(output, "output", name, self._device)
        v.check_same_dtype(name, t, "tensor", [out], "output")
        if out.numel() != self._size * t.numel():
            raise ValueError(
                f"{name}: output has {out.numel()} elements (shape {tuple(out.shape)}) but must have size * "
                f"tensor.numel() = {self._size} * {t.numel()} = {self._size * t.numel()}"
            )
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            return [pg._allgather_base(out.view(-1), t.view(-1), self._opt("allgather", None, _C10D.AllgatherOptions, td))]

        return self._issue(name, async_op, timeout, launch, (t,), (out,))

    def all_to_all(
        self,
        output_list: Sequence[torch.Tensor],
        input_list: Sequence[torch.Tensor],
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """``output_list[r] = xs[r][rank]`` where ``xs[r]`` is rank r's ``input_list`` (sizes may differ per pair).

        On backends whose list form needs equal sizes (Gloo) this runs as one ``all_to_all_single`` over flat
        buffers (one copy in, one copy out)."""
        name = "all_to_all"
        outs = v.check_list(output_list, "output_list", name, self._device, self._size)
        ins = v.check_list(input_list, "input_list", name, self._device, self._size)
        v.check_same_dtype(name, ins[0], "input_list[0]", [*ins, *outs], "input_list + output_list")
        if ins[self._rank].numel() != outs[self._rank].numel():
            raise ValueError(f"{name}: input_list[{self._rank}] and output_list[{self._rank}] (this rank's own chunk) "
                             f"differ in size: {tuple(ins[self._rank].shape)} vs {tuple(outs[self._rank].shape)}")
        pg = self._pg
        if self._backend.uneven_all_to_all:

            def launch(td: timedelta | None) -> list[Any]:
                return [pg.alltoall(outs, ins, self._opt("alltoall", None, _C10D.AllToAllOptions, td))]

            return self._issue(name, async_op, timeout, launch, ins, outs)
        # Emulated (Gloo's list form needs equal sizes): one all_to_all_single over flat buffers, then unpack.
        in_splits = [t.numel() for t in ins]
        out_splits = [t.numel() for t in outs]
        flat_in = torch.cat([t.reshape(-1) for t in ins])
        flat_out = torch.empty(sum(out_splits), dtype=flat_in.dtype, device=flat_in.device)

        def launch_flat(td: timedelta | None) -> list[Any]:
            opts = self._opt("alltoall", None, _C10D.AllToAllOptions, td)
            return [pg.alltoall_base(flat_out, flat_in, out_splits, in_splits, opts)]

        def unpack() -> None:
            for o, chunk in zip(outs, flat_out.split(out_splits), strict=True):
                o.view(-1).copy_(chunk)

        return self._issue(name, async_op, timeout, launch_flat, ins, outs, finalize=unpack)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """Rows (dim 0) of ``input`` are cut by ``input_splits`` (default: equal) and chunk j goes to rank j;
        ``output`` receives rank r's chunk for this rank at the rows given by ``output_splits[r]``."""
        name = "all_to_all_single"
        out = v.check_tensor(output, "output", name, self._device)
        inp = v.check_tensor(input, "input", name, self._device)
        v.check_same_dtype(name, inp, "input", [out], "output")
        if inp.dim() == 0 or out.dim() == 0:
            raise ValueError(f"{name}: input and output need at least one dimension (rows are exchanged)")
        if inp.shape[1:] != out.shape[1:]:
            raise ValueError(f"{name}: input and output rows differ in shape: {tuple(inp.shape)} vs {tuple(out.shape)}")
        size = self._size
        in_splits = [] if input_splits is None else v.check_splits(input_splits, "input_splits", name, size, inp.shape[0], "input")
        out_splits = [] if output_splits is None else v.check_splits(output_splits, "output_splits", name, size, out.shape[0], "output")
        if input_splits is None and inp.shape[0] % size:
            raise ValueError(f"{name}: input.shape[0]={inp.shape[0]} is not divisible by size {size}; pass input_splits")
        if output_splits is None and out.shape[0] % size:
            raise ValueError(f"{name}: output.shape[0]={out.shape[0]} is not divisible by size {size}; pass output_splits")
        if in_splits and out_splits and in_splits[self._rank] != out_splits[self._rank]:
            raise ValueError(f"{name}: this rank's own chunk differs: input_splits[{self._rank}]={in_splits[self._rank]} "
                             f"but output_splits[{self._rank}]={out_splits[self._rank]}")
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            opts = self._opt("alltoall", None, _C10D.AllToAllOptions, td)
            return [pg.alltoall_base(out, inp, out_splits, in_splits, opts)]

        return self._issue(name, async_op, timeout, launch, (inp,), (out,),
                           splits=(tuple(out_splits), tuple(in_splits)) if in_splits or out_splits else ())

    def _root_list(
        self, name: str, t: torch.Tensor, lst: Sequence[torch.Tensor] | None, label: str, root: int
    ) -> list[torch.Tensor]:
        """The root's per-rank tensor list of gather/scatter, checked against ``t``; [] on the other ranks (which
        must pass None)."""
        if self._rank != root:
            if lst:
                raise ValueError(f"{name}: {label} must be None on non-root rank {self._rank} (root is {root})")
            return []
        out = v.check_list(lst, label, name, self._device, self._size)
        v.check_same_dtype(name, t, "tensor", out, label)
        v.check_same_numel(name, t, "tensor", out, label)
        return out

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: Sequence[torch.Tensor] | None = None,
        root: int = 0,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """On ``root``: ``gather_list[r] = xs[r]``; other ranks pass ``gather_list=None``."""
        name = "gather"
        t = v.check_tensor(tensor, "tensor", name, self._device)
        root = v.check_rank(root, self._size, "root", name)
        outs = self._root_list(name, t, gather_list, "gather_list", root)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            opts = self._opt("gather", root, lambda: _options(_C10D.GatherOptions, rootRank=root), td)
            return [pg.gather([outs] if outs else [], [t], opts)]

        return self._issue(name, async_op, timeout, launch, (t,), outs, root=root)

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: Sequence[torch.Tensor] | None = None,
        root: int = 0,
        *,
        async_op: bool = False,
        timeout: Timeout = None,
    ) -> Work | None:
        """``tensor = scatter_list_on_root[rank]``; non-root ranks pass ``scatter_list=None``."""
        name = "scatter"
        t = v.check_tensor(tensor, "tensor", name, self._device)
        root = v.check_rank(root, self._size, "root", name)
        ins = self._root_list(name, t, scatter_list, "scatter_list", root)
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            opts = self._opt("scatter", root, lambda: _options(_C10D.ScatterOptions, rootRank=root), td)
            return [pg.scatter([t], [ins] if ins else [], opts)]

        return self._issue(name, async_op, timeout, launch, ins, (t,), root=root)

    def barrier(self, *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Return (or complete the Work) once every member entered the barrier."""
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            return [pg.barrier(self._opt("barrier", None, _C10D.BarrierOptions, td))]

        return self._issue("barrier", async_op, timeout, launch, (), ())

    # -------------------------------------------------------------------------------------------- point to point
    def _check_peer(self, peer: object, what: str, op: str) -> int:
        p = v.check_rank(peer, self._size, what, op)
        if p == self._rank:
            raise ValueError(f"{op}: {what}={p} is this rank; a rank cannot send to or receive from itself")
        return p

    @staticmethod
    def _check_tag(tag: object, op: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"{op}: tag must be a non-negative int, got {tag!r}")
        return tag

    def send(
        self, tensor: torch.Tensor, dst: int, tag: int = 0, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Send ``tensor`` to rank ``dst`` (matched by ``recv(.., src=this rank, tag)`` there)."""
        t = v.check_tensor(tensor, "tensor", "send", self._device)
        dst = self._check_peer(dst, "dst", "send")
        tag = self._check_tag(tag, "send")
        pg = self._pg
        return self._issue("send", async_op, timeout, lambda td: [pg.send([t], dst, tag)], (t,), (), peer=dst,
                           has_future=False, tag=tag)

    def recv(
        self, tensor: torch.Tensor, src: int | None, tag: int = 0, *, async_op: bool = False, timeout: Timeout = None
    ) -> Work | None:
        """Receive into ``tensor`` from rank ``src``; ``src=None`` takes the first matching send from any rank
        (then ``async_op=True`` and ``work.source_rank()`` tell which one it was)."""
        t = v.check_tensor(tensor, "tensor", "recv", self._device)
        tag = self._check_tag(tag, "recv")
        pg = self._pg
        if src is None:
            issued: list[Any] = []

            def launch_any(td: timedelta | None) -> list[Any]:
                issued.append(pg.recv_anysource([t], tag))
                return issued

            work = self._issue("recv", True, timeout, launch_any, (), (t,), has_future=False, tag=tag)
            assert work is not None
            work._source = issued  # source_rank() asks the backend Work once complete
            if async_op:
                return work
            work.wait()
            return None
        src = self._check_peer(src, "src", "recv")
        return self._issue("recv", async_op, timeout, lambda td: [pg.recv([t], src, tag)], (), (t,), peer=src,
                           has_future=False, tag=tag)

    def batch_p2p(self, ops: Sequence[P2POp], *, async_op: bool = False, timeout: Timeout = None) -> Work | None:
        """Issue every send/recv of ``ops`` at once; one Work completes when all of them did (any order across
        ranks is fine: nothing waits for an earlier op before issuing a later one)."""
        if not isinstance(ops, (list, tuple)) or not ops:
            raise ValueError(f"batch_p2p: ops must be a non-empty list of P2POp, got {ops!r}")
        checked: list[tuple[bool, torch.Tensor, int, int]] = []
        for i, p in enumerate(ops):
            if not isinstance(p, P2POp):
                raise TypeError(f"batch_p2p: ops[{i}] must be a P2POp, got {type(p).__name__}")
            if p.kind not in ("send", "recv"):
                raise ValueError(f"batch_p2p: ops[{i}].kind must be 'send' or 'recv', got {p.kind!r}")
            t = v.check_tensor(p.tensor, f"ops[{i}].tensor", "batch_p2p", self._device)
            peer = self._check_peer(p.peer, f"ops[{i}].peer", "batch_p2p")
            checked.append((p.kind == "send", t, peer, self._check_tag(p.tag, "batch_p2p")))
        pg = self._pg

        def launch(td: timedelta | None) -> list[Any]:
            return [pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag) for is_send, t, peer, tag in checked]

        inputs = [t for is_send, t, _, _ in checked if is_send]
        outputs = [t for is_send, t, _, _ in checked if not is_send]
        batch = tuple(P2POp("send" if is_send else "recv", t, peer, tag) for is_send, t, peer, tag in checked)
        return self._issue("batch_p2p", async_op, timeout, launch, inputs, outputs, has_future=False, batch=batch)
