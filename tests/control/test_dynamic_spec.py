"""@dynamic_spec: call-time checks (every violation kind), compile (one frame for all in-range sizes), export
(ranges, derived dims, assumptions; save/load), make_fx, conflicts."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torchnext
from torchnext import STATIC, ShapeSpecError, ShapesSpec, ShapeVar, TensorSpec, dynamic_spec
from torchnext.control import SpecConflictError

B = ShapeVar("B", min=0, max=64)
T = ShapeVar("T", min=1, max=32)
SPEC = ShapesSpec({"x": TensorSpec([B, T, 4]), "y": TensorSpec([B * 2, STATIC])}, assumptions=[B % 2 == 0, T <= B + 8])


def _body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.sum(1) @ torch.ones(4, 3) + y.reshape(x.shape[0], 2 * y.shape[1]).sum(-1, keepdim=True)


f = dynamic_spec(SPEC)(_body)


class Mod(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    @dynamic_spec(SPEC)
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x.sum(1)) + y.reshape(x.shape[0], 2 * y.shape[1]).sum(-1, keepdim=True)


def mk(b: int, t: int, s: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 100 + t)
    return torch.randn(b, t, 4, generator=g), torch.randn(2 * b, s, generator=g)


# (args, argument, dim, declared-substring, actual-substring)
VIOLATIONS: list[tuple[Any, str, int | None, str, str]] = [
    (mk(5, 3), "x", None, "assumption B % 2 == 0", "B=5"),
    (mk(4, 40), "x", 1, "T in [1, 32]", "40"),
    (mk(66, 3), "x", 0, "B in [0, 64]", "66"),
    ((torch.randn(4, 3, 4), torch.randn(9, 5)), "y", 0, "2*B = 8", "9"),
    ((torch.randn(4, 3), torch.randn(8, 5)), "x", None, "rank 3", "rank 2"),
    ((torch.randn(4, 3, 5), torch.randn(8, 5)), "x", 2, "== 4", "5"),
    (mk(2, 12), "x", None, "assumption T <= 8 + B", "T=12"),
    ((torch.randn(4, 3, 4), 3.0), "y", None, "a tensor", "float"),
]


def test_eager_ok() -> None:
    for b, t in [(4, 3), (0, 1), (64, 32)]:
        x, y = mk(b, t)
        assert torch.allclose(f(x, y), _body(x, y))


@pytest.mark.parametrize("case", VIOLATIONS, ids=[c[3] for c in VIOLATIONS])
def test_eager_violations(case: Any) -> None:
    args, arg, dim, declared, actual = case
    with pytest.raises(ShapeSpecError) as ei:
        f(*args)
    e = ei.value
    assert (e.argument, e.dim) == (arg, dim), str(e)
    assert declared in str(e.declared) and actual in str(e.actual), str(e)
    assert str(e).startswith("_body:") and arg in str(e)


def test_module_forward_and_nested_specs() -> None:
    m = Mod()
    with pytest.raises(ShapeSpecError, match="B % 2 == 0"):
        m(*mk(3, 3))
    H = ShapeVar("H", min=1, max=8)
    from torchnext.control import DictSpec, SeqSpec

    @dynamic_spec(ShapesSpec({"batch": DictSpec({"ids": TensorSpec([H]), "pair": SeqSpec([TensorSpec([H, 2])])})}))
    def g(batch: dict[str, Any]) -> torch.Tensor:
        return batch["ids"] + batch["pair"][0].sum(1)

    g({"ids": torch.ones(3), "pair": [torch.ones(3, 2)]})
    with pytest.raises(
        ShapeSpecError, match=r"batch\['pair'\]\[0\] dim 0 .*H = 3 \(bound by batch\['ids'\].shape\[0\]\), got 4"
    ):
        g({"ids": torch.ones(3), "pair": [torch.ones(4, 2)]})
    with pytest.raises(ShapeSpecError, match="missing"):
        g({"ids": torch.ones(3)})


def test_spec_errors_at_decoration() -> None:
    with pytest.raises(TypeError, match="ShapesSpec"):
        dynamic_spec(3)
    with pytest.raises(TypeError, match="unsupported spec leaf"):
        dynamic_spec({"x": "nope"})


# ------------------------------------------------------------------------------------------------ compile


def test_compile_one_frame_for_all_sizes_and_violations() -> None:
    counter = CompileCounterWithBackend("eager")
    cf = torchnext.compile(f, backend=counter)
    for b, t in [(4, 3), (6, 5), (8, 1), (0, 1), (2, 2), (64, 32)]:
        x, y = mk(b, t)
        assert torch.allclose(cf(x, y), _body(x, y), atol=1e-5)
    assert counter.frame_count == 1, "an in-range size recompiled"
    for args, arg, dim, _declared, _actual in VIOLATIONS:
        with pytest.raises(ShapeSpecError) as ei:
            cf(*args)
        assert (ei.value.argument, ei.value.dim) == (arg, dim)
    assert counter.frame_count == 1


def test_compile_conflict_and_module() -> None:
    with pytest.raises(SpecConflictError, match="dynamic"):
        torchnext.compile(f, dynamic=True)
    m = Mod()
    counter = CompileCounterWithBackend("eager")
    cm = torchnext.compile(m, backend=counter)
    for b in (2, 4, 10):
        x, y = mk(b, 3)
        assert torch.allclose(cm(x, y), m(x, y), atol=1e-5)
    assert counter.frame_count == 1
    with pytest.raises(ShapeSpecError, match="B % 2"):
        cm(*mk(3, 3))


# ------------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("strict", [False, True])
def test_export_ranges_assumptions_save_load(strict: bool) -> None:
    m = Mod()
    ep = torchnext.export(m, mk(4, 3), strict=strict)
    gm = ep.module()
    for b, t in [(6, 2), (2, 10), (10, 1)]:
        x, y = mk(b, t)
        assert torch.allclose(gm(x, y), m(x, y), atol=1e-5)
    with pytest.raises(ShapeSpecError, match="B % 2 == 0"):
        gm(*mk(5, 3))
    with pytest.raises(ShapeSpecError, match="T <= 8 \\+ B"):
        gm(*mk(2, 12))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    x, y = mk(12, 7)
    assert torch.allclose(loaded(x, y), m(x, y), atol=1e-5)
    for args in (mk(5, 3), mk(2, 12), mk(66, 3)):  # torch's own runtime assertions survive save/load
        with pytest.raises(Exception, match=r"(?i)guard|expected|assert"):
            loaded(*args)


def test_export_example_violation_and_conflict() -> None:
    with pytest.raises(ShapeSpecError, match="B % 2"):
        torchnext.export(Mod(), mk(3, 3))
    with pytest.raises(SpecConflictError, match="dynamic_shapes"):
        torchnext.export(Mod(), mk(4, 3), dynamic_shapes={"x": None, "y": None})
    ep = torchnext.export(f, mk(4, 3))  # a plain decorated function
    x, y = mk(8, 2)
    assert torch.allclose(ep.module()(x, y), _body(x, y), atol=1e-5)


# ------------------------------------------------------------------------------------------------ make_fx


def test_make_fx() -> None:
    gm = torchnext.make_fx(f)(*mk(4, 3))
    for b, t in [(6, 2), (10, 9)]:
        x, y = mk(b, t)
        assert torch.allclose(gm(x, y), _body(x, y), atol=1e-5)
    with pytest.raises(ShapeSpecError, match="B % 2"):
        gm(*mk(5, 3))
    with pytest.raises(ShapeSpecError, match=r"STATIC \(traced with 5\)"):
        gm(*mk(4, 3, s=6))
    plain = torchnext.make_fx(_body)(*mk(4, 3))
    x, y = mk(4, 3)
    assert torch.allclose(plain(x, y), _body(x, y))


def test_plain_torch_compile_of_decorated_function() -> None:
    """torch 2.13 has no decorator of its own: torch.compile traces ours, checks included."""
    counter = CompileCounterWithBackend("eager")
    cf = torch.compile(f, backend=counter)
    for b in (2, 4, 6):
        x, y = mk(b, 3)
        assert torch.allclose(cf(x, y), _body(x, y), atol=1e-5)
    with pytest.raises(ShapeSpecError, match="B % 2 == 0"):
        cf(*mk(3, 3))


def test_decorated_module_instance_all_paths() -> None:
    n = ShapeVar("N", min=1, max=64)
    m = dynamic_spec(ShapesSpec({"input": TensorSpec([n, 4])}))(torch.nn.Linear(4, 2))
    x = torch.randn(7, 4)
    with pytest.raises(ShapeSpecError, match=r"input dim 1 .*== 4, got 5"):
        m(torch.randn(3, 5))
    ep = torchnext.export(m, (torch.randn(3, 4),))
    assert torch.allclose(ep.module()(x), m(x), atol=1e-6)
    with pytest.raises(ShapeSpecError, match=r"N in \[1, 64\], got 70"):
        ep.module()(torch.randn(70, 4))
    counter = CompileCounterWithBackend("eager")
    cm = torchnext.compile(m, backend=counter)
    for k in (5, 9, 33):
        xk = torch.randn(k, 4)
        assert torch.allclose(cm(xk), m(xk), atol=1e-6)
    assert counter.frame_count == 1
    gm = torchnext.make_fx(m)(torch.randn(3, 4))
    assert torch.allclose(gm(x), m(x), atol=1e-6)
