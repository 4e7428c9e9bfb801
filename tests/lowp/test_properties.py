"""Hypothesis properties: error bound, exactness/idempotence on representable values, swizzle round trip, backends
agree. Example counts are modest (CI has 2 cores)."""

from __future__ import annotations

import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchnext.lowp import Format, dequantize, format_spec, quantize, swizzle, unswizzle
from torchnext.lowp.scales import swizzle_reference

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMATS = [f.value for f in Format]
OPTS = {
    "nvfp4": [{}, {"global_scale": True}, {"recipe": "te"}],
    "mxfp8_e4m3": [{"scale_mode": "floor"}, {"scale_mode": "rceil"}],
    "mxfp8_e5m2": [{"scale_mode": "floor"}, {"scale_mode": "rceil"}],
    "mxfp4": [{"scale_mode": "floor"}, {"scale_mode": "rceil"}],
}


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 9))
    cols = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**31 - 1))
    log_range = draw(st.integers(0, 40))
    offset = draw(st.integers(-30, 30))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x = x * torch.exp2(torch.randint(-log_range, log_range + 1, (rows, cols), generator=g).float() + offset)
    return x


def _decode_factor(q) -> torch.Tensor:  # type: ignore[no-untyped-def]
    f = q.unswizzled_scales().float()
    if q.global_scale is not None:
        f = f * q.global_scale
    return f


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(FORMATS), which=st.integers(0, 2))
def test_error_within_format_bound(x: torch.Tensor, fmt: str, which: int) -> None:
    """|x - x̂| <= half an element ulp (relative 2**-(mbits+1), absolute below min_normal) times the block's decode
    factor, plus the saturation overshoot max(0, |x| - max * factor)."""
    opts = OPTS[fmt][which % len(OPTS[fmt])]
    q = quantize(x, fmt, **opts)
    el = format_spec(fmt).element
    xhat = q.dequantize()
    k, bs = x.shape[1], q.block_size
    d = _decode_factor(q).repeat_interleave(bs, dim=1)[:, :k]
    half = 2.0 ** -(el.mbits + 1)
    a = x.abs().double()
    bound = half * a * (1 + 1e-6) + d.double() * el.min_normal * half + (a - el.max_value * d.double()).clamp(min=0)
    err = (xhat.double() - x.double()).abs()
    ok = (err <= bound * (1 + 1e-6)) | (d == 0)  # te: a zero scale flushes its block (bound: the block amax)
    assert ok.all(), f"{fmt} {opts}: worst excess {(err - bound).max().item()}"
    # zero-scale blocks (te recipe only) hold only values far below the tensor's amax
    if (d == 0).any():
        assert (x.abs()[d == 0] <= x.abs().max() * 2.0**-9 * 6).all()


@st.composite
def representable(draw: st.DrawFn) -> tuple[str, torch.Tensor]:
    """Values exactly on a format's grid, each block holding ±max * scale so the scale is recovered exactly."""
    fmt = draw(st.sampled_from(FORMATS))
    spec = format_spec(fmt)
    el = spec.element
    blocks = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if el.torch_dtype is not None:
        codes = torch.randint(0, 256, (blocks, spec.block_size), generator=g, dtype=torch.uint8)
        vals = codes.view(el.torch_dtype).float().nan_to_num(0.0, 0.0, 0.0)
    else:
        from torchnext.lowp.elements import minifloat_grid

        grid = minifloat_grid(el)
        vals = grid[torch.randint(0, grid.numel(), (blocks, spec.block_size), generator=g)]
        vals = vals * (torch.randint(0, 2, vals.shape, generator=g) * 2 - 1)
    vals[:, 0] = el.max_value
    if spec.scale.value == "e4m3":
        scales = torch.randint(8, 126, (blocks, 1), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        scales = torch.exp2(torch.randint(-100, 100, (blocks, 1), generator=g).float())
    return fmt, (vals * scales)


@SETTINGS
@given(case=representable(), mode=st.sampled_from(["floor", "rceil"]))
def test_exact_and_idempotent_on_representable_values(case: tuple[str, torch.Tensor], mode: str) -> None:
    fmt, x = case
    opts = {} if fmt == "nvfp4" else {"scale_mode": mode}
    q = quantize(x, fmt, **opts)
    assert torch.equal(q.dequantize(), x)
    q2 = quantize(q.dequantize(), fmt, **opts)
    assert torch.equal(q2.qdata.view(torch.uint8), q.qdata.view(torch.uint8))
    assert torch.equal(q2.scale_bytes, q.scale_bytes)


@SETTINGS
@given(rows=st.integers(1, 300), cols=st.integers(1, 40), seed=st.integers(0, 1000))
def test_swizzle_roundtrip(rows: int, cols: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sw = swizzle(s)
    assert torch.equal(sw.view(torch.uint8), swizzle_reference(s).view(torch.uint8))
    assert torch.equal(unswizzle(sw, rows, cols).view(torch.uint8), s.view(torch.uint8))


def test_swizzle_matches_torchao_to_blocked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.utils import to_blocked
    for rows, cols in [(1, 1), (128, 4), (130, 7), (300, 33)]:
        s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
        assert torch.equal(swizzle(s).flatten(), to_blocked(s).flatten())


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(FORMATS), which=st.integers(0, 2), swz=st.booleans())
def test_backends_agree(x: torch.Tensor, fmt: str, which: int, swz: bool) -> None:
    opts = OPTS[fmt][which % len(OPTS[fmt])]
    a = quantize(x, fmt, backend="reference", swizzle=swz, **opts)
    b = quantize(x, fmt, backend="eager", swizzle=swz, **opts)
    assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
    assert torch.equal(a.scale_bytes, b.scale_bytes)
    assert torch.equal(dequantize(a, backend="reference"), dequantize(b, backend="eager"))
