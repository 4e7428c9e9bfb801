"""Complex -> real decomposition: compile complex64/complex128 programs with only real dtypes reaching the backend.

Design
------
``complex_backend(inner)`` is a ``torch.compile`` backend. For the graph TorchDynamo hands it:

1. the graph is traced to ATen ops (``make_fx`` on the fake example inputs);
2. every complex input is replaced by its ``view_as_real`` (a real tensor with a trailing dim of 2, zero-copy), and
   the ATen graph is re-executed by an interpreter in which each complex value is a :class:`Pair` of real tensors
   ``(re, im)``; every ATen op that touches a complex value is looked up in a registry (op -> real implementation,
   the ``@register`` table below) and the whole run is traced again with ``make_fx``, giving an ATen graph that has
   only real dtypes;
3. that graph is compiled by ``inner`` (Inductor by default);
4. at run time complex arguments go in as ``view_as_real`` and complex results come back as ``view_as_complex`` of
   a contiguous ``(..., 2)`` real tensor -- views, no copies.

An ATen op that touches a complex value and has no registered implementation fails at compile time with
:class:`ComplexDecompositionError` naming the op -- never a silently wrong result. A graph without complex values is
passed to ``inner`` untouched.

Covered: ``+ - * /`` (tensor and scalar, complex Python scalars too), neg, conj, abs, angle, exp, log, sqrt,
sin, cos, tanh, sgn, square, pow, where, reciprocal, polar, view_as_real, view_as_complex, real/imag, complex(), sum, mean, mm/bmm/matmul/einsum (via
mm/bmm), addmm, dtype conversions, complex constants (full/zeros/ones/scalar_tensor) and the shape ops
(view/reshape/permute/transpose/expand/unsqueeze/squeeze/select/slice/cat/stack/clone/...).

torch 2.13 also has ``torch._functorch.config.enable_complex_wrapper``; torchnext does not use it (per
REFERENCE.md, Inductor then fails on ``a*b + a``), the path here is self-contained.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from torchnext.control._complex_ops import (
    COMPLEX_OF,
    ComplexDecompositionError,
    Pair,
    lookup,
    register,
    supported_ops,
)
from torchnext.control._complex_ops import _view_as_complex_impl as _pair_of_real_view
from torchnext.control._tracing import require_compile

__all__ = [
    "complex_backend",
    "ComplexDecompositionError",
    "Pair",
    "register",
    "decompose_complex_graph",
    "supported_ops",
]

# ---------------------------------------------------------------------------------------------------------------
# graph rewrite
# ---------------------------------------------------------------------------------------------------------------


def _is_complex_val(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


class _PairInterpreter(torch.fx.Interpreter):
    """Runs an ATen graph with complex values held as Pairs, dispatching complex ops through the registry."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self._node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        v = super().get_attr(target, args, kwargs)
        if _is_complex_val(v):
            return Pair(torch.view_as_real(v)[..., 0].clone(), torch.view_as_real(v)[..., 1].clone())
        return v

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        leaves = tree_flatten((args, kwargs))[0]
        touches = any(isinstance(x, (Pair, complex)) for x in leaves)
        val = self._node.meta.get("val") if self._node is not None else None
        produces = any(_is_complex_val(v) for v in tree_flatten(val)[0])
        if target is operator.getitem:
            return args[0][args[1]]
        if not (touches or produces):
            return target(*args, **kwargs)
        impl = lookup(target)
        if impl is None:
            raise ComplexDecompositionError(
                f"complex decomposition: no real implementation for {target} (it touches a complex value); "
                f"supported ops: see torchnext.control.complex.supported_ops()"
            )
        return impl(*args, **kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:  # pragma: no cover - ATen graphs have none
        raise ComplexDecompositionError(f"complex decomposition: unexpected method call {target}")


@dataclass
class _Rewritten:
    gm: torch.fx.GraphModule
    complex_in: list[bool]
    complex_out: list[Any]  # dtype of each complex output, None for real ones


def decompose_complex_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> _Rewritten | None:
    """Trace ``gm`` to ATen and rewrite it to real dtypes; None when nothing in it is complex."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(list(example_inputs)) or FakeTensorMode(allow_non_fake_inputs=True)

    def fakeify(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and fake_mode.from_tensor is not None and not _is_fake(x):
            return fake_mode.from_tensor(x)
        return x

    inputs = [fakeify(x) for x in example_inputs]
    with fake_mode:
        aten_gm = make_fx(gm, tracing_mode="real")(*inputs)
    has_complex = any(
        _is_complex_val(v) for n in aten_gm.graph.nodes for v in tree_flatten(n.meta.get("val"))[0]
    ) or any(_is_complex_val(getattr(aten_gm, n.target)) for n in aten_gm.graph.nodes if n.op == "get_attr")
    if not has_complex:
        return None
    complex_in = [_is_complex_val(x) for x in inputs]
    complex_out: list[Any] = []

    def real_fn(*real_args: Any) -> Any:
        args = [_pair_of_real_view(a) if cx else a for a, cx in zip(real_args, complex_in, strict=True)]
        outs = _PairInterpreter(aten_gm).run(*args)
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        complex_out.clear()
        res = []
        for o in flat:
            if isinstance(o, Pair):
                complex_out.append(COMPLEX_OF[o.re.dtype])
                res.append(torch.stack([o.re, o.im], dim=-1))
            else:
                complex_out.append(None)
                res.append(o)
        return tuple(res)

    real_inputs = [torch.view_as_real(x) if cx else x for x, cx in zip(inputs, complex_in, strict=True)]
    with fake_mode:
        real_gm = make_fx(real_fn, tracing_mode="real")(*real_inputs)
    for n in real_gm.graph.nodes:
        for v in tree_flatten(n.meta.get("val"))[0]:
            if _is_complex_val(v):
                raise ComplexDecompositionError(f"complex decomposition left a complex value at {n.format_node()}")
    return _Rewritten(real_gm, complex_in, list(complex_out))


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def complex_backend(inner: str | Callable[..., Any] = "inductor") -> Callable[..., Any]:
    """A ``torch.compile`` backend: decompose complex values into real pairs, then compile with ``inner``.

    Semantics: ``torch.compile(fn, backend=complex_backend())(*args) == fn(*args)`` (within floating-point
    rounding, ~1e-6 relative in complex64) with no complex dtype reaching ``inner``.

    Raises:
        CompileUnsupportedError: torch.compile cannot run on this interpreter.
        ComplexDecompositionError: (at compile time) an op touching a complex value has no implementation.

    Example::

        f = torch.compile(lambda a, b: a * b + a, backend=complex_backend("inductor"))
    """
    require_compile("torchnext.control.complex_backend")
    inner_fn = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        rw = decompose_complex_graph(gm, example_inputs)
        if rw is None:
            return inner_fn(gm, example_inputs)
        real_examples = [
            torch.view_as_real(x) if cx else x for x, cx in zip(example_inputs, rw.complex_in, strict=True)
        ]
        compiled = inner_fn(rw.gm, real_examples)
        complex_in, complex_out = rw.complex_in, rw.complex_out

        def run(*args: Any) -> Any:
            real_args = [torch.view_as_real(a) if cx else a for a, cx in zip(args, complex_in, strict=True)]
            outs = compiled(*real_args)  # Dynamo's calling convention for a backend's result
            res = []
            for o, cdt in zip(outs, complex_out, strict=True):
                if cdt is None:
                    res.append(o)
                else:
                    res.append(torch.view_as_complex(o if o.stride(-1) == 1 and o.is_contiguous() else o.contiguous()))
            return tuple(res)

        run.real_graph = rw.gm  # type: ignore[attr-defined]
        return run

    return backend
