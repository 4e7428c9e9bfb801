"""torchnext as a torch.distributed process group: ``dist.*``, DDP, FSDP2, DeviceMesh and functional collectives on
torchnext Communicators.

Two doors: ``dist.init_process_group(backend="torchnext")`` (``import torchnext`` registers the backend; torch
then calls :func:`~torchnext.comms.process_group.backend.create` for the default group and every ``new_group``),
and ``comm.as_process_group()`` for a Communicator you built. Either way the group is a
:class:`TorchnextProcessGroup`; its ops are the Communicator's (hooks, Flight Recorder, abort), its Work a
:class:`GroupWork` whose future never raises (:mod:`~torchnext.comms.process_group.work`). For scripts nobody can
edit, :mod:`~torchnext.comms.process_group.launch` (``torchnext run``) swaps the backend in. See
docs/process_group.md.
"""

from torchnext.comms.extension import register_factory
from torchnext.comms.process_group.backend import as_process_group as as_process_group
from torchnext.comms.process_group.backend import create as create
from torchnext.comms.process_group.group import BACKEND_NAME as BACKEND_NAME
from torchnext.comms.process_group.group import TorchnextProcessGroup as TorchnextProcessGroup
from torchnext.comms.process_group.timeouts import install as _install_timeout_setters
from torchnext.comms.process_group.timeouts import set_timeout as set_timeout
from torchnext.comms.process_group.work import GroupWork as GroupWork

__all__ = ["BACKEND_NAME", "GroupWork", "TorchnextProcessGroup", "as_process_group", "create", "set_timeout"]

register_factory("as_process_group", as_process_group)
_install_timeout_setters()
