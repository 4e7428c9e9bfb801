"""torchnext.while_loop / fori_loop: eager / compile / export (+ save/load), against plain Python loops."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from torchnext.control import LoopError, fori_loop, while_loop
from torchnext.control.while_loop import while_loop_reference


def _cond(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.abs().sum() < 100.0


def _body(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return i + 1, x * 1.7 + 0.1


def _fori_body(i: torch.Tensor, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"acc": v["acc"] + i * v["w"], "w": v["w"] * 0.5}


def _fori_ref(lo: int, hi: int, v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for i in range(lo, hi):
        v = _fori_body(torch.tensor(i), v)
    return v


def test_eager_while_matches_reference() -> None:
    x = torch.randn(5)
    out = while_loop(_cond, _body, (torch.tensor(0), x))
    ref = while_loop_reference(_cond, _body, (torch.tensor(0), x))
    assert int(out[0]) == int(ref[0]) > 0 and torch.allclose(out[1], ref[1])


def test_eager_zero_iterations() -> None:
    x = torch.full((3,), 1000.0)
    out = while_loop(_cond, _body, (torch.tensor(0), x))
    assert int(out[0]) == 0 and torch.equal(out[1], x)


def test_eager_autograd() -> None:
    x = torch.randn(4, requires_grad=True)
    _, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, torch.sin(y) * 2), (torch.tensor(0), x))
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = x2
    for _ in range(3):
        y2 = torch.sin(y2) * 2
    y2.sum().backward()
    assert torch.allclose(x.grad, x2.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("lo,hi", [(0, 5), (2, 3), (4, 4), (5, 1), (-2, 3)])
def test_eager_fori(lo: int, hi: int) -> None:
    v = {"acc": torch.zeros(3), "w": torch.ones(3)}
    for bounds in [(lo, hi), (torch.tensor(lo), torch.tensor(hi))]:
        out = fori_loop(bounds[0], bounds[1], _fori_body, v)
        ref = _fori_ref(lo, hi, v)
        assert torch.allclose(out["acc"], ref["acc"]) and torch.allclose(out["w"], ref["w"])


def test_errors() -> None:
    x = torch.randn(3)
    with pytest.raises(LoopError, match=r"carry leaf 1 .*\(3,\).*\(6,\)"):
        while_loop(lambda i, x: i < 2, lambda i, x: (i + 1, torch.cat([x, x])), (torch.tensor(0), x))
    with pytest.raises(LoopError, match="structure"):
        while_loop(lambda i, x: i < 2, lambda i, x: (i + 1,), (torch.tensor(0), x))
    with pytest.raises(LoopError, match="bool"):
        while_loop(lambda i, x: x, lambda i, x: (i + 1, x), (torch.tensor(0), x))
    with pytest.raises(TypeError, match="carried leaf 1 is a str"):
        while_loop(_cond, _body, (torch.tensor(0), "x"))
    with pytest.raises(TypeError, match="upper"):
        fori_loop(0, 2.5, _fori_body, {"acc": x, "w": x})  # type: ignore[arg-type]
    with pytest.raises(LoopError, match="i=0"):
        fori_loop(0, 3, lambda i, v: v.double(), x)


def _fori_fn(n: torch.Tensor, acc: torch.Tensor, w: torch.Tensor) -> Any:
    return fori_loop(0, n, _fori_body, {"acc": acc, "w": w})


def test_compiled_data_dependent_trip_count_one_graph() -> None:
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(_fori_fn, fullgraph=True, backend=counter)
    acc, w = torch.zeros(3), torch.ones(3)
    for n in [0, 1, 4, 7]:
        out = f(torch.tensor(n), acc, w)
        ref = _fori_ref(0, n, {"acc": acc, "w": w})
        assert torch.allclose(out["acc"], ref["acc"]) and torch.allclose(out["w"], ref["w"])
    assert counter.frame_count == 1
    wl = torch.compile(lambda x: while_loop(_cond, _body, (torch.tensor(0), x)), fullgraph=True, backend="eager")
    x = torch.randn(5)
    out, ref = wl(x), while_loop_reference(_cond, _body, (torch.tensor(0), x))
    assert int(out[0]) == int(ref[0]) and torch.allclose(out[1], ref[1])


class _Mod(torch.nn.Module):
    def forward(self, n: torch.Tensor, acc: torch.Tensor, w: torch.Tensor) -> Any:
        return _fori_fn(n, acc, w)


@pytest.mark.parametrize("strict", [True, False])
def test_export_save_load(strict: bool) -> None:
    acc, w = torch.zeros(3), torch.ones(3)
    ep = torch.export.export(_Mod(), (torch.tensor(3), acc, w), strict=strict)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for n in [0, 2, 6]:
        ref = _fori_ref(0, n, {"acc": acc, "w": w})
        out = loaded.module()(torch.tensor(n), acc, w)
        assert torch.allclose(out["acc"], ref["acc"]) and torch.allclose(out["w"], ref["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture of while_loop needs a GPU (none here)")
def test_cuda_graph_while_loop() -> None:  # pragma: no cover - GPU only
    f = torch.compile(_fori_fn, fullgraph=True, mode="reduce-overhead")
    acc, w = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
    for n in [3, 5, 5, 5]:
        out = f(torch.tensor(n, device="cuda"), acc, w)
        ref = _fori_ref(0, n, {"acc": acc.cpu(), "w": w.cpu()})
        assert torch.allclose(out["acc"].cpu(), ref["acc"])
