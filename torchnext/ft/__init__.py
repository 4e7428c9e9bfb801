"""torchnext.ft: fault tolerance -- failure detection, agreement, in-place reconfiguration and healing.

A layer above :mod:`torchnext.comms`: the :class:`Coordinator` (the job's TCPStore plus the membership service,
:mod:`~torchnext.ft.membership`) decides generations; each member's :class:`FaultTolerant` talks to it
(:mod:`~torchnext.ft.member`, line-delimited JSON over TCP: :mod:`~torchnext.ft._wire`), builds one Communicator per
generation, commits steps in two phases (:class:`Step`; what ends an attempt is classified by
:mod:`~torchnext.ft.errors`: retried, or raised on every member) and heals joiners from a donor (:mod:`~torchnext.ft.healing`).
A member may be one rank of a *replica group* (the failure domain); the replicate dimension is one stable torch
process group (:class:`FaultTolerantProcessGroup`, ``ft.process_group``) on which torch's DDP
(:class:`DistributedDataParallel`) and FSDP2's HSDP (:func:`device_mesh`) run; :class:`DiLoCo` and :class:`LocalSGD`
train inside each group and synchronize across the live groups every H steps; :class:`StreamingDiLoCo` does so by
fragments, overlapped with the inner steps, with compressed outer gradients (:class:`OuterDType`). See
docs/fault_tolerance.md.
"""

from torchnext.ft.compression import OuterDType as OuterDType
from torchnext.ft.config import FaultTolerantConfig as FaultTolerantConfig
from torchnext.ft.config import Reconfiguration as Reconfiguration
from torchnext.ft.coordinator import Coordinator as Coordinator
from torchnext.ft.coordinator import CoordinatorConfig as CoordinatorConfig
from torchnext.ft.ddp import DistributedDataParallel as DistributedDataParallel
from torchnext.ft.diloco import DiLoCo as DiLoCo
from torchnext.ft.diloco import DiLoCoConfig as DiLoCoConfig
from torchnext.ft.diloco import LocalSGD as LocalSGD
from torchnext.ft.diloco import LocalSGDConfig as LocalSGDConfig
from torchnext.ft.diloco import OuterSync as OuterSync
from torchnext.ft.errors import FailureKind as FailureKind
from torchnext.ft.errors import RetriesExhausted as RetriesExhausted
from torchnext.ft.errors import StepFailed as StepFailed
from torchnext.ft.errors import classify_failure as classify_failure
from torchnext.ft.errors import register_failure_kind as register_failure_kind
from torchnext.ft.fault_tolerant import FaultTolerant as FaultTolerant
from torchnext.ft.healing import HealingError as HealingError
from torchnext.ft.healing import HealStats as HealStats
from torchnext.ft.membership import CoordinatorLost as CoordinatorLost
from torchnext.ft.membership import JobFinished as JobFinished
from torchnext.ft.membership import MembershipConfig as MembershipConfig
from torchnext.ft.membership import MembershipError as MembershipError
from torchnext.ft.membership import QuorumLost as QuorumLost
from torchnext.ft.membership import RemovedFromGroup as RemovedFromGroup
from torchnext.ft.mesh import device_mesh as device_mesh
from torchnext.ft.process_group import FaultTolerantProcessGroup as FaultTolerantProcessGroup
from torchnext.ft.provisional import StepRevoked as StepRevoked
from torchnext.ft.step import Step as Step
from torchnext.ft.streaming import FragmentPattern as FragmentPattern
from torchnext.ft.streaming import FragmentSync as FragmentSync
from torchnext.ft.streaming import StreamingDiLoCo as StreamingDiLoCo
from torchnext.ft.streaming import StreamingDiLoCoConfig as StreamingDiLoCoConfig

__all__ = [
    "StreamingDiLoCoConfig",
    "StreamingDiLoCo",
    "OuterDType",
    "FragmentSync",
    "FragmentPattern",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorLost",
    "DiLoCo",
    "DiLoCoConfig",
    "DistributedDataParallel",
    "FailureKind",
    "FaultTolerant",
    "FaultTolerantConfig",
    "FaultTolerantProcessGroup",
    "HealStats",
    "HealingError",
    "JobFinished",
    "LocalSGD",
    "LocalSGDConfig",
    "MembershipConfig",
    "MembershipError",
    "OuterSync",
    "QuorumLost",
    "Reconfiguration",
    "StepRevoked",
    "RemovedFromGroup",
    "RetriesExhausted",
    "Step",
    "StepFailed",
    "classify_failure",
    "device_mesh",
    "register_failure_kind",
]
