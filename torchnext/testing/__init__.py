"""torchnext.testing: multi-rank harness and fault injectors (used by torchnext's tests, usable by yours)."""

from torchnext.testing.coordinators import CoordinatorProcess as CoordinatorProcess
from torchnext.testing.faults import Fault as Fault
from torchnext.testing.faults import FaultInjector as FaultInjector
from torchnext.testing.faults import FaultKind as FaultKind
from torchnext.testing.faults import FaultPoint as FaultPoint
from torchnext.testing.faults import crash_now as crash_now
from torchnext.testing.faults import drop_coordinator as drop_coordinator
from torchnext.testing.faults import freeze_self as freeze_self
from torchnext.testing.faults import kill as kill
from torchnext.testing.faults import resume as resume
from torchnext.testing.member_sim import KillMode as KillMode
from torchnext.testing.member_sim import MemberSim as MemberSim
from torchnext.testing.member_sim import SimConfig as SimConfig
from torchnext.testing.multiprocess import RankContext as RankContext
from torchnext.testing.multiprocess import RankExited as RankExited
from torchnext.testing.multiprocess import RankFailure as RankFailure
from torchnext.testing.multiprocess import run_each as run_each
from torchnext.testing.multiprocess import run_ranks as run_ranks
from torchnext.testing.multiprocess import run_threads as run_threads
from torchnext.testing.netns import NetLab as NetLab

__all__ = [
    "CoordinatorProcess", "Fault", "FaultInjector", "FaultKind", "FaultPoint", "KillMode", "MemberSim", "NetLab",
    "RankContext", "RankExited", "RankFailure", "SimConfig", "crash_now", "drop_coordinator", "freeze_self", "kill",
    "resume", "run_each", "run_ranks", "run_threads",
]
