"""``@dynamic_spec``: one shape declaration, checked at every call and honoured by compile, export and make_fx.

The vocabulary is torch's own (``torch.fx.experimental.dynamic_spec``, present since torch 2.13): ``ShapeVar(name,
min=, max=)``, ``IntVar``, ``TensorSpec([...])``, ``STATIC`` (= ``None``), ``ParamsSpec({...})``,
``ShapesSpec(params, assumptions=[...])``, plus ``DictSpec`` / ``SeqSpec`` / ``ObjectSpec`` for nested arguments.
torch 2.13 has these classes but no decorator; torchnext adds the decorator and the three entry points in
:mod:`torchnext.control.compile`.

Meaning of a spec, checked by :meth:`CompiledSpec.check` (plain Python, no tracing)::

    for every TensorSpec leaf at argument path p:  value(p).dim() == len(spec)
        dim d spec None      -> any size (STATIC: the compiled code specialises on it)
        dim d spec int k     -> size == k
        dim d spec ShapeVar V-> min(V) <= size <= max(V); every use of V sees the same size
        dim d spec expr e(V) -> size == e(V) (V solved from this dim when e is linear and V is not bound elsewhere)
    for every IntVar leaf on a scalar argument: the same rules on the int value
    every assumption (a SymBool over the variables) holds

A violation raises :class:`ShapeSpecError` naming the function, the argument path, the dim, what was declared and
the actual value. The importing of torch's vocabulary (sympy, ~0.7 s) is deferred until a spec is used.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from torchnext.control._spec import CompiledSpec, ShapeSpecError, SpecConflictError
from torchnext.control._tracing import is_tracing

__all__ = [
    "dynamic_spec",
    "ShapeSpecError",
    "SpecConflictError",
    "CompiledSpec",
    "get_spec",
    "VOCABULARY",
]

F = TypeVar("F")

#: Names re-exported from torch.fx.experimental.dynamic_spec (loaded lazily, see ``__getattr__``).
VOCABULARY = (
    "ShapeVar",
    "IntVar",
    "TensorSpec",
    "STATIC",
    "ParamsSpec",
    "ShapesSpec",
    "DictSpec",
    "SeqSpec",
    "ObjectSpec",
)

_SPEC_ATTR = "__torchnext_dynamic_spec__"


def __getattr__(name: str) -> Any:
    if name in VOCABULARY:
        from torch.fx.experimental import dynamic_spec as tds

        return getattr(tds, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------------------------
# Binding arguments and the decorator
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SpecBinding:
    """What the decorator attaches: the compiled spec, the undecorated callable and how to bind its arguments."""

    spec: Any
    compiled: CompiledSpec
    fn: Callable[..., Any]
    signature: inspect.Signature
    skip_self: bool

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map a call's arguments to parameter names (``*args`` / ``**kwargs`` for the variadic slots)."""
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ShapeSpecError(
                self.compiled.function, "<call>", None, str(self.signature), f"a call that does not bind: {e}"
            ) from None
        ba.apply_defaults()
        out: dict[str, Any] = {}
        for name, value in ba.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                out["*args"] = value
            elif kind is inspect.Parameter.VAR_KEYWORD:
                out["**kwargs"] = value
            else:
                out[name] = value
        return out


def get_spec(obj: Any) -> SpecBinding | None:
    """The SpecBinding attached by :func:`dynamic_spec` to a function, method, module instance or module class."""
    for cand in (obj, getattr(obj, "forward", None), getattr(getattr(obj, "forward", None), "__func__", None)):
        b = getattr(cand, _SPEC_ATTR, None)
        if isinstance(b, SpecBinding):
            return b
    return None


def dynamic_spec(spec: Any) -> Callable[[F], F]:
    """Declare which shapes of a function's (or a module forward's) arguments are dynamic, and their ranges.

    Semantics: calling the decorated object checks its arguments against ``spec`` (see the module docstring) and
    raises :class:`ShapeSpecError` on a violation, then calls the original. :func:`torchnext.compile`,
    :func:`torchnext.export` and :func:`torchnext.make_fx` read the same declaration: one compiled frame for all
    in-range sizes, export ``Dim``s with the declared ranges (divisibility assumptions as derived dims, other
    assumptions as runtime assertions), and a make_fx graph whose module checks the spec on every call.

    Args:
        spec: a ``ShapesSpec`` (or a ``ParamsSpec`` / a dict, wrapped into one) keyed by parameter names
            (``self`` excluded for methods); ``"*args"`` / ``"**kwargs"`` describe variadic parameters.

    Applies to a function, a method (``forward``), an ``nn.Module`` class (its ``forward`` is wrapped) or an
    ``nn.Module`` instance (its bound ``forward`` is wrapped; the instance is returned).

    Example::

        B = ShapeVar("B", min=2, max=64)

        @dynamic_spec(ShapesSpec({"x": TensorSpec([B, 16])}, assumptions=[B % 2 == 0]))
        def f(x): return x.sum(0)
    """
    probe = CompiledSpec.build(spec, "<spec>")  # validate eagerly, at decoration time
    del probe

    def decorate(obj: F) -> F:
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            obj.forward = decorate(obj.forward)
            return obj
        if isinstance(obj, torch.nn.Module):
            obj.forward = decorate(obj.forward)
            return obj
        if not callable(obj):
            raise TypeError(f"dynamic_spec: cannot decorate {type(obj).__name__}")
        fn: Callable[..., Any] = obj
        sig = inspect.signature(fn)
        params = list(sig.parameters)
        skip_self = bool(params) and params[0] == "self" and not inspect.ismethod(fn)
        name = getattr(fn, "__qualname__", repr(fn))
        binding = SpecBinding(spec, CompiledSpec.build(spec, name), fn, sig, skip_self)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = binding.bind(args, kwargs)
            if binding.skip_self:
                bound.pop("self", None)
            if is_tracing():
                binding.compiled.trace_checks(bound)
            else:
                binding.compiled.check(bound)
            return fn(*args, **kwargs)

        # torch 2.14's own decorator (torch.fx.experimental.dynamic_spec.dynamic_spec) is deliberately not applied
        # on top: measured with torch 2.14.1, it makes torch.export reject the dynamic_shapes our entry points pass
        # ("Both `@dynamic_spec(...)` is attached ... AND a `dynamic_shapes=` argument was passed"), and its
        # translation refuses specs whose IntVars appear only in expressions or assumptions, which ours checks.
        # One code path on 2.13 and 2.14: torchnext's wrapper and entry points.
        setattr(wrapper, _SPEC_ATTR, binding)
        return wrapper  # type: ignore[return-value]

    return decorate
