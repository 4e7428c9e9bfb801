"""quantize_pair: the two training copies, each from the high-precision tensor; 2-D tiles; RHT on the columnwise
copy; dispatch to a kernel's quantize_pair_blocks under the documented contract."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from torchnext.lowp import FormatError, QuantOptions, quantize, quantize_pair
from torchnext.lowp.hadamard import rht, rht_signs
from torchnext.lowp.quantizers import QUANTIZERS, register_quantizer
from torchnext.lowp.quantizers import reference as ref_kernel

TE = QuantOptions(recipe="te")
RCEIL = QuantOptions(scale_mode="rceil")


def _same(a: object, b: object) -> bool:
    qa, qb = a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)  # type: ignore[attr-defined]
    return (
        torch.equal(qa, qb)
        and torch.equal(a.scale_bytes, b.scale_bytes)  # type: ignore[attr-defined]
        and a.shape == b.shape and a.block_dim == b.block_dim  # type: ignore[attr-defined]
        and (a.global_scale is None) == (b.global_scale is None)  # type: ignore[attr-defined]
        and (a.global_scale is None or float(a.global_scale) == float(b.global_scale))  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize(("fmt", "opts"), [("nvfp4", TE), ("mxfp8_e4m3", RCEIL)])
@pytest.mark.parametrize("shape", [(64, 96), (37, 45)])
def test_copies_are_two_quantizations_of_the_input(fmt: str, opts: QuantOptions, shape: tuple[int, int]) -> None:
    x = torch.randn(*shape).to(torch.bfloat16)
    col_opts = opts.with_(rounding="stochastic", seed=5)
    row, col = quantize_pair(x, fmt, options=opts, col_options=col_opts)
    assert _same(row, quantize(x, fmt, dim=1, options=opts))
    assert _same(col, quantize(x, fmt, dim=0, options=col_opts))
    assert col.t().shape == (shape[1], shape[0]) and col.t().block_dim == 1
    assert row.orig_dtype == col.orig_dtype == torch.bfloat16


def test_rht_column_copy_amax_after_the_transform() -> None:
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(0))
    x[3, 4] = 50.0  # an outlier: the transform spreads it, so the column amax shrinks
    s = rht_signs(2)
    row, col = quantize_pair(x, "nvfp4", options=TE, rht_signs=s)
    xt = rht(x, s, dim=0)
    assert col.shape == (48, 32)  # M padded to 16 before the transform
    assert _same(col, quantize(xt, "nvfp4", dim=0, options=TE))
    # TE's formula in fp32: S = 2688 / amax (a true division; torch's `2688.0 / t` multiplies by a reciprocal)
    s_enc = np.float32(2688.0) / np.float32(xt.abs().max().item())
    assert float(col.global_scale) == float(np.float32(1.0) / s_enc)
    assert float(col.global_scale) < float(row.global_scale)
    assert _same(row, quantize(x, "nvfp4", options=TE))


@pytest.mark.parametrize(("fmt", "opts"), [("nvfp4", TE), ("mxfp8_e4m3", RCEIL), ("nvfp4", QuantOptions())])
def test_2d_tiles_give_both_copies_the_same_values(fmt: str, opts: QuantOptions) -> None:
    x = torch.randn(70, 90) * torch.exp2(torch.randint(-6, 6, (70, 1)).float())
    row, col = quantize_pair(x, fmt, options=opts, block_2d=True)
    assert row.shape == col.shape == x.shape and (row.block_dim, col.block_dim) == (1, 0)
    assert torch.equal(row.dequantize(), col.dequantize())
    b = row.block_size
    # one scale per tile: the row scales repeat down each tile's rows
    rs = row.scale_bytes
    for t in range(0, 70, b):
        assert (rs[t : t + b] == rs[t]).all()
    # the tile scale comes from the tile's amax (bigger than any of its rows' amax somewhere)
    assert not torch.equal(row.scale_bytes, quantize(x, fmt, options=opts).scale_bytes)
    # swizzled scales work too
    rsw, csw = quantize_pair(x, fmt, options=opts.with_(swizzle=True), block_2d=True)
    assert torch.equal(rsw.dequantize(), row.dequantize()) and torch.equal(csw.dequantize(), col.dequantize())


def test_errors() -> None:
    with pytest.raises(FormatError, match="2-D"):
        quantize_pair(torch.randn(2, 3, 32), "nvfp4")
    with pytest.raises(FormatError, match="block_2d"):
        quantize_pair(torch.randn(32, 32), "nvfp4", block_2d=True, rht_signs=rht_signs(0))
    with pytest.raises(FormatError, match="one set of options"):
        quantize_pair(torch.randn(32, 32), "nvfp4", block_2d=True, col_options=TE)
    with pytest.raises(FormatError, match=r"shape \(16,\)"):
        quantize_pair(torch.randn(32, 32), "nvfp4", rht_signs=torch.ones(4))
    with pytest.raises(FormatError, match="float32, bfloat16, float16"):
        quantize_pair(torch.ones(32, 32, dtype=torch.int32), "nvfp4")


# ------------------------------------------------------------------------------------ the kernel-side contract

CALLS: list[str] = []


def _pair_blocks(x, spec, row_ro, col_ro, row_inp, col_inp, signs):  # type: ignore[no-untyped-def]
    """The contract of torchnext.lowp.pair implemented plainly: x2 of x (padded along K) and of x.T (or of the
    transformed x.T, padded along M), the reference kernel on each."""
    CALLS.append("pair")
    if x.shape[0] == 3:
        return None  # declining is allowed
    b = spec.block_size
    m, k = x.shape
    xr = torch.nn.functional.pad(x, (0, -k % b))
    rc, rs = ref_kernel.quantize_blocks(xr.reshape(-1, b), spec, row_ro, row_inp, row_ro.noise)
    xc = rht(x, signs, dim=0) if signs is not None else x
    xct = xc.t()
    xct = torch.nn.functional.pad(xct, (0, -xct.shape[1] % b)).contiguous()
    cc, cs = ref_kernel.quantize_blocks(xct.reshape(-1, b), spec, col_ro, col_inp, col_ro.noise)
    return rc.reshape(m, -1), rs.view(torch.uint8), cc.reshape(k, -1), cs.view(torch.uint8)


@pytest.fixture
def pair_kernel() -> Iterator[str]:
    mod = types.ModuleType("_pairtest_kernel")
    mod.quantize_blocks = ref_kernel.quantize_blocks  # type: ignore[attr-defined]
    mod.dequantize_blocks = ref_kernel.dequantize_blocks  # type: ignore[attr-defined]
    mod.quantize_pair_blocks = _pair_blocks  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    register_quantizer("pairtest", mod.__name__)
    CALLS.clear()
    try:
        yield "pairtest"
    finally:
        QUANTIZERS.pop("pairtest", None)
        sys.modules.pop(mod.__name__, None)


@pytest.mark.parametrize(("fmt", "opts"), [("nvfp4", TE), ("mxfp8_e4m3", RCEIL)])
@pytest.mark.parametrize("with_rht", [False, True])
def test_dispatch_to_quantize_pair_blocks(pair_kernel: str, fmt: str, opts: QuantOptions, with_rht: bool) -> None:
    x = torch.randn(37, 45).to(torch.bfloat16)
    s = rht_signs(4) if with_rht else None
    ro = opts.with_(rounding="stochastic", seed=1, offset=3)
    co = opts.with_(rounding="stochastic", seed=2)
    want = quantize_pair(x, fmt, options=ro, col_options=co, rht_signs=s)
    got = quantize_pair(x, fmt, options=ro.with_(backend=pair_kernel), col_options=co.with_(backend=pair_kernel),
                        rht_signs=s)
    assert CALLS == ["pair"]
    assert _same(got[0], want[0]) and _same(got[1], want[1])
    # a declined call takes the torch path with the same kernel's quantize_blocks
    small = torch.randn(3, 32)
    got = quantize_pair(small, fmt, options=opts.with_(backend=pair_kernel))
    assert CALLS == ["pair", "pair"]
    assert _same(got[1], quantize(small, fmt, dim=0, options=opts))


def test_given_amax_makes_shards_quantize_as_the_whole() -> None:
    """QuantOptions(amax=...): the all-reduced amax of a sharded tensor gives each shard the whole's bytes."""
    x = torch.randn(64, 48)
    amax = x.abs().max()
    whole = quantize_pair(x, "nvfp4", options=TE, block_2d=True)
    for rows in (slice(0, 32), slice(32, 64)):
        part = quantize_pair(x[rows], "nvfp4", options=TE.with_(amax=amax), block_2d=True)
        assert torch.equal(part[0].qdata, whole[0].qdata[rows])
        assert torch.equal(part[0].scale_bytes, whole[0].scale_bytes[rows])
        assert float(part[0].global_scale) == float(whole[0].global_scale)
    with pytest.raises(FormatError, match="amax applies to NVFP4"):
        quantize(x, "mxfp8_e4m3", amax=1.0)
    with pytest.raises(FormatError, match="computed global scale"):
        quantize(x, "nvfp4", recipe="te", global_scale=0.5, amax=1.0)
