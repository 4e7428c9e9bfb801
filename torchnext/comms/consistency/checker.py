"""The consistency checker: compares every op of a communicator across its members before the op is issued.

One :class:`Checker` per checked communicator (``Communicator(..., check_collectives=True)``; split children get
their own). It runs as the communicator's *check hook* -- on the issuing thread, after the pre hooks, before
anything reaches the backend -- so a refused op moves no data on any member. Protocol per collective::

    seq += 1; fp = Fingerprint.of(info, seq)
    side.all_reduce([fp.digest, -fp.digest], MAX)          # a small Gloo group of the same members ("side group")
    if max != -max(-digest):                               # some member differs: every member learns it here
        side.all_gather(len(fp.json)); side.all_gather(fp.json, padded)    # sizes agree: no Gloo size mismatch
        raise CollectiveMismatch(difference(fingerprints))  # on every member; the communicator stays usable
    all_to_all*: side.all_gather(sends + recvs); a pair where i's send to j != j's receive from i -> mismatch
    the side op fails (a member never came, or closed the connection):
        post arrived/<seq>/<rank>; poll the store for the others' (or their left/<rank> marker) for a grace period
        the first member to decide writes verdict/<seq> (compare_set), so every member names the same culprits
        raise CollectiveMismatch(field="arrival", breaks_communicator=True)   # errored, like after a timeout

Point to point (the k-th op of (src, dst, tag) on each side pair up, as Gloo pairs them)::

    post p2p/<src>><dst>/<tag>/<k>/<s|r> = {"shape", "dtype"}           # every send/recv with a known peer
    synchronous op (send, recv, batch_p2p): poll for the counterpart's key -- a send also accepts an any-source
        receive on its destination (unchecked) -- compare numel and dtype, delete the key read
    asynchronous op: post only (waiting at issue would deadlock isend/irecv exchanges that post both sides first);
        a synchronous counterpart still checks it

Every wait is bounded by the op's timeout (the side group's ops carry it) and ends within ~40 ms of ``abort()``
(the check then returns and the communicator raises ``CommAborted``). Nothing read from the store or the side group
is trusted: malformed data raises ``CollectiveMismatch`` naming the member that sent it.
"""

from __future__ import annotations

import _thread
import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchnext.comms.backends import BackendConfig, BackendHandle, get_backend
from torchnext.comms.consistency.fingerprint import (
    Fingerprint,
    FingerprintError,
    difference,
    exchange_difference,
    rule_for,
)
from torchnext.comms.errors import CollectiveMismatch, CommError, PeerFailure, classify_backend_error
from torchnext.comms.hooks import AbortHookArgs, OpInfo
from torchnext.comms.work import SYNC_WAIT_SLICE

if TYPE_CHECKING:
    from torchnext.comms.communicator import Communicator

__all__ = ["Checker"]

_C10D = torch._C._distributed_c10d
_SLICE_S = SYNC_WAIT_SLICE.total_seconds()
_SLICE_TEXT = "Operation timed out!"  # c10d Work::wait(timeout) when the timeout elapses (the op keeps running)
_P2P = frozenset({"send", "recv", "batch_p2p"})
_ASYNC_WINDOW = 64  # an async p2p op deletes its own key of 64 ops earlier on the same stream (nobody may read it)
_MAX_VALUE = 1 << 16
_VERDICT_EVERY_S = 0.25  # a side wait longer than its first slice looks for a verdict this often


class _SideFailure(Exception):
    """The side group's op failed (the original backend exception is ``__cause__``)."""


class Checker:
    """Checks one communicator's ops across its members (see the module docstring)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        base = dist.PrefixStore("consistency", comm.store)
        self._keys = dist.PrefixStore("keys", base)
        cfg = BackendConfig(store=dist.PrefixStore("side", base), rank=comm.rank, size=comm.size,
                            timeout=comm.timeout, device=torch.device("cpu"), name=f"{comm.name}.consistency")
        self._side: BackendHandle | None = get_backend("gloo")(cfg)
        self._side_work: Any = None
        self._seq = 0
        self._p2p_counts: dict[tuple[str, int, int], int] = {}
        self._any_posted: set[int] = set()
        self._opts: dict[tuple[str, timedelta], Any] = {}
        self._aborted = False
        self._broken: str | None = None  # why the side group can no longer be used
        self._wake: Any = None  # the lock a long side wait blocks on (abort releases it)
        self._handles = [
            comm.register_check_hook(self.check),
            comm.register_abort_hook(self._on_abort),
            comm.register_shutdown_hook(self._on_shutdown),
            comm.register_split_hook(attach),
        ]
        comm.extensions["consistency"] = self

    @property
    def checked(self) -> int:
        """Collectives checked so far (the sequence number of the last one)."""
        return self._seq

    # ----------------------------------------------------------------------------------------------- the hook
    def check(self, info: OpInfo) -> None:
        """The check hook: return to let ``info`` be issued, raise ``CollectiveMismatch`` to refuse it."""
        if info.op in _P2P:
            self._check_p2p(info)
            return
        self._seq += 1
        fp = Fingerprint.of(info, self._seq)
        if self._broken is not None:  # an earlier check failed: say who is missing now, without the side group
            self._arrival(info, fp, None)
            return
        digest = fp.digest
        buf = torch.tensor([digest, -digest], dtype=torch.int64)
        try:
            if not self._run(lambda opts: self._pg().allreduce([buf], opts), "allreduce", info):
                return  # aborted: the communicator raises CommAborted
            top, neg_bottom = buf.tolist()
            if top != -neg_bottom:
                self._mismatch(info, fp)
            if fp.exchange is not None:
                self._check_exchange(info, fp)
        except _SideFailure as failure:
            self._arrival(info, fp, failure.__cause__)

    # ------------------------------------------------------------------------------------------- collectives
    def _pg(self) -> Any:
        side = self._side
        if side is None:  # abort() or shutdown() released it meanwhile
            raise RuntimeError(f"the consistency side group of {self.comm.name!r} was released")
        return side.pg

    def _options(self, kind: str, timeout: timedelta) -> Any:
        opts = self._opts.get((kind, timeout))
        if opts is None:
            if kind == "allreduce":
                opts = _C10D.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
            else:
                opts = _C10D.AllgatherOptions()
            opts.timeout = timeout
            self._opts[(kind, timeout)] = opts
        return opts

    def _run(self, launch: Any, kind: str, info: OpInfo) -> bool:
        """Issue one side-group op and wait for it: True once done, False when the communicator was aborted
        meanwhile; ``_SideFailure`` when the op failed (Gloo times it out after the op's own timeout)."""
        if self._aborted:
            return False
        try:
            work = launch(self._options(kind, info.timeout))
        except Exception as exc:
            raise _SideFailure() from exc
        self._side_work = work  # side ops run one at a time: only the last one can still be running
        try:
            work.wait(SYNC_WAIT_SLICE)  # the fast path: every member is already there
            return True
        except RuntimeError as exc:
            if str(exc) != _SLICE_TEXT:
                raise _SideFailure() from exc
        posted = self._announce(info)  # a slow check: say we are here, for whoever has to name the missing
        ready = _thread.allocate_lock()
        ready.acquire()
        self._wake = ready
        fut = work.get_future()
        fut.add_done_callback(lambda _f: _release(ready))
        deadline = time.monotonic() + info.timeout.total_seconds() + 10.0  # Gloo's own timeout fires first
        look = time.monotonic() + _VERDICT_EVERY_S
        try:
            while not ready.acquire(timeout=_SLICE_S):
                if self._aborted:
                    return False
                now = time.monotonic()
                if now > deadline:
                    raise _SideFailure() from TimeoutError(f"side-group {kind} did not finish")
                if now > look:  # the others may have given up on this collective already (a verdict names us)
                    look = now + _VERDICT_EVERY_S
                    if self._keys.check([f"verdict/{self._seq}"]):
                        raise _SideFailure() from TimeoutError("the other members gave up on this collective")
        finally:
            self._wake = None
        if self._aborted:
            return False
        try:
            fut.value()
        except Exception as exc:
            raise _SideFailure() from exc
        if posted:
            _quiet_delete(self._keys, posted)
        return True

    def _announce(self, info: OpInfo) -> str:
        """Post ``arrived/<seq>/<rank>`` (this member reached the check); returns the key ("" when it failed)."""
        key = f"arrived/{self._seq}/{self.comm.rank}"
        try:
            self._keys.set(key, Fingerprint.of(info, self._seq).to_json())
        except Exception:
            return ""
        return key

    def _gather_bytes(self, info: OpInfo, data: bytes) -> dict[int, bytes] | None:
        """Every member's ``data`` (sizes first, so the second all_gather has equal sizes everywhere)."""
        size = self.comm.size
        mine = torch.tensor([len(data)], dtype=torch.int64)
        lengths = torch.empty(size, dtype=torch.int64)
        if not self._run(lambda o: self._pg()._allgather_base(lengths, mine, o), "allgather", info):
            return None
        sizes = lengths.tolist()
        width = max(sizes)
        if width > _MAX_VALUE or min(sizes) < 0:
            raise self._mismatch_error(info, f"a member announced a fingerprint of {width} bytes (limit "
                                       f"{_MAX_VALUE})", [self.comm.ranks[r] for r, n in enumerate(sizes)
                                                          if n > _MAX_VALUE or n < 0], "fingerprint")
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
        table = torch.empty(size * width, dtype=torch.uint8)
        if not self._run(lambda o: self._pg()._allgather_base(table, padded, o), "allgather", info):
            return None
        rows = table.view(size, width)
        return {r: bytes(rows[r, : sizes[r]].tolist()) for r in range(size)}

    def _mismatch(self, info: OpInfo, fp: Fingerprint) -> None:
        """Digests differ: exchange the full fingerprints and raise what differs (on every member)."""
        texts = self._gather_bytes(info, fp.to_json().encode())
        if texts is None:
            return
        ranks = self.comm.ranks
        fps: dict[int, Fingerprint] = {}
        bad: list[int] = []
        for r, text in texts.items():
            try:
                fps[r] = Fingerprint.from_json(text, source=f"rank {ranks[r]}")
            except FingerprintError:
                bad.append(ranks[r])
        if bad:
            raise self._mismatch_error(info, f"unreadable fingerprint from ranks {bad}", bad, "fingerprint")
        found = difference(fps, ranks)
        if found is None:  # equal fingerprints, different digests: cannot happen with one torchnext version
            raise self._mismatch_error(info, "fingerprint digests differ but the fingerprints are equal (members "
                                       "run different torchnext versions?)", [], "fingerprint", fps)
        field, culprits, message = found
        raise self._mismatch_error(info, message + "; nothing was sent (the op was refused on every member)",
                                   culprits, field, fps)

    def _check_exchange(self, info: OpInfo, fp: Fingerprint) -> None:
        assert fp.exchange is not None
        sends, recvs = fp.exchange
        size = self.comm.size
        mine = torch.tensor([*sends, *recvs], dtype=torch.int64)
        table = torch.empty(2 * size * size, dtype=torch.int64)
        if not self._run(lambda o: self._pg()._allgather_base(table, mine, o), "allgather", info):
            return
        rows = table.view(size, 2 * size).tolist()
        matrix = {r: (row[:size], row[size:]) for r, row in enumerate(rows)}
        unit = "rows" if rule_for(info.op).exchange == "rows" else "elements"
        found = exchange_difference(matrix, self.comm.ranks, unit)
        if found is not None:
            culprits, message = found
            raise self._mismatch_error(info, f"{info.op} #{fp.seq}: {message}; nothing was sent (the op was "
                                       "refused on every member)", culprits, "splits")

    def _mismatch_error(self, info: OpInfo, detail: str, culprits: list[int], field: str,
                        fps: dict[int, Fingerprint] | None = None, *, breaks: bool = False) -> CollectiveMismatch:
        ranks = self.comm.ranks
        return CollectiveMismatch(
            f"collective mismatch: {detail}", culprits=culprits, field=field, seq=self._seq,
            fingerprints={ranks[r]: f.text() for r, f in (fps or {}).items()}, breaks_communicator=breaks,
            **self.comm._error_context(info.op, info.op_id),
        )

    # ----------------------------------------------------------------------------- a member that never came
    def _arrival(self, info: OpInfo, fp: Fingerprint, cause: BaseException | None) -> None:
        """The side group failed (or failed earlier): find out through the store which members reached this
        collective, agree on a verdict, and raise it."""
        comm = self.comm
        if self._aborted or comm.errored() is not None:
            return
        self._broken = self._broken or f"{info.op} #{fp.seq}: {cause}"
        me, size, ranks = comm.rank, comm.size, comm.ranks
        seq = fp.seq
        keys = self._keys
        try:
            keys.set(f"arrived/{seq}/{me}", fp.to_json())
        except Exception as exc:
            raise self._side_error(info, cause or exc) from exc
        timeout_s = info.timeout.total_seconds()
        grace = min(10.0, max(1.0, 0.25 * timeout_s))
        present: dict[int, Fingerprint] = {me: fp}
        left: dict[int, str] = {}
        deadline = time.monotonic() + grace
        pause = 1e-3
        while True:
            for r in range(size):
                if r in present or r in left:
                    continue
                try:
                    if keys.check([f"arrived/{seq}/{r}"]):
                        present[r] = Fingerprint.from_json(_get(keys, f"arrived/{seq}/{r}"), source=f"rank {ranks[r]}")
                    elif keys.check([f"left/{r}"]):
                        left[r] = _left_text(_get(keys, f"left/{r}"))
                except FingerprintError as exc:
                    raise self._mismatch_error(info, str(exc), [ranks[r]], "fingerprint", breaks=True) from None
                except Exception as exc:
                    raise self._side_error(info, cause or exc) from exc
            verdict = _verdict(keys, seq)
            if (len(present) + len(left) == size or verdict is not None or self._aborted
                    or time.monotonic() > deadline):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        if self._aborted:
            return
        missing = sorted(r for r in range(size) if r not in present)
        if verdict is None and missing:
            proposal = json.dumps({"missing": [ranks[r] for r in missing], "seq": seq, "op": f"{fp.op} #{seq}",
                                   "left": {str(ranks[r]): t for r, t in left.items()},
                                   "present": sorted(ranks[r] for r in present), "waited_s": round(timeout_s, 3)})
            try:
                verdict = _parse_verdict(keys.compare_set(f"verdict/{seq}", "", proposal))
            except Exception as exc:
                raise self._side_error(info, cause or exc) from exc
        if verdict is None:  # everybody reached it: the side group failed for another reason
            raise self._side_error(info, cause)
        culprits = verdict["missing"]
        came: list[int] = verdict["present"]
        if culprits and len(came) < len(culprits) and len(verdict["left"]) == len(culprits):
            # the majority had finished (shut down after the previous collective): the minority issued one more
            gone = "; ".join(f"rank {r} {t}" for r, t in verdict["left"].items())
            detail = (f"{_ranks(came)} entered {verdict['op']}, which {_ranks(culprits)} never will ({gone}): "
                      f"{_ranks(came)} issued a collective more than the others")
            error = self._mismatch_error(info, detail, came, "arrival", breaks=True)
            raise error from cause
        if ranks[me] in culprits:
            others = verdict["present"]
            detail = (f"this rank ({ranks[me]}) entered {fp.op} #{seq} after {_ranks(others)} gave up waiting for it "
                      f"(they waited {verdict['waited_s']} s in {verdict['op']}): it is late, or it skipped or "
                      "added a collective earlier")
        else:
            gone = "; ".join(f"rank {r} {t}" for r, t in verdict["left"].items())
            detail = (f"{_ranks(culprits)} did not enter {verdict['op']} within {verdict['waited_s']} s, while "
                      f"{_ranks(verdict['present'])} did" + (f" ({gone})" if gone else "")
                      + ": a skipped or extra collective, or a member stuck elsewhere or dead")
        error = self._mismatch_error(info, detail, culprits, "arrival", breaks=True)
        if cause is not None:
            raise error from cause
        raise error

    def _side_error(self, info: OpInfo, cause: BaseException | None) -> CommError:
        cls = classify_backend_error(cause) if cause is not None else CommError
        detail = f"consistency check failed: {cause}"
        ctx = self.comm._error_context(info.op, info.op_id)
        return PeerFailure(detail, **ctx) if cls is PeerFailure else cls(detail, **ctx)

    # ------------------------------------------------------------------------------------------ point to point
    def _check_p2p(self, info: OpInfo) -> None:
        keys, me, ranks = self._keys, self.comm.rank, self.comm.ranks
        if info.op == "recv" and info.peer is None:  # any source: cannot be paired; let senders to us proceed
            tag = info.tag or 0
            if tag not in self._any_posted:
                keys.set(f"anyrecv/{me}/{tag}", "1")
                self._any_posted.add(tag)
            return
        ops: list[tuple[str, torch.Tensor, int, int]]
        if info.batch:
            ops = [(p.kind, p.tensor, p.peer, p.tag) for p in info.batch]
        else:
            t = (info.inputs or info.outputs)[0]
            ops = [(info.op, t, int(info.peer if info.peer is not None else -1), info.tag or 0)]
        waits = []
        for kind, tensor, peer, tag in ops:
            stream = (kind, peer, tag)
            k = self._p2p_counts.get(stream, 0) + 1
            self._p2p_counts[stream] = k
            src, dst = (me, peer) if kind == "send" else (peer, me)
            base = f"p2p/{src}>{dst}/{tag}/{k}/"
            mine, theirs = ("s", "r") if kind == "send" else ("r", "s")
            keys.set(base + mine, json.dumps({"shape": list(tensor.shape), "dtype": str(tensor.dtype)[6:]}))
            if info.async_op and k > _ASYNC_WINDOW:
                _quiet_delete(keys, f"p2p/{src}>{dst}/{tag}/{k - _ASYNC_WINDOW}/{mine}")
            waits.append((kind, peer, tag, k, tensor, base + mine, base + theirs,
                          f"anyrecv/{dst}/{tag}" if kind == "send" else ""))
        if info.async_op:
            return
        found = self._poll([(w[6], w[7]) for w in waits], info.timeout.total_seconds())
        if found is None:
            return  # aborted
        problems: list[str] = []
        culprits: set[int] = set()
        late: list[str] = []
        for (kind, peer, tag, k, tensor, own, key, _alt), how in zip(waits, found, strict=True):
            desc = f"{kind} {'to' if kind == 'send' else 'from'} rank {ranks[peer]} (tag {tag}, message #{k})"
            if how is None:
                late.append(desc)
                culprits.add(ranks[peer])
                continue
            if how == "any":  # its receiver takes any source: nothing to compare
                _quiet_delete(keys, own)
                continue
            parsed = _parse_p2p(how)
            _quiet_delete(keys, key)
            if parsed is None:
                problems.append(f"{desc}: unreadable description from rank {ranks[peer]}")
                culprits |= {ranks[peer]}
                continue
            shape, dtype = parsed
            mine_dtype = str(tensor.dtype)[6:]
            numel = 1
            for n in shape:
                numel *= n
            if numel != tensor.numel() or dtype != mine_dtype:
                other = "recv" if kind == "send" else "send"
                problems.append(f"{desc}: {list(tensor.shape)} {mine_dtype} here, but its {other} on rank "
                                f"{ranks[peer]} has {shape} {dtype}")
                culprits |= {ranks[me], ranks[peer]}
        if late:
            raise self._mismatch_error(
                info, f"no matching op within {info.timeout.total_seconds():.1f} s for: {'; '.join(late)}",
                sorted(culprits), "p2p", breaks=True)
        if problems:
            raise self._mismatch_error(info, "; ".join(problems) + "; nothing was sent", sorted(culprits), "p2p")

    def _poll(self, wanted: list[tuple[str, str]], timeout_s: float) -> list[bytes | str | None] | None:
        """Wait until each ``(key, alternative)`` has its key (-> the value) or its alternative (-> "any");
        None entries for the ones still missing at the timeout; None when aborted."""
        keys = self._keys
        out: list[bytes | str | None] = [None] * len(wanted)
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while True:
            for i, (key, alt) in enumerate(wanted):
                if out[i] is not None:
                    continue
                if keys.check([key]):
                    out[i] = _get(keys, key)
                elif alt and keys.check([alt]):
                    out[i] = "any"
            if all(x is not None for x in out) or time.monotonic() > deadline:
                return out
            if self._aborted:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    # ------------------------------------------------------------------------------------------- life cycle
    def _on_abort(self, args: AbortHookArgs) -> None:
        self._aborted = True
        wake = self._wake
        if wake is not None:
            _release(wake)
        self._post_left("aborted its communicator" + (f" ({args.reason})" if args.reason else ""))
        side, self._side = self._side, None
        if side is not None:
            from torchnext.comms.reaper import bury

            bury(side, f"{args.comm_name}/consistency", self._side_works())  # a side op may be in flight: cancelled, released when done

    def _side_works(self) -> list[Any]:
        work, self._side_work = self._side_work, None
        return [] if work is None else [work]

    def _on_shutdown(self, comm: Communicator) -> None:
        self._post_left("shut down its communicator")
        side, self._side = self._side, None
        if side is None:
            return
        if self._broken is not None:
            from torchnext.comms.reaper import bury

            bury(side, f"{comm.name}/consistency", self._side_works())
            return
        if side.shutdown_fn is not None:
            side.shutdown_fn()
        side.pg = None  # destroyed here, on the calling thread

    def _post_left(self, how: str) -> None:
        try:
            self._keys.set(f"left/{self.comm.rank}", json.dumps({"how": how, "after": self._seq}))
        except Exception:  # best effort: a dead store must not break abort() or shutdown()
            pass

    def detach(self) -> None:
        """Stop checking (ops are issued unchecked from now on); the side group is released at shutdown."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.comm.extensions.pop("consistency", None)


def attach(comm: Communicator) -> Checker:
    """Check ``comm``'s ops from now on (and those of its future split children). Collective over ``comm``: every
    member must call it (it connects the side group)."""
    existing = comm.extensions.get("consistency")
    if isinstance(existing, Checker):
        return existing
    return Checker(comm)


# ---------------------------------------------------------------------------------------------------- helpers
def _release(lock: Any) -> None:
    try:
        lock.release()
    except RuntimeError:
        pass


def _get(keys: dist.Store, key: str) -> bytes:
    value = keys.get(key)
    return bytes(value)


def _quiet_delete(keys: dist.Store, key: str) -> None:
    try:
        keys.delete_key(key)
    except Exception:
        pass


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {list(rs)}"


def _left_text(raw: bytes) -> str:
    try:
        obj = json.loads(raw[:_MAX_VALUE].decode())
        return f"{str(obj['how'])[:300]} after collective #{int(obj['after'])}"
    except Exception:
        return "left (unreadable marker)"


def _verdict(keys: dist.Store, seq: int) -> dict[str, Any] | None:
    key = f"verdict/{seq}"
    if not keys.check([key]):
        return None
    return _parse_verdict(_get(keys, key))


def _parse_verdict(raw: bytes | str) -> dict[str, Any] | None:
    """A verdict another member wrote; None when unusable (then this member decides by itself)."""
    try:
        obj = json.loads(raw if isinstance(raw, str) else raw[:_MAX_VALUE].decode())
        if not isinstance(obj, dict):
            return None
        missing = [int(r) for r in obj["missing"]]
        present = [int(r) for r in obj["present"]]
        left = {str(k): str(v)[:300] for k, v in dict(obj.get("left") or {}).items()}
        return {"missing": missing, "present": present, "left": left, "op": str(obj["op"])[:500],
                "waited_s": float(obj["waited_s"])}
    except Exception:
        return None


def _parse_p2p(raw: bytes | str) -> tuple[list[int], str] | None:
    try:
        obj = json.loads(raw if isinstance(raw, str) else raw[:_MAX_VALUE].decode())
        shape = [int(n) for n in obj["shape"]]
        dtype = str(obj["dtype"])[:40]
        if any(n < 0 for n in shape):
            return None
        return shape, dtype
    except Exception:
        return None
