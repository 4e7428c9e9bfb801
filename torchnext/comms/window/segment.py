"""A rank's registered window memory: a shared-memory file mapped ``MAP_SHARED``, plus its accumulate lock.

Layout of the file (``/dev/shm/torchnext-win-<32 random hex>``, mode 0600)::

    [0, CTRL_BYTES)              int64 signal counters, one per origin rank (slot p: total signalled by rank p)
    [CTRL_BYTES, CTRL_BYTES+n)   the registered data (dtype, numel of this rank)

The name is unguessable and the owner unlinks it as soon as every peer has mapped it (``Window`` does this right
after the creation barrier), so nothing is left in ``/dev/shm`` even if every process is killed later; the memory
lives while some process still maps it.

Accumulate atomicity: :meth:`Segment.lock` holds a ``threading.Lock`` (POSIX record locks belong to the process,
so they do not exclude threads of one process) and an exclusive ``fcntl`` byte-range lock on the file (excludes
other processes; an open-file-description lock on Linux, see ``_file_lock``). Every accumulate and signal on a
target -- by a same-host peer, by the target's own TCP service thread, or by the target itself -- takes the target
segment's lock, so accumulates never lose an update.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator

import torch

from torchnext.comms.reduce_op import ReduceOp

__all__ = ["ACCUMULATE", "DTYPES", "Segment", "dtype_code", "shm_dir"]

PAGE = 4096

# Wire/metadata codes of the dtypes a window can register (index = code). Append only.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dt: i for i, dt in enumerate(DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    """Code of ``dtype`` in :data:`DTYPES`; ``TypeError`` for dtypes a window cannot register."""
    code = _CODE.get(dtype)
    if code is None:
        raise TypeError(f"a window cannot register dtype {dtype}; supported: {[str(d) for d in DTYPES]}")
    return code


def _minimum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


def _maximum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


# In-place accumulate per reduce op: ACCUMULATE[op](dst_view, src). Reference: dst[i] = op(dst[i], src[i]).
ACCUMULATE: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], object]] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: _minimum,
    ReduceOp.MAX: _maximum,
}


def shm_dir() -> str:
    """Folder for segments: ``/dev/shm`` (tmpfs) when present, else the temp folder."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


class Segment:
    """One rank's registered memory, created by its owner (:meth:`create`) or mapped by a peer (:meth:`attach`).

    ``data`` is the flat registered tensor, ``signals`` the int64 counters. Both view the shared mapping.
    """

    def __init__(self, path: str, fd: int, numel: int, dtype: torch.dtype, world: int, *, owner: bool) -> None:
        self.path = path
        self.owner = owner
        self.numel = numel
        self.dtype = dtype
        self.world = world
        self._fd = fd
        st = os.fstat(fd)
        self._thread_lock = _inode_lock((st.st_dev, st.st_ino))
        ctrl = ctrl_bytes(world)
        size = ctrl + max(numel * _itemsize(dtype), 1)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # The tensors keep the mapping alive (frombuffer holds the buffer); it is unmapped when the last one dies.
        self.signals = torch.frombuffer(mm, dtype=torch.int64, count=world, offset=0)
        self.data = (
            torch.frombuffer(mm, dtype=dtype, count=numel, offset=ctrl) if numel else torch.empty(0, dtype=dtype)
        )
        self.nbytes = numel * _itemsize(dtype)

    @classmethod
    def create(cls, numel: int, dtype: torch.dtype, world: int, directory: str | None = None) -> Segment:
        """A new zero-filled segment under an unguessable name (``O_EXCL``, mode 0600)."""
        folder = directory or shm_dir()
        path = os.path.join(folder, f"torchnext-win-{secrets.token_hex(16)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, ctrl_bytes(world) + max(numel * _itemsize(dtype), 1))
            return cls(path, fd, numel, dtype, world, owner=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, path: str, numel: int, dtype: torch.dtype, world: int) -> Segment:
        """Map a peer's segment read/write (``OSError`` when the file cannot be opened)."""
        fd = os.open(path, os.O_RDWR)
        try:
            expected = ctrl_bytes(world) + max(numel * _itemsize(dtype), 1)
            if os.fstat(fd).st_size != expected:
                raise OSError(f"segment {path} has {os.fstat(fd).st_size} bytes, expected {expected}")
            return cls(path, fd, numel, dtype, world, owner=False)
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive access to this segment for read-modify-write ops (accumulate, signal), across threads and
        processes. The lock syscalls are also full memory barriers."""
        with self._thread_lock:
            _file_lock(self._fd, True)
            try:
                yield
            finally:
                _file_lock(self._fd, False)

    def add_signal(self, origin: int, value: int) -> None:
        """``signals[origin] += value`` under the lock."""
        with self.lock():
            self.signals[origin] += value

    def unlink(self) -> None:
        """Remove the file name (owner only; mappings stay valid). Idempotent."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Close the file descriptor (the mapping stays while ``data``/``signals`` tensors are referenced)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with self._thread_lock:
                # closing any fd of the file drops this process's record locks on it; the thread lock is held, so
                # no thread of this process is inside a locked section
                os.close(fd)
        self.unlink()


# Open-file-description locks (Linux >= 3.15): owned by the open file, not the process, so the kernel's
# process-level deadlock detector (which reports false EDEADLK when threads of several processes hold different
# segments' locks) does not apply. Elsewhere: classic record locks, retried on EDEADLK.
_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on LP64 Linux: l_type, l_whence, l_start, l_len, l_pid


def _file_lock(fd: int, acquire: bool) -> None:
    if _OFD_SETLKW is not None:
        kind = fcntl.F_WRLCK if acquire else fcntl.F_UNLCK
        fcntl.fcntl(fd, _OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, 0, 1, 0))
        return
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if acquire else fcntl.LOCK_UN, 1, 0)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(1e-4)


_INODE_LOCKS: dict[tuple[int, int], threading.Lock] = {}
_INODE_LOCKS_GUARD = threading.Lock()


def _inode_lock(key: tuple[int, int]) -> threading.Lock:
    """One thread lock per segment file per process: POSIX record locks do not exclude threads of one process, and
    several ``Segment`` objects of one process may map the same file (ranks run as threads)."""
    with _INODE_LOCKS_GUARD:
        lock = _INODE_LOCKS.get(key)
        if lock is None:
            lock = _INODE_LOCKS[key] = threading.Lock()
        return lock


def ctrl_bytes(world: int) -> int:
    """Bytes of the signal-counter header, rounded up to a page so the data is page-aligned."""
    return -(-world * 8 // PAGE) * PAGE


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
