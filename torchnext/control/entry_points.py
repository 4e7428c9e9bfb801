"""Entry points that honour ``@dynamic_spec`` (and complex decomposition): ``compile``, ``export``, ``make_fx``.

* :func:`compile` -- ``torch.compile`` of the undecorated callable behind a small traced prologue that
  ``torch._check``s the spec's ranges, derived dims and assumptions on the symbolic sizes; each call is checked
  against the spec first (``ShapeSpecError``), the declared dims are marked dynamic and the others static, so every
  in-range size runs the same compiled frame. ``backed_size_oblivious`` is enabled while compiling so ranges that
  include 0 and 1 do not force 0/1 specialisation.
* :func:`export` -- ``torch.export.export`` with ``dynamic_shapes`` built from the spec: one ``Dim`` per variable
  with its range; ``V % k == 0`` assumptions become derived dims (``k * Dim``), expressions such as ``2 * V + 1``
  derived dims, and every other assumption a ``torch._check`` traced into the program (a runtime assertion that
  survives save/load). The example arguments are checked first; ``ep.module()`` of the returned program checks
  the spec on every call (``ShapeSpecError``).
* :func:`make_fx` -- symbolic ``make_fx`` with the spec's ranges and assumptions as ``torch._check``s and STATIC
  dims specialised to the example; the returned GraphModule checks the spec on every call.

Every API that needs TorchDynamo raises :class:`~torchnext.control.CompileUnsupportedError` (a RuntimeError) where
torch.compile is unsupported (Python 3.15+), never a silent eager fallback.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from torchnext.control._spec import CompiledSpec, ShapeSpecError, SpecConflictError, path_str
from torchnext.control._tracing import require_compile
from torchnext.control.dynamic_spec import SpecBinding, get_spec

__all__ = ["compile", "export", "make_fx"]


def _target(obj: Any, binding: SpecBinding) -> Callable[..., Any]:
    """The undecorated callable behind a decorated function / module (bound to the module when needed)."""
    if binding.skip_self:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("a decorated method must be used through its module instance")
        return types.MethodType(binding.fn, obj)
    return binding.fn


def _bind(obj: Any, binding: SpecBinding, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = binding.bind((obj, *args) if binding.skip_self else args, kwargs)
    if binding.skip_self:
        bound.pop("self", None)
    return bound


def _mark(cs: CompiledSpec, bound: dict[str, Any]) -> None:
    """Mark declared dims dynamic and the others static before Dynamo sees the tensors.

    ``maybe_mark_dynamic`` (not ``mark_dynamic(min, max)``): the ranges, derived dims and assumptions reach the
    shape environment as ``torch._check``s traced from :meth:`CompiledSpec.trace_checks`, and a relation between
    two strictly marked dims (``y.shape[0] == 2 * x.shape[0]``, ``B % 2 == 0``) would be reported by Dynamo as a
    constraint violation. Values outside the spec never reach the compiled code: :meth:`CompiledSpec.check` runs
    first on every call.
    """
    from torch._dynamo.decorators import mark_static, maybe_mark_dynamic

    for slot in cs.dims:
        if slot.dim is None:
            continue
        t = cs.get(bound, slot.path)
        if slot.kind in ("var", "expr"):
            maybe_mark_dynamic(t, slot.dim)
        else:
            mark_static(t, slot.dim)


def compile(
    fn: Any,
    *,
    backend: str | Callable[..., Any] = "inductor",
    fullgraph: bool = False,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    decompose_complex: bool = False,
) -> Callable[..., Any]:
    """``torch.compile`` that honours ``@dynamic_spec`` and can decompose complex programs into real ones.

    Semantics: ``torchnext.compile(fn)(*args)`` returns ``fn(*args)``; with a spec the arguments are checked first
    (:class:`ShapeSpecError`) and all sizes inside the declared ranges share one compiled frame.

    Args:
        fn: a function or an ``nn.Module`` (decorated with :func:`dynamic_spec` or not).
        backend, fullgraph, mode, options: as ``torch.compile``.
        dynamic: as ``torch.compile``; giving it for a decorated ``fn`` raises :class:`SpecConflictError`.
        decompose_complex: rewrite complex tensors into real pairs before ``backend`` sees the graph
            (see :mod:`torchnext.control.complex`); unsupported complex ops fail at compile time naming the op.

    Raises:
        CompileUnsupportedError: torch.compile cannot run on this interpreter (e.g. Python 3.15).
        SpecConflictError: a decorated ``fn`` was also given ``dynamic=``.
    """
    require_compile("torchnext.compile")
    binding = get_spec(fn)
    if binding is not None and dynamic is not None:
        raise SpecConflictError(
            f"torchnext.compile: {binding.compiled.function} carries a @dynamic_spec; do not also pass dynamic={dynamic}"
        )
    if decompose_complex:
        from torchnext.control.complex import complex_backend

        backend = complex_backend(backend)
    kw: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        kw["mode"] = mode
    if options is not None:
        kw["options"] = options
    if binding is None:
        plain = torch.compile(fn, **kw)
        return _unwrap_backend_errors(plain) if decompose_complex else plain
    target = _target(fn, binding)
    cs = binding.compiled

    def checked(bound: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Traced by Dynamo: torch._check of the spec's relations (derived dims, assumptions) on symbolic sizes.
        cs.trace_checks(bound)
        return target(*args, **kwargs)

    compiled = torch.compile(checked, **kw)

    @functools.wraps(binding.fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = _bind(fn, binding, args, kwargs)
        cs.check(bound)
        _mark(cs, bound)
        from torch.fx.experimental import _config as fx_config  # a config module: .patch is added at import

        with fx_config.patch(  # type: ignore[attr-defined]
            backed_size_oblivious=True
        ):
            return compiled(bound, args, kwargs)

    call.compiled = compiled  # type: ignore[attr-defined]
    return _unwrap_backend_errors(call) if decompose_complex else call


def _unwrap_backend_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Re-raise a ComplexDecompositionError that Dynamo wrapped into BackendCompilerFailed, so callers see ours."""
    from torch._dynamo.exc import BackendCompilerFailed

    from torchnext.control.complex import ComplexDecompositionError

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, ComplexDecompositionError):
                raise inner from None
            raise

    return call


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------


def _divisors(cs: CompiledSpec) -> dict[int, int]:
    """Variables with an assumption ``V % k == 0`` -> k (export expresses these as derived dims ``k * Dim``)."""
    import math

    import sympy
    from torch.utils._sympy.functions import Mod, PythonMod

    out: dict[int, int] = {}
    for e in cs.assumptions:
        expr = e.sympy_expr
        if isinstance(expr, sympy.Eq):
            lhs, rhs = expr.args
            if rhs == 0 and isinstance(lhs, (Mod, PythonMod, sympy.Mod)):
                v, k = lhs.args
                if isinstance(v, sympy.Symbol) and k.is_Integer and int(k) > 0:
                    i = cs._index[v]
                    out[i] = math.lcm(out.get(i, 1), int(k))
    return out


def _dims_for(cs: CompiledSpec) -> dict[int, Any]:
    """One torch.export Dim (or derived dim ``k * Dim`` for a divisibility assumption) per spec variable."""
    from torch.export import Dim

    div = _divisors(cs)
    dims: dict[int, Any] = {}
    used: set[str] = set()
    for var in cs.variables:
        lo = 0 if var.lo is None else max(var.lo, 0)
        name = "".join(c if c.isalnum() else "_" for c in var.name) or "v"
        if not name[0].isalpha():
            name = f"v_{name}"
        while name in used:  # two variables may share a display name; export Dims need distinct ones
            name += "_"
        used.add(name)
        k = div.get(var.idx)
        if k is None:
            dims[var.idx] = Dim(name, min=lo, max=var.hi) if var.hi is not None else Dim(name, min=lo)
        else:
            root_name = f"_{name}_div{k}"
            root = (
                Dim(root_name, min=-(-lo // k), max=var.hi // k)
                if var.hi is not None
                else Dim(root_name, min=-(-lo // k))
            )
            dims[var.idx] = k * root
    return dims


def _dynamic_shapes(cs: CompiledSpec, bound: dict[str, Any]) -> dict[str, Any]:
    from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path, tree_unflatten

    dims = _dims_for(cs)
    per_path: dict[tuple[tuple[str, Any], ...], dict[int, Any]] = {}
    for slot in cs.dims:
        if slot.dim is None:
            continue  # int arguments stay static under torch.export
        if slot.kind == "var":
            per_path.setdefault(slot.path, {})[slot.dim] = dims[slot.value.idx]
        elif slot.kind == "expr":
            e = slot.value
            if e.linear is None:
                raise ShapeSpecError(
                    cs.function, path_str(slot.path), slot.dim,
                    f"{e.text} (torch.export only expresses derived dims of the form a*V + b)", "unsupported by export",
                )  # fmt: skip
            i, a, c = e.linear
            per_path.setdefault(slot.path, {})[slot.dim] = a * dims[i] + c if c else a * dims[i]
    out: dict[str, Any] = {}
    for name, value in bound.items():
        flat, treespec = tree_flatten_with_path(value)
        leaves = []
        for keypath, _leaf in flat:
            path: list[tuple[str, Any]] = [("arg", name)]
            for k in keypath:
                if isinstance(k, MappingKey):
                    path.append(("key", k.key))
                elif isinstance(k, SequenceKey):
                    path.append(("index", k.idx))
                elif isinstance(k, GetAttrKey):
                    path.append(("attr", k.name))
            leaves.append(per_path.get(tuple(path)))
        out[name] = tree_unflatten(leaves, treespec)
    return out


class _FunctionModule(torch.nn.Module):
    """Lets ``export`` take a plain (decorated) function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.forward = fn


def _check_hook(binding: SpecBinding, owner: Any) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        binding.compiled.check(_bind(owner, binding, args, kwargs))

    return hook


def export(
    mod: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` whose ``dynamic_shapes`` come from the module's (or function's) ``@dynamic_spec``.

    Semantics: the returned program computes ``mod(*args)`` for every input shape the spec allows. The example
    ``args`` are checked against the spec first (:class:`ShapeSpecError`); ``ep.module()`` of the returned program
    checks every call. A program saved and loaded again keeps torch's own checks (ranges and the non-divisibility
    assumptions, as runtime assertions).

    Raises:
        SpecConflictError: both a spec and ``dynamic_shapes`` were given.
        ShapeSpecError: the example arguments violate the spec.
        CompileUnsupportedError: ``strict=True`` where TorchDynamo cannot run.
    """
    if strict:
        require_compile("torchnext.export(strict=True)")
    kwargs = dict(kwargs or {})
    binding = get_spec(mod)
    if binding is None:
        target = mod if isinstance(mod, torch.nn.Module) else _FunctionModule(mod)
        return torch.export.export(target, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    if dynamic_shapes is not None:
        raise SpecConflictError(
            f"torchnext.export: {binding.compiled.function} carries a @dynamic_spec; do not also pass dynamic_shapes"
        )
    bound = _bind(mod, binding, tuple(args), kwargs)
    binding.compiled.check(bound)
    ds = _dynamic_shapes(binding.compiled, bound)
    target = mod if isinstance(mod, torch.nn.Module) else _FunctionModule(mod)
    ep = torch.export.export(target, tuple(args), kwargs, dynamic_shapes=ds, strict=strict)
    plain_module = ep.module

    def module_with_spec_check(*a: Any, **k: Any) -> torch.nn.Module:
        gm = plain_module(*a, **k)
        gm.register_forward_pre_hook(_check_hook(binding, mod), with_kwargs=True)
        return gm

    ep.module = module_with_spec_check  # type: ignore[method-assign,assignment]
    return ep


# ---------------------------------------------------------------------------------------------------------------
# make_fx
# ---------------------------------------------------------------------------------------------------------------


def make_fx(fn: Any, *, tracing_mode: str | None = None, **kwargs: Any) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx`` that honours ``@dynamic_spec``: ``make_fx(fn)(*args)`` -> a GraphModule.

    Without a spec this is ``torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode or "real")``. With one, the
    trace is symbolic; declared ranges, derived dims and assumptions are ``torch._check``ed, STATIC dims specialise
    to the example, and the GraphModule checks every call against the spec and the traced static sizes
    (:class:`ShapeSpecError`).
    """
    from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx

    binding = get_spec(fn)
    if binding is None:
        return torch_make_fx(fn, tracing_mode=tracing_mode or "real", **kwargs)  # type: ignore[arg-type]
    if tracing_mode not in (None, "symbolic"):
        raise SpecConflictError(
            f"torchnext.make_fx: a @dynamic_spec function traces symbolically, not {tracing_mode!r}"
        )
    target = _target(fn, binding)
    cs = binding.compiled

    def tracer(*args: Any) -> torch.fx.GraphModule:
        bound = _bind(fn, binding, args, {})
        cs.check(bound)
        static = {
            (slot.path, slot.dim): int(cs.size(bound, slot))
            for slot in cs.dims
            if slot.kind == "static" and slot.dim is not None
        }

        def traced(*a: Any) -> Any:
            cs.trace_checks(_bind(fn, binding, a, {}), specialize_static=True)
            return target(*a)

        from torch.fx.experimental import _config as fx_config  # a config module: .patch is added at import

        # No duck sizing: a declared dim that happens to equal a static one must not be merged with it.
        with fx_config.patch(  # type: ignore[attr-defined]
            use_duck_shape=False
        ):
            # closed-over tensors (a module's parameters) become graph constants
            opts = {"_allow_non_fake_inputs": True, **kwargs}
            gm = torch_make_fx(traced, tracing_mode="symbolic", **opts)(*args)

        def hook(module: torch.nn.Module, a: tuple[Any, ...]) -> None:
            b = _bind(fn, binding, a, {})
            cs.check(b)
            for (path, dim), size in static.items():
                actual = int(cs.get(b, path).shape[dim])
                if actual != size:
                    raise ShapeSpecError(cs.function, path_str(path), dim, f"STATIC (traced with {size})", actual)

        gm.register_forward_pre_hook(hook)
        return gm

    return tracer
