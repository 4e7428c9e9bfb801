"""A ShapesSpec flattened into checkable slots (:class:`CompiledSpec`), and the errors it raises.

Expressions from the spec (derived dims, assumptions) are compiled once into small closures over an ``env``
keyed by variable index, so the same closure evaluates plain ints (call-time checks) and SymInts (``torch._check``
while tracing, including inside TorchDynamo, which never sees a sympy object).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CompiledSpec", "ShapeSpecError", "SpecConflictError", "path_str"]

Env = dict[int, Any]
Path = tuple[tuple[str, Any], ...]  # (("arg", "x"), ("key", "a"), ("index", 0), ("attr", "w"))


class ShapeSpecError(ValueError):
    """A call violates a declared shape spec.

    Attributes: ``function``, ``argument`` (a path such as ``x`` or ``batch['ids']``), ``dim`` (None for a whole
    argument or an assumption), ``declared`` (the range, value, expression or assumption) and ``actual``.
    """

    def __init__(self, function: str, argument: str, dim: int | None, declared: str, actual: Any) -> None:
        where = f"argument {argument}" + (f" dim {dim}" if dim is not None else "")
        super().__init__(f"{function}: {where} violates the shape spec: declared {declared}, got {actual}")
        self.function, self.argument, self.dim, self.declared, self.actual = function, argument, dim, declared, actual


class SpecConflictError(ValueError):
    """A decorated function was also given call-site shape information (``dynamic_shapes=``, ``dynamic=``)."""


def path_str(path: Path) -> str:
    out = ""
    for kind, k in path:
        out += {"arg": f"{k}", "key": f"[{k!r}]", "index": f"[{k}]", "attr": f".{k}"}[kind]
    return out


# ---------------------------------------------------------------------------------------------------------------
# sympy -> closures and text
# ---------------------------------------------------------------------------------------------------------------


def _tables() -> tuple[dict[type, Callable[[Any, Any], Any]], dict[type, Callable[[Any, Any], Any]], dict[type, str]]:
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    binary: dict[type, Callable[[Any, Any], Any]] = {
        sympy.Eq: operator.eq,
        sympy.Ne: operator.ne,
        sympy.StrictGreaterThan: operator.gt,
        sympy.GreaterThan: operator.ge,
        sympy.StrictLessThan: operator.lt,
        sympy.LessThan: operator.le,
        FloorDiv: operator.floordiv,
        Mod: operator.mod,
        PythonMod: operator.mod,
        sympy.Mod: operator.mod,
        sympy.Pow: operator.pow,
    }
    variadic: dict[type, Callable[[Any, Any], Any]] = {
        sympy.Add: operator.add,
        sympy.Mul: operator.mul,
        sympy.And: operator.and_,
        sympy.Or: operator.or_,
        sympy.Max: torch.sym_max,
        sympy.Min: torch.sym_min,
    }
    text = {
        sympy.Eq: "==", sympy.Ne: "!=", sympy.StrictGreaterThan: ">", sympy.GreaterThan: ">=",
        sympy.StrictLessThan: "<", sympy.LessThan: "<=", FloorDiv: "//", Mod: "%", PythonMod: "%", sympy.Mod: "%",
        sympy.Pow: "**", sympy.Add: "+", sympy.Mul: "*", sympy.And: "and", sympy.Or: "or",
    }  # fmt: skip
    return binary, variadic, text


def expr_fn(expr: Any, index: dict[Any, int]) -> Callable[[Env], Any]:
    """Compile a sympy expression over spec variables into ``f(env)``; raises TypeError for unsupported nodes."""
    import sympy

    if isinstance(expr, sympy.Symbol):
        i = index[expr]
        return lambda env: env[i]
    if expr.is_Integer:
        v = int(expr)
        return lambda env: v
    if expr is sympy.true or expr is sympy.false:
        truth = bool(expr)
        return lambda env: truth
    args: list[Callable[[Env], Any]] = [expr_fn(a, index) for a in expr.args]
    binary, variadic, _ = _tables()
    for typ, op in binary.items():
        if isinstance(expr, typ) and len(args) == 2:
            a, b = args
            return lambda env: op(a(env), b(env))
    for typ, op in variadic.items():
        if isinstance(expr, typ):
            return lambda env: functools.reduce(op, [f(env) for f in args])
    if isinstance(expr, sympy.Not):
        (a,) = args
        return lambda env: torch.sym_not(a(env))
    raise TypeError(f"dynamic_spec: unsupported expression {expr} ({type(expr).__name__}) in a spec")


def expr_text(expr: Any) -> str:
    """Python-like text of a spec expression: ``B % 2 == 0``, ``2*B + 1``, ``T <= B + 8``."""
    import sympy

    if isinstance(expr, sympy.Symbol):
        return re.sub(r"#\d+$", "", str(expr))
    if expr.is_Integer:
        return str(int(expr))
    _, _, text = _tables()
    for typ, op in text.items():
        if isinstance(expr, typ):
            parts = [expr_text(a) for a in expr.args]  # type: ignore[attr-defined]
            if isinstance(expr, sympy.Mul):
                return "*".join(f"({p})" if " " in p else p for p in parts)
            if isinstance(expr, sympy.Add):
                return " + ".join(parts).replace("+ -", "- ")
            return f" {op} ".join(
                f"({p})" if " " in p and op not in ("==", "!=", "<", "<=", ">", ">=", "and", "or") else p for p in parts
            )
    return re.sub(r"#\d+", "", str(expr))


# ---------------------------------------------------------------------------------------------------------------
# Compiled spec
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Var:
    idx: int
    sym: Any
    name: str
    lo: int | None
    hi: int | None

    def declared(self) -> str:
        lo = "-inf" if self.lo is None else str(self.lo)
        hi = "inf" if self.hi is None else str(self.hi)
        return f"{self.name} in [{lo}, {hi}]"


@dataclass
class Expr:
    fn: Callable[[Env], Any]
    sympy_expr: Any
    text: str
    vars: list[int]
    linear: tuple[int, int, int] | None = None  # (var idx, a, c) when the expression is a*V + c


@dataclass
class Slot:
    """One int slot: a tensor dim (``dim`` set) or a scalar argument (``dim`` None)."""

    path: Path
    dim: int | None
    kind: str  # "static" | "int" | "var" | "expr"
    value: Any = None  # int for "int", Var for "var", Expr for "expr"


@dataclass
class CompiledSpec:
    """A ShapesSpec flattened into checkable slots. Built once per decorated function."""

    function: str
    tensors: list[tuple[Path, int]] = field(default_factory=list)  # (path, rank)
    dims: list[Slot] = field(default_factory=list)
    variables: list[Var] = field(default_factory=list)
    assumptions: list[Expr] = field(default_factory=list)
    _index: dict[Any, int] = field(default_factory=dict)

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, spec: Any, function: str) -> CompiledSpec:
        from torch.fx.experimental import dynamic_spec as tds

        if isinstance(spec, (dict, tds.ParamsSpec)):
            spec = tds.ShapesSpec(spec)
        if not isinstance(spec, tds.ShapesSpec):
            raise TypeError(f"dynamic_spec: expected a ShapesSpec, ParamsSpec or dict, got {type(spec).__name__}")
        cs = cls(function=function)
        params = spec._params
        if params is not None:
            for name, leaf in params._named_args.items():
                cs._add(leaf, (("arg", name),))
            for i, leaf in enumerate(params._varargs or []):
                cs._add(leaf, (("arg", "*args"), ("index", i)))
            for k, leaf in (params._varkw or {}).items():
                cs._add(leaf, (("arg", "**kwargs"), ("key", k)))
        for a in spec.assumptions:
            cs.assumptions.append(cs._expr(a.node.expr))
        return cs

    def _var(self, sym: Any) -> Var:
        if sym not in self._index:
            from torch.fx.experimental.dynamic_spec import _get_spec_shape_env
            from torch.utils._sympy.numbers import int_oo

            vr = _get_spec_shape_env().var_to_range.get(sym)
            lo = None if vr is None or vr.lower == -int_oo else int(vr.lower)
            hi = None if vr is None or vr.upper == int_oo else int(vr.upper)
            self._index[sym] = len(self.variables)
            self.variables.append(Var(len(self.variables), sym, str(sym).split("#")[0], lo, hi))
        return self.variables[self._index[sym]]

    def _expr(self, expr: Any) -> Expr:
        import sympy

        syms = sorted(expr.free_symbols, key=str)
        idxs = [self._var(s).idx for s in syms]
        e = Expr(expr_fn(expr, self._index), expr, expr_text(expr), idxs)
        if len(syms) == 1 and not isinstance(expr, sympy.logic.boolalg.Boolean) and not expr.is_Relational:
            s = syms[0]
            a, c = expr.coeff(s), expr.subs(s, 0)
            if a.is_Integer and c.is_Integer and a != 0 and sympy.expand(a * s + c - expr) == 0:
                e.linear = (idxs[0], int(a), int(c))
        return e

    def _slot(self, leaf: Any, path: Path, dim: int | None) -> Slot:
        from torch.fx.experimental.dynamic_spec import IntVar

        if leaf is None:
            return Slot(path, dim, "static")
        if isinstance(leaf, IntVar):
            return Slot(path, dim, "var", self._var(leaf.sympy_sym))
        if isinstance(leaf, torch.SymInt):
            return Slot(path, dim, "expr", self._expr(leaf.node.expr))
        if isinstance(leaf, int) and not isinstance(leaf, bool):
            return Slot(path, dim, "int", leaf)
        raise TypeError(f"dynamic_spec: unsupported spec leaf {leaf!r} at {path_str(path)}")

    def _add(self, leaf: Any, path: Path) -> None:
        from torch.fx.experimental import dynamic_spec as tds

        if isinstance(leaf, tds.TensorSpec):
            self.tensors.append((path, len(leaf)))
            for d, item in enumerate(leaf):
                self.dims.append(self._slot(item, path, d))
        elif isinstance(leaf, tds.DictSpec):
            for k, sub in leaf.items():
                self._add(sub, (*path, ("key", k)))
        elif isinstance(leaf, tds.SeqSpec):
            for i, sub in enumerate(leaf._entries):
                self._add(sub, (*path, ("index", i)))
        elif isinstance(leaf, tds.ObjectSpec):
            for k, sub in leaf.items():
                self._add(sub, (*path, ("attr", k)))
        else:
            self.dims.append(self._slot(leaf, path, None))

    # -- value access ------------------------------------------------------------------------------------------
    def get(self, args: dict[str, Any], path: Path) -> Any:
        name = path[0][1]
        if name not in args:
            raise ShapeSpecError(self.function, name, None, "an argument described by the spec", "no such argument")
        v = args[name]
        for kind, k in path[1:]:
            try:
                v = getattr(v, k) if kind == "attr" else v[k]
            except (KeyError, IndexError, AttributeError, TypeError):
                raise ShapeSpecError(
                    self.function, path_str(path), None, "a value described by the spec", "missing"
                ) from None
        return v

    def size(self, args: dict[str, Any], slot: Slot) -> Any:
        v = self.get(args, slot.path)
        return v if slot.dim is None else v.shape[slot.dim]

    # -- call-time check ---------------------------------------------------------------------------------------
    def check(self, args: dict[str, Any]) -> Env:
        """Validate bound arguments against the spec; return the variable bindings. Raises ShapeSpecError."""
        fn = self.function
        for path, rank in self.tensors:
            v = self.get(args, path)
            if not isinstance(v, torch.Tensor):
                raise ShapeSpecError(fn, path_str(path), None, f"a tensor of rank {rank}", type(v).__name__)
            if v.dim() != rank:
                raise ShapeSpecError(
                    fn, path_str(path), None, f"rank {rank}", f"rank {v.dim()} (shape {tuple(v.shape)})"
                )
        env: Env = {}
        source: dict[int, str] = {}
        pending: list[tuple[Slot, int]] = []
        for slot in self.dims:
            raw = self.size(args, slot)
            where = path_str(slot.path)
            if slot.dim is None and (isinstance(raw, bool) or not isinstance(raw, int)):
                raise ShapeSpecError(fn, where, None, "an int", type(raw).__name__)
            size = int(raw)
            if slot.kind == "int" and size != slot.value:
                raise ShapeSpecError(fn, where, slot.dim, f"== {slot.value}", size)
            elif slot.kind == "var":
                self._bind(env, source, slot.value, size, where, slot.dim)
            elif slot.kind == "expr":
                pending.append((slot, size))
        while pending:
            progressed = False
            for item in list(pending):
                slot, size = item
                e: Expr = slot.value
                where = path_str(slot.path)
                if all(i in env for i in e.vars):
                    want = e.fn(env)
                    if size != want:
                        raise ShapeSpecError(
                            fn, where, slot.dim, f"{e.text} = {want} ({self._desc(e, env, source)})", size
                        )
                elif e.linear is not None:
                    i, a, c = e.linear
                    var = self.variables[i]
                    if (size - c) % a != 0:
                        raise ShapeSpecError(fn, where, slot.dim, f"{e.text} for an integer {var.name}", size)
                    self._bind(env, source, var, (size - c) // a, where, slot.dim, via=e.text)
                else:
                    continue
                pending.remove(item)
                progressed = True
            if not progressed:
                slot, size = pending[0]
                raise ShapeSpecError(
                    fn,
                    path_str(slot.path),
                    slot.dim,
                    f"{slot.value.text} (its variables are not bound by any argument)",
                    size,
                )
        for e in self.assumptions:
            missing = [self.variables[i].name for i in e.vars if i not in env]
            if missing:
                raise ShapeSpecError(
                    fn,
                    "<assumptions>",
                    None,
                    f"assumption {e.text} (variables {missing} are not bound by any argument)",
                    "unbound",
                )
            if not bool(e.fn(env)):
                first = source[e.vars[0]]
                raise ShapeSpecError(
                    fn, first.split(".shape")[0], None, f"assumption {e.text}", self._desc(e, env, source)
                )
        return env

    def _desc(self, e: Expr, env: Env, source: dict[int, str]) -> str:
        return ", ".join(f"{self.variables[i].name}={env[i]} from {source[i]}" for i in e.vars)

    def _bind(
        self, env: Env, source: dict[int, str], var: Var, size: int, where: str, dim: int | None, via: str = ""
    ) -> None:
        loc = where if dim is None else f"{where}.shape[{dim}]"
        if via:
            loc += f" = {via}"
        if var.idx in env:
            if env[var.idx] != size:
                raise ShapeSpecError(
                    self.function, where, dim, f"{var.name} = {env[var.idx]} (bound by {source[var.idx]})", size
                )
            return
        if (var.lo is not None and size < var.lo) or (var.hi is not None and size > var.hi):
            raise ShapeSpecError(self.function, where, dim, var.declared() + (f" via {via}" if via else ""), size)
        env[var.idx] = size
        source[var.idx] = loc

    # -- tracing -----------------------------------------------------------------------------------------------
    def trace_checks(self, args: dict[str, Any], *, specialize_static: bool = False) -> None:
        """Emit ``torch._check`` for ranges, derived dims and assumptions while tracing (symbolic sizes).

        Under torch.export the checks on assumptions become runtime assertions of the exported program; under
        torch.compile they teach the shape environment the relations (e.g. ``y.shape[0] == 2 * x.shape[0]``).
        """
        sizes = [self.size(args, slot) for slot in self.dims]
        if not any(isinstance(v, torch.SymInt) for v in sizes):
            self.check(args)  # all sizes static in this trace: the plain check, with its ShapeSpecError
            return
        env: Env = {}
        for slot in self.dims:
            size = self.size(args, slot)
            if slot.kind == "var":
                var: Var = slot.value
                if var.idx in env:
                    torch._check(size == env[var.idx])
                    continue
                env[var.idx] = size
                if var.lo is not None:
                    torch._check(size >= var.lo)
                if var.hi is not None:
                    torch._check(size <= var.hi)
            elif slot.kind == "int":
                torch._check(size == slot.value)
            elif slot.kind == "static" and specialize_static and isinstance(size, torch.SymInt):
                torch._check(size == size.node.hint)
        for slot in self.dims:
            if slot.kind == "expr":
                e: Expr = slot.value
                if all(i in env for i in e.vars):
                    torch._check(self.size(args, slot) == e.fn(env))
        for e in self.assumptions:
            if all(i in env for i in e.vars):
                torch._check(e.fn(env))
