"""Adding a format is one registry entry: MXFP6 (E2M3, E3M2) defined here, bit-exact with torchao's FP6 to_mx."""

from __future__ import annotations

import warnings

import pytest
import torch
from lowp_data import distributions

from torchnext.lowp import ElementKind, ElementSpec, FormatSpec, ScaleKind, quantize

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    ao_const = pytest.importorskip("torchao.prototype.mx_formats.constants")

E2M3 = ElementSpec(name="e2m3", kind=ElementKind.MINIFLOAT, bits=6, ebits=2, mbits=3, max_value=7.5, min_normal=1.0, emax=2)
E3M2 = ElementSpec(name="e3m2", kind=ElementKind.MINIFLOAT, bits=6, ebits=3, mbits=2, max_value=28.0, min_normal=0.25, emax=4)
MXFP6 = {
    "e2m3": (FormatSpec(name="mxfp6_e2m3", element=E2M3, block_size=32, scale=ScaleKind.E8M0, two_level=False), ao_const.DTYPE_FP6_E2M3),
    "e3m2": (FormatSpec(name="mxfp6_e3m2", element=E3M2, block_size=32, scale=ScaleKind.E8M0, two_level=False), ao_const.DTYPE_FP6_E3M2),
}


@pytest.mark.parametrize("backend", ["reference", "eager"])
@pytest.mark.parametrize("kind", ["e2m3", "e3m2"])
def test_mxfp6_is_one_entry_and_matches_torchao(kind: str, backend: str) -> None:
    spec, ao_dtype = MXFP6[kind]
    for name, x in distributions((64, 64), seed=5):
        scale, data = ao_mx.to_mx(x, ao_dtype, 32)
        q = quantize(x, spec, backend=backend)
        assert torch.equal(q.qdata, data.view(torch.uint8)), name
        assert torch.equal(q.scale_bytes.flatten(), scale.view(torch.uint8).flatten()), name
        assert q.format == spec.name
    x = torch.randn(16, 64)
    q = quantize(x, spec, backend=backend)
    torch.testing.assert_close(q.dequantize(), q.dequantize(backend="reference"), rtol=0, atol=0)
    assert (q.dequantize() - x).abs().max() <= x.abs().max() * 0.25
