"""The Flight Recorder: a per-rank trace of every communicator op, its dump format, and the hang analyzer.

Data flow: a :class:`FlightRecorder` hangs on a Communicator's pre/post/abort/split hooks
(:mod:`~torchnext.comms.flight_recorder.recorder`, :mod:`~torchnext.comms.flight_recorder._attach`) and keeps raw
entries in a ring; a dump formats them (:mod:`~torchnext.comms.flight_recorder.entries`) into one self-describing
file per rank (:mod:`~torchnext.comms.flight_recorder.format`: JSON, or a pickle that PyTorch's ``torchfrtrace``
reads); :func:`load_dir` reads a directory of dumps back (ours and PyTorch's, never unpickling anything but plain
data), :func:`analyze` finds the hang point and the mismatches, :func:`render_timeline` draws it, and
``torchnext fr analyze`` (:mod:`~torchnext.comms.flight_recorder.cli`) is the command line. See
docs/flight_recorder.md.

Importing this package registers the ``flight_recorder=`` option of :class:`~torchnext.comms.Communicator`.
"""

from torchnext.comms.extension import register_option
from torchnext.comms.flight_recorder.analysis import Issue as Issue
from torchnext.comms.flight_recorder.analysis import IssueKind as IssueKind
from torchnext.comms.flight_recorder.analysis import Report as Report
from torchnext.comms.flight_recorder.analysis import analyze as analyze
from torchnext.comms.flight_recorder.analysis import analyze_dir as analyze_dir
from torchnext.comms.flight_recorder.loader import DumpFormatError as DumpFormatError
from torchnext.comms.flight_recorder.loader import RankDump as RankDump
from torchnext.comms.flight_recorder.loader import load_dir as load_dir
from torchnext.comms.flight_recorder.loader import load_file as load_file
from torchnext.comms.flight_recorder.recorder import CommunicatorOption
from torchnext.comms.flight_recorder.recorder import EntryState as EntryState
from torchnext.comms.flight_recorder.recorder import FlightRecorder as FlightRecorder
from torchnext.comms.flight_recorder.recorder import FlightRecorderError as FlightRecorderError

__all__ = [
    "DumpFormatError",
    "EntryState",
    "FlightRecorder",
    "FlightRecorderError",
    "Issue",
    "IssueKind",
    "RankDump",
    "Report",
    "analyze",
    "analyze_dir",
    "load_dir",
    "load_file",
]

register_option("flight_recorder", CommunicatorOption())
