"""``while_loop`` and ``fori_loop``: loops with a data-dependent trip count that survive compile and export.

Design
------
* Eager (nothing is being traced): a plain Python loop. ``torch.while_loop`` itself, called eagerly in torch 2.13,
  goes through an internal ``torch.compile`` (tens of milliseconds per call); the Python loop has the same meaning
  at the cost of one host read of the predicate per iteration. Every iteration's carry is checked against the
  initial one (structure, shapes, dtypes), the same contract the traced loop enforces.
* Tracing (torch.compile, torch.export strict/non-strict, make_fx): ``torch.while_loop`` (the public higher-order
  op of torch 2.13+), which keeps the loop in the graph, works with Inductor, and saves/loads with
  ``torch.export.save/load``.
* ``fori_loop`` is built on ``while_loop`` with an int64 counter carried beside the user's state.

CUDA graphs (GPU only): Inductor lowers ``while_loop`` to a loop whose predicate is evaluated on the device; to
run it inside a captured CUDA graph without a device-to-host copy per iteration the loop must be compiled with
``mode="reduce-overhead"`` and the predicate must stay a device tensor (never ``.item()`` it in ``cond_fn``).
See docs/control.md for what was (and was not) verified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from torchnext.control._tracing import is_tracing

__all__ = ["while_loop", "fori_loop", "while_loop_reference", "LoopError"]


class LoopError(RuntimeError):
    """A loop's body or predicate broke the contract (carry structure/shape/dtype changed, bad predicate)."""


def while_loop_reference(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried_inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The meaning of :func:`while_loop` in plain Python (the test oracle)."""
    carry = tuple(carried_inputs)
    while bool(cond_fn(*carry)):
        carry = tuple(body_fn(*carry))
    return carry


def _meta(leaves: list[Any]) -> list[Any]:
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves]


def _check_carry(where: str, leaves: list[Any], spec: TreeSpec, ref_meta: list[Any], ref_spec: TreeSpec) -> None:
    if spec != ref_spec:
        raise LoopError(f"{where}: body_fn returned structure {spec}, but the carried inputs have {ref_spec}")
    for j, (a, b) in enumerate(zip(_meta(leaves), ref_meta, strict=True)):
        if a != b:
            raise LoopError(
                f"{where}: body_fn changed carry leaf {j} from {b} to {a}; every iteration must return the same "
                "structure, shapes and dtypes as carried_inputs"
            )


def _as_bool(where: str, pred: Any) -> bool:
    if isinstance(pred, torch.Tensor):
        if pred.numel() != 1 or pred.dtype != torch.bool:
            raise LoopError(
                f"{where}: cond_fn must return a bool or a one-element bool tensor, got a {pred.dtype} tensor of "
                f"shape {tuple(pred.shape)}"
            )
        return bool(pred)
    if isinstance(pred, bool):
        return pred
    raise LoopError(f"{where}: cond_fn must return a bool or a one-element bool tensor, got {type(pred).__name__}")


def _validate_inputs(where: str, cond_fn: Any, body_fn: Any, carried_inputs: Any) -> None:
    if not callable(cond_fn) or not callable(body_fn):
        raise TypeError(f"{where}: cond_fn and body_fn must be callable")
    if not isinstance(carried_inputs, (tuple, list)):
        raise TypeError(f"{where}: carried_inputs must be a tuple or list, got {type(carried_inputs).__name__}")
    for j, leaf in enumerate(tree_flatten(tuple(carried_inputs))[0]):
        if not isinstance(leaf, (torch.Tensor, int)) or isinstance(leaf, bool):
            raise TypeError(
                f"{where}: carried leaf {j} is a {type(leaf).__name__}; carried leaves must be tensors or ints"
            )


def while_loop(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried_inputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Repeat ``body_fn`` while ``cond_fn`` holds; the meaning of ``torch.while_loop``.

    Semantics, in plain Python::

        def while_loop(cond_fn, body_fn, carried_inputs):
            carry = carried_inputs
            while cond_fn(*carry):
                carry = body_fn(*carry)
            return carry

    Args:
        cond_fn: ``cond_fn(*carry)`` -> a bool or one-element bool tensor.
        body_fn: ``body_fn(*carry)`` -> a tuple with the same structure, shapes and dtypes as ``carried_inputs``.
            It must not mutate its inputs.
        carried_inputs: a tuple of tensors (or ints).

    Eager calls run a Python loop (no compile); traced calls (compile/export/make_fx) emit ``torch.while_loop``.

    Raises:
        TypeError: non-callable functions or non-tensor carried leaves.
        LoopError: the carry changes structure/shape/dtype, or the predicate is not a boolean.

    Example::

        >>> while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (torch.tensor(0), torch.ones(2)))
        (tensor(3), tensor([8., 8.]))
    """
    _validate_inputs("while_loop", cond_fn, body_fn, carried_inputs)
    carried = tuple(carried_inputs)
    leaves, spec = tree_flatten(carried)
    if is_tracing(*leaves):
        return tuple(torch.while_loop(cond_fn, body_fn, carried))
    ref_meta = _meta(leaves)
    carry = carried
    it = 0
    while _as_bool(f"while_loop (iteration {it})", cond_fn(*carry)):
        out = body_fn(*carry)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        out_leaves, out_spec = tree_flatten(tuple(out))
        _check_carry(f"while_loop (iteration {it})", out_leaves, out_spec, ref_meta, spec)
        carry = tuple(out)
        it += 1
    return carry


def fori_loop(
    lower: int | torch.Tensor, upper: int | torch.Tensor, body_fn: Callable[[torch.Tensor, Any], Any], init: Any
) -> Any:
    """``for i in range(lower, upper): val = body_fn(i, val)``; returns ``val`` (JAX's ``fori_loop``).

    Semantics, in plain Python::

        def fori_loop(lower, upper, body_fn, init):
            val = init
            for i in range(int(lower), int(upper)):
                val = body_fn(torch.tensor(i), val)
            return val

    Args:
        lower, upper: ints or one-element integer tensors (data-dependent trip counts stay in the graph).
        body_fn: ``body_fn(i, val)`` -> a new ``val`` with the same pytree structure, shapes and dtypes; ``i`` is a
            0-dim int64 tensor in every mode (eager and traced), so one body works everywhere.
        init: a pytree of tensors.

    Raises:
        TypeError / LoopError as :func:`while_loop`.

    Example::

        >>> fori_loop(0, 4, lambda i, x: x + i, torch.zeros(2))
        tensor([6., 6.])
    """
    if not callable(body_fn):
        raise TypeError("fori_loop: body_fn must be callable")
    for name, bound in (("lower", lower), ("upper", upper)):
        if isinstance(bound, bool) or not isinstance(bound, (int, torch.SymInt, torch.Tensor)):
            raise TypeError(f"fori_loop: {name} must be an int or an integer tensor, got {type(bound).__name__}")
        if isinstance(bound, torch.Tensor) and (
            bound.numel() != 1 or bound.dtype.is_floating_point or bound.dtype == torch.bool
        ):
            raise TypeError(
                f"fori_loop: {name} must be a one-element integer tensor, got {bound.dtype} {tuple(bound.shape)}"
            )
    leaves, spec = tree_flatten(init)
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"fori_loop: init leaf {j} is a {type(leaf).__name__}; init leaves must be tensors")
    tensor_bounds = [b for b in (lower, upper) if isinstance(b, torch.Tensor)]
    if not is_tracing(*leaves, *tensor_bounds):
        ref_meta = _meta(leaves)
        val = init
        for k in range(int(lower), int(upper)):
            val = body_fn(torch.tensor(k, dtype=torch.int64), val)
            out_leaves, out_spec = tree_flatten(val)
            _check_carry(f"fori_loop (i={k})", out_leaves, out_spec, ref_meta, spec)
        return val

    up = upper.reshape(()) if isinstance(upper, torch.Tensor) else upper
    start = (
        lower.reshape(()).to(torch.int64) if isinstance(lower, torch.Tensor) else torch.tensor(lower, dtype=torch.int64)
    )

    def cond(i: torch.Tensor, *ls: torch.Tensor) -> torch.Tensor:
        return i < up

    def body(i: torch.Tensor, *ls: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new = body_fn(i, tree_unflatten(list(ls), spec))
        new_leaves, new_spec = tree_flatten(new)
        if new_spec != spec:
            raise LoopError(f"fori_loop: body_fn returned structure {new_spec}, but init has {spec}")
        return (i + 1, *new_leaves)

    out = torch.while_loop(cond, body, (start, *leaves))
    return tree_unflatten(list(out[1:]), spec)
