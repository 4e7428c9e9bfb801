"""Python 3.15 rule: where torch.compile is unsupported, every torchnext API that needs it raises RuntimeError."""

from __future__ import annotations

import pytest
import torch

import torchnext
from torchnext.control import CompileUnsupportedError
from torchnext.control._tracing import compile_supported


@pytest.fixture(params=["python_3_15", "dynamo_unsupported"])
def no_compile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python_3_15":
        import torchnext.control._tracing as tr

        monkeypatch.setattr(tr, "interpreter_version", lambda: (3, 15))
    else:
        import torch._dynamo.eval_frame as ef

        monkeypatch.setattr(ef, "is_dynamo_supported", lambda: False)
    return str(request.param)


def test_every_compile_api_refuses(no_compile: str) -> None:
    ok, why = compile_supported()
    assert not ok and ("3.15" in why or "is_dynamo_supported" in why)
    for call in (
        lambda: torchnext.compile(lambda x: x + 1),
        lambda: torchnext.compile(lambda x: x + 1, decompose_complex=True),
        lambda: torchnext.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),), strict=True),
        lambda: torchnext.control.complex_backend("inductor"),
    ):
        with pytest.raises(CompileUnsupportedError, match=r"needs torch\.compile") as ei:
            call()
        assert isinstance(ei.value, RuntimeError)


def test_eager_apis_still_work(no_compile: str) -> None:
    x = torch.randn(3)
    assert torch.equal(torchnext.switch(torch.tensor(1), [lambda x: x + 1, lambda x: x * 2], (x,)), x * 2)
    assert torch.equal(torchnext.fori_loop(0, 3, lambda i, v: v + 1, x), x + 3)


def test_supported_here() -> None:
    assert compile_supported() == (True, "")
