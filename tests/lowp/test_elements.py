"""Element codecs against ml_dtypes, and the fast codecs against the reference ones."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from torchnext.lowp.elements import (
    decode_reference,
    encode_fast,
    encode_reference,
    minifloat_grid,
    pack_nibbles,
    unpack_nibbles,
)
from torchnext.lowp.formats import E2M1, E4M3, E5M2, ElementKind, ElementSpec

ML = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _inputs(spec: ElementSpec) -> torch.Tensor:
    """Values in [-max, max]: random over many binades, every grid point, every midpoint and its neighbours."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 10, (4096,), generator=g).float())
    if spec.kind is ElementKind.MINIFLOAT:
        grid = minifloat_grid(spec)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(spec.torch_dtype).float()
        grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    vals = torch.cat([rand, grid, near, torch.tensor([0.0, -0.0])])
    vals = torch.cat([vals, -vals])
    n = vals.numel() // 32 * 32
    return vals[:n].clamp(-spec.max_value, spec.max_value)


def _ml_codes(y: torch.Tensor, spec: ElementSpec) -> torch.Tensor:
    arr = y.numpy().astype(ML[spec.name])
    return torch.from_numpy(arr.view(np.uint8).copy())


@pytest.mark.parametrize("spec", [E2M1, E4M3, E5M2], ids=lambda s: s.name)
def test_encode_matches_ml_dtypes(spec: ElementSpec) -> None:
    y = _inputs(spec)
    want = _ml_codes(y, spec)
    ref = encode_reference(y, spec).view(torch.uint8)
    assert torch.equal(ref, want)
    out_dtype = spec.torch_dtype if spec.torch_dtype is not None else torch.uint8
    out = torch.empty(y.numel() // 32, 32 // spec.per_byte, dtype=out_dtype)
    encode_fast(y.clone().view(-1, 32), spec, out)
    expect = pack_nibbles(want.view(-1, 32)) if spec.per_byte == 2 else want.view(-1, 32)
    assert torch.equal(out.view(torch.uint8), expect)


@pytest.mark.parametrize("spec", [E2M1, E4M3, E5M2], ids=lambda s: s.name)
def test_decode_matches_ml_dtypes(spec: ElementSpec) -> None:
    codes = torch.arange(1 << spec.bits, dtype=torch.uint8)
    want = torch.from_numpy(codes.numpy().view(ML[spec.name]).astype(np.float32))
    got = decode_reference(codes.view(spec.torch_dtype) if spec.torch_dtype else codes, spec)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])


def test_fp4_midpoints() -> None:
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.2500001, 5.9, -0.1])
    got = decode_reference(encode_reference(y, E2M1), E2M1)
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, 6.0, -0.0]
    assert encode_reference(torch.tensor([-0.1]), E2M1).item() == 8  # the sign survives rounding to zero


def test_pack_unpack_roundtrip() -> None:
    codes = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (7, 5)
    assert torch.equal(packed & 15, codes[:, 0::2])  # element 2i in the low nibble
    assert torch.equal(unpack_nibbles(packed), codes)


def test_nan_and_saturation_codes() -> None:
    y = torch.tensor([float("nan"), -float("nan"), 6.0, -6.0] * 8).view(1, 32)
    out = torch.empty(1, 16, dtype=torch.uint8)
    encode_fast(y.clone(), E2M1, out)
    assert torch.equal(unpack_nibbles(out).flatten()[:4], torch.tensor([7, 15, 7, 15], dtype=torch.uint8))
    assert torch.equal(encode_reference(y, E2M1).flatten()[:4], torch.tensor([7, 15, 7, 15], dtype=torch.uint8))
