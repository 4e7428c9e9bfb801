"""Complex -> real decomposition: op coverage against eager complex, only real dtypes reach the backend,
unsupported ops fail at compile time naming the op, Inductor end to end (a*b + a, DFT as matmul)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchnext
from torchnext.control import ComplexDecompositionError, complex_backend
from torchnext.control.complex import supported_ops

torch.manual_seed(0)


class _Recorder:
    """An inner backend that records every dtype it is shown, then runs the graph eagerly."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                self.dtypes.add(x.dtype)
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(t, torch.Tensor):
                    self.dtypes.add(t.dtype)
        return gm.forward


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().clamp_min(1e-30)
    return float((out - ref).abs().max() / scale)


def _c(*shape: int, dtype: torch.dtype = torch.complex64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


R = torch.rand(3, 4) + 0.1
OPS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "a*b+a": (lambda a, b: a * b + a, (_c(3, 4), _c(3, 4))),
    "add_sub_scalar": (lambda a, b: a + b - 2.5 + (1 - 2j) - b * 0.5, (_c(3, 4), _c(3, 4))),
    "mul_real_tensor": (lambda a, r: a * r + r, (_c(3, 4), R)),
    "div": (lambda a, b: a / (b + 3) + a / 2 + 1 / (a + 3j), (_c(3, 4), _c(3, 4))),
    "neg_conj": (lambda a: -a.conj() + torch.conj_physical(a), (_c(3, 4),)),
    "abs_angle": (lambda a: torch.abs(a) + torch.angle(a), (_c(3, 4),)),
    "exp_log_sqrt": (lambda a: torch.exp(a) + torch.log(a) + torch.sqrt(a), (_c(3, 4),)),
    "polar": (lambda r, t: torch.polar(r, t), (R, torch.randn(3, 4))),
    "view_as_real_complex": (
        lambda a, r: torch.view_as_real(a * 2) + torch.view_as_complex(torch.stack([r, -r], -1)).real[..., None],
        (_c(3, 4), R),
    ),
    "real_imag_complex": (lambda a: torch.complex(a.imag, a.real) * 1j, (_c(3, 4),)),
    "sum_mean": (lambda a: a.sum() + a.mean(0).sum() + a.sum(1, keepdim=True).mean(), (_c(3, 4),)),
    "matmul": (lambda a, b: a @ b.mT + torch.matmul(a.unsqueeze(0), b.mT.unsqueeze(0))[0], (_c(3, 4), _c(5, 4))),
    "einsum": (
        lambda a, b: torch.einsum("ij,kj->ik", a, b) + torch.einsum("bij,bjk->bik", a[None], b.mT[None])[0],
        (_c(3, 4), _c(5, 4)),
    ),
    "shapes_cat": (
        lambda a: (
            torch.cat([a.t().reshape(2, 6), a.flip(0).reshape(2, 6).roll(1, 1)], 0)[:, 1:]
            .unsqueeze(0)
            .expand(2, 4, 5)
            .permute(2, 0, 1)
            .squeeze()
        ),
        (_c(3, 4),),
    ),
    "stack_select": (lambda a, b: torch.stack([a[1], b[:, 0].repeat(2)[:4]], 1).select(1, 0) * 2, (_c(3, 4), _c(2, 4))),
    "complex128": (
        lambda a, b: torch.sqrt(a * b + a) / (b.abs() + 1),
        (_c(3, 4, dtype=torch.complex128), _c(3, 4, dtype=torch.complex128)),
    ),
    "constants": (
        lambda a: a + torch.full((4,), 1 + 2j) + torch.zeros(3, 4, dtype=torch.complex64) + torch.ones_like(a),
        (_c(3, 4),),
    ),
    "to_complex": (lambda r, a: r.to(torch.complex64) * a, (R, _c(3, 4))),
    "sin_cos_tanh": (lambda a: torch.sin(a) + torch.cos(a) * 0.5 + torch.tanh(a), (_c(3, 4),)),
    "sgn_square_pow": (lambda a: torch.sgn(a) + torch.square(a) + a**3 + a**2.5 + a**0, (_c(3, 4),)),
    "where": (lambda r, a, b: torch.where(r > 0.5, a, b) + torch.where(r > 0.5, a, 0.0), (R, _c(3, 4), _c(3, 4))),
    "index_gather": (
        lambda a: a[torch.tensor([2, 0])].sum(0) + a.gather(1, torch.tensor([[1, 0]] * 3)).sum(1).repeat(2)[:4],
        (_c(3, 4),),
    ),
}


@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_eager_and_backend_sees_only_real(name: str) -> None:
    fn, args = OPS[name]
    rec = _Recorder()
    compiled = torch.compile(fn, backend=complex_backend(rec), fullgraph=True)
    out, ref = compiled(*args), fn(*args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert _rel(out, ref) < 1e-5, (name, _rel(out, ref))
    assert rec.dtypes and not any(d.is_complex for d in rec.dtypes), rec.dtypes


def test_unsupported_op_fails_at_compile_time_naming_it() -> None:
    f = torchnext.compile(lambda a: torch.asinh(a) + 1, backend="eager", decompose_complex=True)
    with pytest.raises(ComplexDecompositionError, match=r"aten\.asinh"):
        f(_c(3))
    assert "aten.mul" in " ".join(supported_ops())


def test_real_graph_passes_through() -> None:
    rec = _Recorder()
    f = torch.compile(lambda x: x * 2, backend=complex_backend(rec))
    x = torch.randn(3)
    assert torch.equal(f(x), x * 2) and rec.dtypes == {torch.float32}


def test_autograd_through_decomposed_graph() -> None:
    a = _c(3, 4, dtype=torch.complex128).requires_grad_(True)
    b = _c(3, 4, dtype=torch.complex128)
    f = lambda a, b: (a * b + a).abs().sum()  # noqa: E731
    torch.compile(f, backend=complex_backend("aot_eager"))(a, b).backward()
    g = a.grad.clone()  # type: ignore[union-attr]
    a.grad = None
    f(a, b).backward()
    assert torch.allclose(g, a.grad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ Inductor


def dft_program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Signal processing: DFT as a complex matmul, a complex filter, inverse DFT, magnitude."""
    n = x.shape[-1]
    k = torch.arange(n, dtype=torch.float32)
    F = torch.polar(torch.ones(n, n), -2 * math.pi * k[:, None] * k[None, :] / n)
    X = x.to(torch.complex64) @ F.mT
    Y = X * w + X
    y = (Y @ F.conj()) / n
    return y.abs() + y.real


def test_inductor_end_to_end() -> None:
    f = torchnext.compile(lambda a, b: a * b + a, decompose_complex=True, fullgraph=True)
    a, b = _c(64), _c(64)
    assert _rel(f(a, b), a * b + a) < 1e-5
    g = torchnext.compile(dft_program, decompose_complex=True, fullgraph=True)
    x, w = torch.randn(8, 32), _c(32)
    assert _rel(g(x, w), dft_program(x, w)) < 1e-5
    torch.testing.assert_close(
        torch.fft.ifft(torch.fft.fft(x) * (w + 1)).abs() + torch.fft.ifft(torch.fft.fft(x) * (w + 1)).real,
        g(x, w), rtol=1e-4, atol=1e-4,
    )  # fmt: skip
