"""Scratch memory and fresh outputs (torchnext.lowp.workspace), and the paths that use them: decoded operands in
scratch, in-place epilogues, huge-page outputs. Every fast path must give the same bits as the plain one and never
hand scratch memory to the caller or to autograd."""

from __future__ import annotations

import threading

import pytest
import torch

from torchnext._config import env_config
from torchnext.lowp import Epilogue, grouped_scaled_mm, quantize, register_activation, scaled_mm
from torchnext.lowp import workspace as ws
from torchnext.lowp.mm.decode import dequantize_operand
from torchnext.lowp.mm.epilogue import ACTIVATIONS, INPLACE_ACTIVATIONS, apply_epilogue
from torchnext.lowp.mm.grouped import grouped_reference


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from 0.0 and compares NaN payloads)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.contiguous().view(ints[x.dtype]), y.contiguous().view(ints[y.dtype])
    )


@pytest.fixture
def pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool every request and advise huge pages for every fresh tensor, so small test tensors take the fast paths."""
    monkeypatch.setattr(ws, "MIN_BYTES", 0)
    monkeypatch.setattr(ws, "HUGE_MIN_BYTES", 0)
    ws.release_workspace()
    yield
    ws.release_workspace()


def test_scratch_reuses_memory_per_tag_dtype_and_thread(pooled: None) -> None:
    a = ws.scratch("x", 100, torch.float32)
    b = ws.scratch("x", 60, torch.float32)
    assert a.data_ptr() == b.data_ptr() and b.numel() == 60
    assert ws.scratch("y", 100, torch.float32).data_ptr() != a.data_ptr()
    assert ws.scratch("x", 100, torch.int32).data_ptr() != a.data_ptr()
    grown = ws.scratch("x", 1000, torch.float32)  # grows: a new buffer
    assert grown.numel() == 1000 and ws.scratch("x", 10, torch.float32).data_ptr() == grown.data_ptr()
    other: list[int] = []
    th = threading.Thread(target=lambda: other.append(ws.scratch("x", 1000, torch.float32).data_ptr()))
    th.start()
    th.join(timeout=30)
    assert other and other[0] != grown.data_ptr()
    assert ws.workspace_bytes() >= 1000 * 4
    ws.release_workspace()
    assert ws.workspace_bytes() == 0


def test_small_requests_are_plain_allocations() -> None:
    ws.release_workspace()
    a = ws.scratch("small", 16, torch.float32)
    b = ws.scratch("small", 16, torch.float32)
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a[0]) == 1.0  # not shared
    assert ws.workspace_bytes() == 0


def test_reusable_follows_autograd() -> None:
    x = torch.randn(3, requires_grad=True)
    assert ws.reusable(torch.randn(3))
    assert not ws.reusable(x, torch.randn(3))
    with torch.no_grad():
        assert ws.reusable(x)


def test_fresh_is_new_memory_and_advises_huge_pages(pooled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    t1 = ws.fresh((1024, 1024), torch.float32)
    t2 = ws.fresh((1024, 1024), torch.float32)
    assert t1.shape == (1024, 1024) and t1.dtype == torch.float32 and t1.data_ptr() != t2.data_ptr()
    calls: list[int] = []
    monkeypatch.setattr(ws, "advise_huge_pages", lambda t: calls.append(t.numel()) or True)
    ws.fresh((8, 8), torch.float32)
    assert calls == [64]
    monkeypatch.setenv("TORCHNEXT_HUGE_PAGES", "0")
    ws.fresh((8, 8), torch.float32)
    assert calls == [64]


def test_advise_huge_pages_on_large_tensor() -> None:
    import sys

    t = torch.empty(8 << 20, dtype=torch.uint8)  # 8 MiB: at least three whole aligned 2 MiB pages inside
    ok = ws.advise_huge_pages(t)
    if sys.platform.startswith("linux"):
        assert ok  # madvise(MADV_HUGEPAGE) is accepted even where THP is "never" (it is advice)
    t.fill_(7)
    assert int(t[-1]) == 7
    assert not ws.advise_huge_pages(torch.empty(16, dtype=torch.uint8))  # no whole huge page inside


def test_huge_pages_env_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHNEXT_HUGE_PAGES", "2")
    with pytest.raises(ValueError, match="TORCHNEXT_HUGE_PAGES"):
        env_config()


_DECODE_CASES = [(f, d, True) for f in ("nvfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4") for d in (torch.float32, torch.bfloat16)]
_DECODE_CASES += [("nvfp4", d, False) for d in (torch.float32, torch.bfloat16)]  # only NVFP4 has a global scale


@pytest.mark.parametrize(("fmt", "dtype", "with_gs"), _DECODE_CASES)
def test_decode_into_scratch_is_bitwise_the_plain_decode(pooled: None, fmt: str, dtype: torch.dtype, with_gs: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(3, 40, 64, generator=g) * 5, fmt)
    plain = dequantize_operand(q, dtype, with_global_scale=with_gs)
    s1 = dequantize_operand(q, dtype, with_global_scale=with_gs, scratch_tag="t")
    assert same_bits(plain, s1)
    q2 = quantize(torch.randn(3, 40, 64, generator=g), fmt)
    s2 = dequantize_operand(q2, dtype, with_global_scale=with_gs, scratch_tag="t")
    assert s2.data_ptr() == s1.data_ptr()  # the same memory, overwritten
    assert same_bits(s2, dequantize_operand(q2, dtype, with_global_scale=with_gs))


def _epilogues(m: int, n: int) -> list[Epilogue]:
    g = torch.Generator().manual_seed(2)
    return [
        Epilogue(),
        Epilogue(scale=0.5, bias=torch.randn(n, generator=g), activation="gelu"),
        Epilogue(scale=torch.rand(m, 1, generator=g), activation="gelu_tanh", residual=torch.randn(m, n, generator=g)),
        Epilogue(scale=torch.rand(n, generator=g), bias=torch.randn(n, generator=g), activation="silu", output_amax=True),
        Epilogue(bias=torch.randn(n, generator=g), activation="relu", out_dtype=torch.bfloat16),
    ]


def test_inplace_epilogue_same_bits() -> None:
    g = torch.Generator().manual_seed(3)
    for ep in _epilogues(17, 24):
        acc = torch.randn(17, 24, generator=g) * 3
        ref = apply_epilogue(acc.clone(), ep, torch.float32 if ep.out_dtype is None else ep.out_dtype)
        got = apply_epilogue(acc, ep, torch.float32 if ep.out_dtype is None else ep.out_dtype, inplace=True)
        assert same_bits(got.output, ref.output), ep.activation
        if ep.output_amax:
            assert got.amax is not None and ref.amax is not None and torch.equal(got.amax, ref.amax)
    assert set(INPLACE_ACTIVATIONS) >= {"relu", "gelu", "gelu_tanh", "silu"}


def test_inplace_epilogue_custom_activation_and_autograd() -> None:
    register_activation("tn_test_square", lambda y: y * y, overwrite=True)
    try:
        acc = torch.randn(4, 5)
        ep = Epilogue(activation="tn_test_square")
        ref = apply_epilogue(acc.clone(), ep, torch.float32).output
        assert torch.equal(apply_epilogue(acc, ep, torch.float32, inplace=True).output, ref)  # out-of-place fallback
        register_activation("tn_test_square", lambda y: y * y, inplace=lambda y: y.mul_(y), overwrite=True)
        acc = torch.randn(4, 5)
        assert torch.equal(apply_epilogue(acc.clone(), ep, torch.float32, inplace=True).output, acc * acc)
    finally:
        ACTIVATIONS.pop("tn_test_square", None)
        INPLACE_ACTIVATIONS.pop("tn_test_square", None)
    leaf = torch.randn(4, 5, requires_grad=True)
    acc = leaf * 1.0
    before = acc.detach().clone()
    out = apply_epilogue(acc, Epilogue(activation="silu"), torch.float32, inplace=True).output
    assert torch.equal(acc.detach(), before)  # autograd tracks acc: computed out of place
    out.sum().backward()
    assert leaf.grad is not None


def _moe(e: int = 5, t: int = 57, n: int = 40, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, object, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([11, 0, 30, 3, 13])[:e]
    assert int(sizes.sum()) == t
    return torch.randn(t, k, generator=g), quantize(torch.randn(e, n, k, generator=g), "nvfp4"), sizes.cumsum(0)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_grouped_fast_path_same_bits_and_no_aliasing(pooled: None, compute_dtype: torch.dtype) -> None:
    a, w, offs = _moe()
    ep = Epilogue(bias=torch.randn(40), activation="silu")
    with torch.no_grad():
        y1 = grouped_scaled_mm(a, w, offs, epilogue=ep, compute_dtype=compute_dtype)  # type: ignore[arg-type]
    a_g = a.clone().requires_grad_(True)
    y_plain = grouped_scaled_mm(a_g, w, offs, epilogue=ep, compute_dtype=compute_dtype)  # type: ignore[arg-type]
    assert isinstance(y1, torch.Tensor) and isinstance(y_plain, torch.Tensor)
    assert same_bits(y1, y_plain.detach())
    keep = y1.clone()
    a2, w2, _ = _moe(seed=1)
    with torch.no_grad():
        y2 = grouped_scaled_mm(a2, w2, offs, epilogue=ep, compute_dtype=compute_dtype)  # type: ignore[arg-type]
    assert torch.equal(y1, keep)  # the second call's scratch did not touch the first output
    assert isinstance(y2, torch.Tensor) and not torch.equal(y2, y1)
    if compute_dtype == torch.float32:
        torch.testing.assert_close(y2, grouped_reference(a2, w2, offs, epilogue=ep), rtol=1e-5, atol=1e-5)  # type: ignore[arg-type]


def test_grouped_backward_never_sees_scratch(pooled: None) -> None:
    a, w, offs = _moe()
    a1 = a.clone().requires_grad_(True)
    y = grouped_scaled_mm(a1, w, offs, epilogue=Epilogue(activation="gelu"))
    assert isinstance(y, torch.Tensor)
    with torch.no_grad():  # a call in between that does use scratch
        grouped_scaled_mm(*_moe(seed=2), epilogue=Epilogue(activation="gelu"))  # type: ignore[arg-type]
    y.sum().backward()
    a2 = a.clone().requires_grad_(True)
    grouped_reference(a2, w, offs, epilogue=Epilogue(activation="gelu"), backend="eager").sum().backward()  # type: ignore[arg-type]
    assert a1.grad is not None and a2.grad is not None
    torch.testing.assert_close(a1.grad, a2.grad, rtol=1e-5, atol=1e-5)


def test_eager_scaled_mm_fast_path_same_bits(pooled: None) -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(9, 64, generator=g)
    wq = quantize(torch.randn(24, 64, generator=g), "nvfp4")
    aq = quantize(a, "mxfp8_e4m3")
    ep = Epilogue(bias=torch.randn(24, generator=g), activation="gelu", output_amax=True)
    for lhs in (a, aq):
        with torch.no_grad():
            r1 = scaled_mm(lhs, wq, epilogue=ep, backend="eager")
        r_plain = scaled_mm(lhs if not isinstance(lhs, torch.Tensor) else lhs.clone().requires_grad_(True), wq, epilogue=ep,
                            backend="eager")
        assert same_bits(r1.output, r_plain.output.detach())  # type: ignore[union-attr]
        keep = r1.output.clone()  # type: ignore[union-attr]
        with torch.no_grad():
            scaled_mm(torch.randn(9, 64), quantize(torch.randn(24, 64), "nvfp4"), epilogue=ep, backend="eager")
        assert torch.equal(r1.output, keep)  # type: ignore[union-attr]


def test_cast_into_scratch(pooled: None) -> None:
    x = torch.randn(5, 7)
    assert ws.cast(x, torch.float32, "c") is x  # same dtype: no copy
    y = ws.cast(x, torch.bfloat16, "c")
    assert y.shape == x.shape and torch.equal(y, x.to(torch.bfloat16))
    assert ws.cast(x * 2, torch.bfloat16, "c").data_ptr() == y.data_ptr()  # reused
    assert ws.cast(x, torch.bfloat16).data_ptr() != y.data_ptr()  # untagged: fresh
