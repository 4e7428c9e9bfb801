"""torchnext.switch: eager / compile / export (+ save/load) / make_fx / vmap, against the plain-Python reference."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

from torchnext.control import BranchMismatchError, SwitchError, SwitchIndexError, switch
from torchnext.control.switch import switch_reference

torch.manual_seed(0)
_W = [torch.randn(6, 6) for _ in range(8)]


def _make_branches(n: int) -> list[Any]:
    """Branches over a nested pytree ((x, {"y": y}) -> {"a": .., "b": (..,)}), each distinguishable."""
    return [(lambda x, d, k=k: {"a": torch.tanh(x @ _W[k]) + k, "b": (d["y"] * (k + 1),)}) for k in range(n)]


BR8 = _make_branches(8)


def _close(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.allclose(p, q, atol=1e-5, rtol=1e-5) for p, q in zip(la, lb, strict=True))


def _ops() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.randn(3, 6), {"y": torch.randn(4)}


# ------------------------------------------------------------------------------------------------ eager


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("kind", ["int", "tensor", "tensor1d"])
@pytest.mark.parametrize("i", [-3, 0, 1, 5, 7, 99])
def test_eager_matches_reference(n: int, kind: str, i: int) -> None:
    branches = _make_branches(n)
    x, d = _ops()
    index: Any = {"int": i, "tensor": torch.tensor(i), "tensor1d": torch.tensor([i], dtype=torch.int32)}[kind]
    assert _close(switch(index, branches, (x, d)), switch_reference(i, branches, (x, d)))


def test_eager_clamps_into_range() -> None:
    x, d = _ops()
    assert _close(switch(torch.tensor(99), BR8, (x, d)), BR8[7](x, d))
    assert _close(switch(-3, BR8, (x, d)), BR8[0](x, d))


def test_eager_autograd_through_taken_branch() -> None:
    x, d = _ops()
    x.requires_grad_(True)
    switch(torch.tensor(3), BR8, (x, d))["a"].sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    BR8[3](x2, d)["a"].sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, x2.grad)  # type: ignore[arg-type]


def test_eager_tensor_index_runs_no_graph_machinery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager with a tensor index calls the chosen branch directly: no torch.cond, no Dynamo frame. (Its speed
    goal, <= 50 us over a direct call, is checked by benchmarks/control/bench_switch.py, not by a timed test.)"""
    x, d = _ops()
    idx = torch.tensor(5)
    switch(idx, BR8, (x, d))  # warm the branch-agreement cache

    def _no_cond(*a: Any, **k: Any) -> Any:
        raise AssertionError("eager switch must not go through torch.cond")

    monkeypatch.setattr(torch, "cond", _no_cond)
    frames_before = torch._dynamo.utils.counters["frames"]["total"]
    out = switch(idx, BR8, (x, d))
    torch.testing.assert_close(out, BR8[5](x, d))
    assert torch._dynamo.utils.counters["frames"]["total"] == frames_before


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("index", [1.5, True, "2", torch.tensor(1.0), torch.tensor([1, 2]), torch.tensor(True), None])
def test_bad_index(index: Any) -> None:
    with pytest.raises(SwitchIndexError, match="index"):
        switch(index, BR8, _ops())


def test_bad_branches_and_operands() -> None:
    with pytest.raises(SwitchIndexError, match="empty"):
        switch(0, [], ())
    with pytest.raises(SwitchIndexError, match="branch 1 is not callable"):
        switch(0, [lambda: 1, 3], ())
    with pytest.raises(SwitchIndexError, match="operand leaf 1 is a int"):
        switch(0, BR8, (torch.ones(1), 3))
    with pytest.raises(SwitchIndexError, match="operands must be a tuple"):
        switch(0, BR8, torch.ones(1))
    assert issubclass(SwitchIndexError, RuntimeError) and issubclass(SwitchIndexError, TypeError)


def test_mismatched_branches_name_the_branch() -> None:
    x = torch.randn(3)
    x0 = x.clone()

    def good(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def wrong_dtype(x: torch.Tensor) -> torch.Tensor:
        return x.double()

    def wrong_shape(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x])

    def wrong_structure(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x + 2

    def mutates(x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)

    def aliases(x: torch.Tensor) -> torch.Tensor:
        return x.view(3)

    for bad, what in [
        (wrong_dtype, "float64"),
        (wrong_shape, r"\(6,\)"),
        (wrong_structure, "different structure"),
        (mutates, "mutates operand leaf 0"),
        (aliases, "alias"),
    ]:
        with pytest.raises(BranchMismatchError, match=rf"branch 2 \([^)]*{bad.__name__}\).*{what}"):
            switch(torch.tensor(0), [good, good, bad], (x,))
    assert torch.equal(x, x0), "the check must not mutate the real operands"


def test_mismatch_check_is_cached_and_skips_untraceable_branches() -> None:
    calls = {"n": 0}

    def host_read(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return x * float(x.sum().item() > 0)  # FakeTensors cannot .item(): the check is skipped, real call works

    x = torch.randn(4)
    out = switch(torch.tensor(1), [lambda x: x + 1, host_read], (x,))
    assert torch.allclose(out, host_read(x))


# ------------------------------------------------------------------------------------------------ vmap


def test_vmap_over_operands_and_index() -> None:
    xb, y = torch.randn(5, 3, 6), torch.randn(4)
    out = torch.vmap(lambda x: switch(torch.tensor(3), BR8, (x, {"y": y})))(xb)
    assert _close(out, torch.vmap(lambda x: BR8[3](x, {"y": y}))(xb))
    ib = torch.tensor([0, 1, 7, 99, -2])
    out = torch.vmap(lambda i, x: switch(i, BR8, (x, {"y": y})))(ib, xb)
    for k in range(5):
        assert _close({"a": out["a"][k], "b": (out["b"][0][k],)}, switch_reference(int(ib[k]), BR8, (xb[k], {"y": y})))


# ------------------------------------------------------------------------------------------------ compile (shared)


class _Compiled:
    """One aot_eager fullgraph compile of an 8-branch switch, shared by the compile tests."""

    def __init__(self) -> None:
        self.counter = CompileCounterWithBackend("aot_eager")

        def fn(i: torch.Tensor, x: torch.Tensor, d: dict[str, torch.Tensor]) -> Any:
            return switch(i, BR8, (x, d))

        self.fn = torch.compile(fn, fullgraph=True, backend=self.counter)


_COMPILED: list[_Compiled] = []


def _compiled() -> _Compiled:
    if not _COMPILED:
        _COMPILED.append(_Compiled())
    return _COMPILED[0]


def test_compiled_every_index_one_graph() -> None:
    c = _compiled()
    x, d = _ops()
    for i in [-3, 0, 1, 2, 3, 4, 5, 6, 7, 99]:
        assert _close(c.fn(torch.tensor(i), x, d), switch_reference(i, BR8, (x, d)))
    assert c.counter.frame_count == 1, "recompiled for a new index value"
    # all 8 branches are in the graph: 7 conds in a balanced tree
    gm = c.counter.graphs[0]
    n_cond = sum(
        1
        for m in gm.modules()
        for nd in getattr(m, "graph", torch.fx.Graph()).nodes
        if nd.target is torch.ops.higher_order.cond
    )
    assert n_cond == 7


def test_compiled_autograd() -> None:
    c = _compiled()
    x, d = _ops()
    x1 = x.clone().requires_grad_(True)
    c.fn(torch.tensor(6), x1, d)["a"].sum().backward()
    x2 = x.clone().requires_grad_(True)
    BR8[6](x2, d)["a"].sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)  # type: ignore[arg-type]


def test_compiled_symint_index_no_recompile() -> None:
    counter = CompileCounterWithBackend("eager")
    f = torch.compile(lambda x, d: switch(x.shape[0] - 3, BR8, (x, d)), fullgraph=True, backend=counter, dynamic=True)
    d = {"y": torch.randn(4)}
    for n in [3, 4, 6, 9, 20]:
        x = torch.randn(n, 6)
        assert _close(f(x, d), switch_reference(n - 3, BR8, (x, d)))
    assert counter.frame_count == 1


def test_compiled_int_index_specialises() -> None:
    counter = CompileCounterWithBackend("eager")
    f = torch.compile(lambda k, x, d: switch(k, BR8, (x, d)), fullgraph=True, backend=counter)
    x, d = _ops()
    with pytest.warns(UserWarning, match="constant"):
        out = f(2, x, d)
    assert _close(out, BR8[2](x, d))
    gm = counter.graphs[0]
    assert not any(nd.target is torch.ops.higher_order.cond for nd in gm.graph.nodes), "int index must specialise"


def test_compiled_inductor_two_branches() -> None:
    f = torch.compile(lambda i, x, d: switch(i, BR8[:2], (x, d)), fullgraph=True, backend="inductor")
    x, d = _ops()
    for i in [0, 1, 5]:
        assert _close(f(torch.tensor(i), x, d), switch_reference(i, BR8[:2], (x, d)))


def test_compiled_mismatch_is_an_error() -> None:
    """Under tracing, torch.cond itself rejects branches with different output structure or dtype."""
    for bad in (lambda x: (x + 1, x), lambda x: x.double()):
        f = torch.compile(
            lambda i, x, bad=bad: switch(i, [lambda x: x + 1, bad], (x,)), fullgraph=True, backend="eager"
        )
        with pytest.raises(Exception, match=r"(?i)cond|branch|dtype|structure|output"):
            f(torch.tensor(0), torch.randn(3))


# ------------------------------------------------------------------------------------------------ export + save/load


class _Mod(torch.nn.Module):
    def forward(self, i: torch.Tensor, x: torch.Tensor, d: dict[str, torch.Tensor]) -> Any:
        return switch(i, BR8, (x, d))


@pytest.mark.parametrize("strict", [True, False])
def test_export_save_load(strict: bool) -> None:
    x, d = _ops()
    ep = torch.export.export(_Mod(), (torch.tensor(2), x, d), strict=strict)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for i in [-1, 0, 3, 7, 12]:
        expect = switch_reference(i, BR8, (x, d))
        assert _close(ep.module()(torch.tensor(i), x, d), expect)
        assert _close(loaded.module()(torch.tensor(i), x, d), expect)


# ------------------------------------------------------------------------------------------------ make_fx


@pytest.mark.parametrize("mode", ["real", "symbolic"])
def test_make_fx(mode: str) -> None:
    w = torch.randn(6, 6)
    branches = [lambda x, w, k=k: torch.relu(x @ w) * (k + 1) for k in range(4)]
    x = torch.randn(3, 6)
    gm = make_fx(lambda i, x, w: switch(i, branches, (x, w)), tracing_mode=mode)(torch.tensor(1), x, w)
    for i in [0, 2, 3, 10]:
        assert torch.allclose(gm(torch.tensor(i), x, w), switch_reference(i, branches, (x, w)))


# ------------------------------------------------------------------------------------------------ native (2.14+)


@pytest.mark.skipif(
    not hasattr(torch._higher_order_ops, "switch"), reason="native switch needs torch >= 2.14 (torch 2.13 installed)"
)
def test_matches_native_switch() -> None:  # pragma: no cover - needs torch 2.14
    native = torch._higher_order_ops.switch  # type: ignore[attr-defined]
    x, d = _ops()
    for i in [-3, 0, 4, 99]:
        assert _close(switch(torch.tensor(i), BR8, (x, d)), native(torch.tensor(i), BR8, (x, d)))
        assert _close(switch(i, BR8, (x, d)), native(i, BR8, (x, d)))


def test_error_base_class() -> None:
    assert issubclass(BranchMismatchError, SwitchError) and issubclass(SwitchError, RuntimeError)


def test_branch_check_cached_for_branches_rebuilt_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    mod = sys.modules["torchnext.control.switch"]
    calls = {"n": 0}
    real = mod._check_branches

    def counting(*a: Any) -> None:
        calls["n"] += 1
        real(*a)

    monkeypatch.setattr(mod, "_check_branches", counting)
    ws = [torch.randn(4, 4) for _ in range(3)]
    x = torch.randn(2, 4)
    for _ in range(5):  # a new list of new lambdas every call, as a forward() would build them
        out = switch(torch.tensor(1), [lambda x, w=w: x @ w for w in ws], (x,))
    assert torch.allclose(out, x @ ws[1])
    assert calls["n"] == 1
    switch(torch.tensor(1), [lambda x, w=w: x @ w for w in ws], (torch.randn(3, 4),))  # new shapes: checked again
    assert calls["n"] == 2
