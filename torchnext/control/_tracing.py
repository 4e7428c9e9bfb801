"""Small helpers shared by the control-flow operators: "are we tracing?" and the compile-availability guard."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_tracing", "require_compile", "compile_supported", "CompileUnsupportedError"]


class CompileUnsupportedError(RuntimeError):
    """``torch.compile`` (TorchDynamo) is not supported by the running interpreter or build."""


def is_tracing(*values: Any) -> bool:
    """True while a graph is being captured rather than run eagerly.

    Covers TorchDynamo (``torch.compile``, strict ``torch.export``), non-strict export and ``make_fx`` (a fake or
    proxy dispatch mode is active, or a value is a FakeTensor). Cheap (well under a microsecond per check).
    """
    if torch.compiler.is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    fake = _fake_tensor_type()
    for v in values:
        if isinstance(v, fake):
            return True
    return False


_FAKE: list[type] = []


def _fake_tensor_type() -> type:
    if not _FAKE:
        from torch._subclasses.fake_tensor import FakeTensor

        _FAKE.append(FakeTensor)
    return _FAKE[0]


def interpreter_version() -> tuple[int, int]:
    """(major, minor) of the running interpreter (one indirection, so tests can pretend to be Python 3.15)."""
    return sys.version_info[0], sys.version_info[1]


def compile_supported() -> tuple[bool, str]:
    """Whether torch.compile can run here, and why not when it cannot.

    Python 3.15+ is not supported by TorchDynamo in the torch releases torchnext targets; torch's own check
    (``torch._dynamo.is_dynamo_supported``) is consulted as well, so a build without Dynamo is caught too.
    """
    version = interpreter_version()
    if version >= (3, 15):
        return False, f"torch.compile is not supported on Python {version[0]}.{version[1]}"
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return False, (
            f"torch.compile is not supported on this interpreter (Python {sys.version.split()[0]}, "
            f"torch {torch.__version__}): torch._dynamo.is_dynamo_supported() is False"
        )
    return True, ""


def require_compile(api: str) -> None:
    """Raise :class:`CompileUnsupportedError` (a RuntimeError) naming ``api`` when torch.compile cannot run here.

    torchnext never falls back to eager silently: an API that needs the compiler says so.
    """
    ok, why = compile_supported()
    if not ok:
        raise CompileUnsupportedError(f"{api} needs torch.compile, which is unavailable: {why}")
