"""``switch``: multi-way branching on a (possibly data-dependent) index, for eager, compile, export and make_fx.

Design
------
* Eager with a concrete index (``int`` or a real one-element integer tensor): the index is read on the host, clamped
  and the selected branch is called directly -- no graph capture, a few microseconds of overhead. For a tensor index
  the first call for a given (branches, operand metadata) also runs every branch once on FakeTensors to check that
  they agree (structure, shapes, dtypes) and neither mutate nor alias their inputs, so eager raises the same errors
  a compiled call would; the verdict is cached.
* While tracing (``torch.compile``/Dynamo, strict and non-strict ``torch.export``, ``make_fx``) with a tensor or
  SymInt index: lowered to a balanced binary search tree of ``torch.cond`` on ``index < mid`` (depth
  ``ceil(log2 n)``). The search tree clamps by construction (negative indices reach branch 0, large ones the last),
  so no clamp op is emitted.
  ``torch.cond`` is a stable higher-order op in torch 2.13+, so the graph keeps every branch (no recompilation per
  index value), supports autograd, and an exported program saves and loads with ``torch.export.save/load``.
* An ``int`` index while tracing specialises: the branch is called directly and the graph holds only that branch.
* Under ``torch.vmap`` with a batched index, every branch runs on the batch and the results are selected per example
  (``torch.where``), so vmap over the index and over the operands both work.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from torchnext.control._tracing import is_tracing

__all__ = ["switch", "switch_reference", "SwitchError", "SwitchIndexError", "BranchMismatchError"]


class SwitchError(RuntimeError):
    """Base class of switch errors (a RuntimeError, like torch 2.14's switch errors)."""


class SwitchIndexError(SwitchError, TypeError):
    """The index is not an int, a SymInt, or a one-element integer tensor; or branches are empty / not callable."""


class BranchMismatchError(SwitchError, ValueError):
    """A branch disagrees with branch 0 (output structure, shape, dtype), or mutates/aliases its operands."""


def switch_reference(index: int | torch.Tensor, branches: Sequence[Callable[..., Any]], operands: Any = ()) -> Any:
    """The meaning of :func:`switch` in plain Python (used by tests as the oracle)."""
    i = min(max(int(index), 0), len(branches) - 1)
    return branches[i](*operands)


def _branch_name(k: int, fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"branch {k} ({name})"


_FLAT_SPECS: dict[int, TreeSpec] = {}


def _flat_spec(n: int) -> TreeSpec:
    spec = _FLAT_SPECS.get(n)
    if spec is None:
        spec = _FLAT_SPECS[n] = tree_flatten(tuple(range(n)))[1]
    return spec


def _validate(index: Any, branches: Any, operands: Any) -> tuple[list[Any], TreeSpec]:
    if not isinstance(branches, (list, tuple)):
        raise SwitchIndexError(f"switch: branches must be a list or tuple of callables, got {type(branches).__name__}")
    if len(branches) == 0:
        raise SwitchIndexError("switch: branches is empty; pass at least one callable")
    for k, b in enumerate(branches):
        if not callable(b):
            raise SwitchIndexError(f"switch: branch {k} is not callable (got {type(b).__name__})")
    if isinstance(index, bool) or not isinstance(index, (int, torch.SymInt, torch.Tensor)):
        raise SwitchIndexError(
            f"switch: index must be an int, a SymInt or a one-element integer tensor, got {type(index).__name__}"
        )
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise SwitchIndexError(f"switch: index tensor must have an integer dtype, got {index.dtype}")
        if index.numel() != 1:
            raise SwitchIndexError(
                f"switch: index tensor must have exactly one element, got shape {tuple(index.shape)}"
            )
    if not isinstance(operands, (tuple, list)):
        raise SwitchIndexError(f"switch: operands must be a tuple or list, got {type(operands).__name__}")
    if all(type(o) is torch.Tensor for o in operands):  # fast path: a flat tuple of plain tensors
        return list(operands), _flat_spec(len(operands))
    leaves, spec = tree_flatten(tuple(operands))
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise SwitchIndexError(
                f"switch: operand leaf {j} is a {type(leaf).__name__}; every operand leaf must be a tensor "
                "(close over constants in the branch functions instead)"
            )
    return leaves, spec


# ---------------------------------------------------------------------------------------------------------------
# Branch agreement check (eager tensor index), cached.
# ---------------------------------------------------------------------------------------------------------------

_CHECK_CACHE: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()
_CHECK_CACHE_SIZE = 512
_CHECK_LOCK = threading.Lock()


def _describe(out: Any) -> tuple[TreeSpec, list[tuple[str, Any]]]:
    leaves, spec = tree_flatten(out)
    desc: list[tuple[str, Any]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            desc.append(("tensor", (tuple(leaf.shape), leaf.dtype)))
        else:
            desc.append(("value", type(leaf).__name__))
    return spec, desc


def _is_alias_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


def _check_branches(branches: Sequence[Callable[..., Any]], leaves: list[torch.Tensor], spec: TreeSpec) -> None:
    """Run every branch on FakeTensors; raise BranchMismatchError when they disagree or mutate/alias inputs.

    A branch that FakeTensors cannot run (data-dependent output shape, an op without a fake kernel, host reads)
    is not checked here: its real call surfaces its own errors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    ref: tuple[TreeSpec, list[tuple[str, Any]]] | None = None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.no_grad():
        for k, branch in enumerate(branches):
            try:
                fakes = [mode.from_tensor(t) for t in leaves]
                versions = [f._version for f in fakes]
                out = branch(*tree_unflatten(list(fakes), spec))
            except Exception:
                return  # not fake-traceable (or operands FakeTensors cannot wrap): the real call checks itself
            for j, (f, v) in enumerate(zip(fakes, versions, strict=True)):
                if f._version != v:
                    raise BranchMismatchError(
                        f"switch: {_branch_name(k, branch)} mutates operand leaf {j} in place; branches must not "
                        "mutate their inputs"
                    )
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and any(_is_alias_of(o, f) for f in fakes):
                    raise BranchMismatchError(
                        f"switch: {_branch_name(k, branch)} returns an alias (view or the same tensor) of an operand; "
                        "return a copy (e.g. x.clone()) instead"
                    )
            desc = _describe(out)
            if ref is None:
                ref = desc
                continue
            if desc[0] != ref[0]:
                raise BranchMismatchError(
                    f"switch: {_branch_name(k, branch)} returns a different structure than "
                    f"{_branch_name(0, branches[0])}: {desc[0]} vs {ref[0]}"
                )
            for j, (a, b) in enumerate(zip(desc[1], ref[1], strict=True)):
                if a != b:
                    raise BranchMismatchError(
                        f"switch: {_branch_name(k, branch)} output leaf {j} is {a[0]} {a[1]} but "
                        f"{_branch_name(0, branches[0])} returns {b[0]} {b[1]}; every branch must return the same "
                        "structure, shapes and dtypes"
                    )


def _branch_key(b: Callable[..., Any]) -> tuple[Any, tuple[Any, ...]]:
    """A cache key that is stable for branch functions rebuilt on every call (``[lambda x, w=w: ... for w in ws]``).

    Plain functions are keyed by their code object and the identities of their defaults and closure contents;
    bound methods by their function and instance; anything else (modules, partials) by identity. Returns the key
    and the objects whose identities it uses (kept alive by the cache so the ids stay meaningful).
    """
    if isinstance(b, types.FunctionType):
        refs = (*(b.__defaults__ or ()), *(c.cell_contents for c in (b.__closure__ or ()) if _cell_full(c)))
        kw = tuple(sorted((k, id(v)) for k, v in (b.__kwdefaults__ or {}).items()))
        return (b.__code__, tuple(id(r) for r in refs), kw), (*refs, *(b.__kwdefaults__ or {}).values())
    if isinstance(b, types.MethodType):
        return (b.__func__, id(b.__self__)), (b.__self__,)
    return (id(b),), (b,)


def _cell_full(c: Any) -> bool:
    try:
        c.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


_SEEN: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()  # fast path: the very same branch objects


def _ensure_checked(branches: Sequence[Callable[..., Any]], leaves: list[torch.Tensor], spec: TreeSpec) -> None:
    meta = (spec, tuple((t.shape, t.dtype, t.device) for t in leaves))
    fast = (tuple(map(id, branches)), meta)
    seen = _SEEN.get(fast)
    if seen is not None and all(a is b for a, b in zip(seen, branches, strict=True)):
        return
    keys = [_branch_key(b) for b in branches]
    key = (tuple(k for k, _ in keys), meta)
    with _CHECK_LOCK:
        hit = key in _CHECK_CACHE
        if hit:
            _CHECK_CACHE.move_to_end(key)
    if not hit:
        _check_branches(branches, leaves, spec)
    with _CHECK_LOCK:
        _CHECK_CACHE[key] = tuple(r for _, refs in keys for r in refs)  # keep the keyed objects alive
        _SEEN[fast] = tuple(branches)  # strong refs: the ids in ``fast`` stay valid
        for cache in (_CHECK_CACHE, _SEEN):
            while len(cache) > _CHECK_CACHE_SIZE:
                cache.popitem(last=False)


# ---------------------------------------------------------------------------------------------------------------
# Traced lowering: balanced tree of torch.cond.
# ---------------------------------------------------------------------------------------------------------------


def _cond_tree(
    idx: Any, branches: Sequence[Callable[..., Any]], leaves: tuple[Any, ...], spec: TreeSpec, lo: int, hi: int
) -> Any:
    if hi - lo == 1:
        return branches[lo](*tree_unflatten(list(leaves), spec))
    mid = (lo + hi) // 2

    def low(*ls: Any) -> Any:
        return _cond_tree(idx, branches, ls, spec, lo, mid)

    def high(*ls: Any) -> Any:
        return _cond_tree(idx, branches, ls, spec, mid, hi)

    low.__name__ = f"switch_branches_{lo}_to_{mid - 1}"
    high.__name__ = f"switch_branches_{mid}_to_{hi - 1}"
    return torch.cond(idx < mid, low, high, tuple(leaves))


def _select_batched(index: torch.Tensor, branches: Sequence[Callable[..., Any]], operands: tuple[Any, ...]) -> Any:
    """vmap with a batched index: run every branch, pick per example."""
    n = len(branches)
    idx = index.reshape(()).clamp(0, n - 1)
    outs = [b(*operands) for b in branches]
    ref_spec = tree_flatten(outs[0])[1]
    flat = [tree_flatten(o)[0] for o in outs]
    for k, o in enumerate(outs):
        if tree_flatten(o)[1] != ref_spec:
            raise BranchMismatchError(
                f"switch: {_branch_name(k, branches[k])} returns a different structure than branch 0"
            )
    result = list(flat[n - 1])
    for k in range(n - 2, -1, -1):
        result = [torch.where(idx == k, a, r) for a, r in zip(flat[k], result, strict=True)]
    return tree_unflatten(result, ref_spec)


def switch(index: int | torch.SymInt | torch.Tensor, branches: Sequence[Callable[..., Any]], operands: Any = ()) -> Any:
    """Call one of ``branches`` on ``operands``, selected by ``index`` (clamped into range).

    Semantics, in plain Python::

        def switch(index, branches, operands=()):
            index = min(max(int(index), 0), len(branches) - 1)
            return branches[index](*operands)

    Args:
        index: an ``int``, a ``SymInt`` or a one-element integer tensor. Out-of-range values are clamped
            (``99`` -> last branch, ``-3`` -> branch 0).
        branches: a non-empty list/tuple of callables; each takes ``*operands`` and returns the same pytree
            structure with the same shapes and dtypes, without mutating or aliasing its inputs.
        operands: a tuple/list whose pytree leaves are all tensors.

    Behaviour by context:
        * eager, concrete index: the branch is called directly (one host read of a tensor index; a single branch is
          a plain call). The first tensor-index call per (branches, operand shapes) checks all branches agree.
        * tracing (torch.compile with any backend, torch.export strict/non-strict, make_fx) with a tensor or SymInt
          index: a balanced tree of ``torch.cond``; every branch is in the graph and the index stays data-dependent,
          so no recompilation per index value; autograd flows through the taken branch; exported programs save and
          load. With an ``int`` index the trace specialises on that value (only the taken branch is traced).
        * ``torch.vmap`` over a batched index: all branches run, results are selected per example.

    Raises:
        SwitchIndexError: bad index type/dtype/size, empty or non-callable branches, a non-tensor operand leaf.
        BranchMismatchError: branches disagree on output structure/shape/dtype, or mutate/alias an operand
            (the message names the branch).

    Example::

        >>> experts = [lambda x, i=i: x * (i + 1) for i in range(4)]
        >>> switch(torch.tensor(2), experts, (torch.ones(2),))
        tensor([3., 3.])
    """
    leaves, spec = _validate(index, branches, operands)
    n = len(branches)
    if isinstance(index, torch.Tensor):
        if torch._C._functorch.is_batchedtensor(index):
            return _select_batched(index, branches, tuple(operands))
        if is_tracing(index, *leaves):
            if n == 1:
                return branches[0](*operands)
            # The search tree clamps by construction: values < 1 reach branch 0, values >= n - 1 the last one.
            return _cond_tree(index.reshape(()), branches, tuple(leaves), spec, 0, n)
        i = int(index)
        if n > 1:
            _ensure_checked(branches, leaves, spec)
        return branches[min(max(i, 0), n - 1)](*operands)
    if n > 1 and (isinstance(index, torch.SymInt) or torch.compiler.is_compiling()):
        # Under Dynamo a SymInt does not answer isinstance(SymInt), so every int-typed index takes this path
        # while compiling: a symbolic one becomes a tree of torch.cond on SymBool predicates, a constant int makes
        # constant predicates, which torch.cond resolves at trace time (the graph specialises on that value).
        return _cond_tree(index, branches, tuple(leaves), spec, 0, n)
    return branches[min(max(int(index), 0), n - 1)](*operands)
