"""The TransformerEngine NVFP4 recipe against an independent per-block numpy + ml_dtypes implementation of the
published formula (TE core_nvfp4.cuh):

    S_enc = fmin(448 * 6 / amax, FLT_MAX); S_enc = 1 if amax == 0 or S_enc == 0
    s_b   = e4m3_satfinite(amax_b * (S_enc * fp32(1/6)))          # no lower clamp: zero scales allowed
    q_i   = e2m1_rne_satfinite(x_i * fmin(1 / (fp32(s_b) * (1 / S_enc)), FLT_MAX))
    decode scale = 1 / S_enc
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from lowp_data import distributions

from torchnext.lowp import quantize

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def _te_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    x = x.astype(np.float32).reshape(-1, 16)
    amax = F32(np.max(np.abs(x))) if x.size else F32(0)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(min(F32(F32(448.0) * F32(6.0)) / amax if amax != 0 else F32(np.inf), FLT_MAX))
    if amax == 0 or s_enc == 0:
        s_enc = F32(1.0)
    s_dec = F32(F32(1.0) / s_enc)
    sixth = F32(1.0) / F32(6.0)
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros(x.shape[0], dtype=np.uint8)
    for b in range(x.shape[0]):  # one block at a time: straightforward, independent of the vectorized code
        block_amax = F32(np.max(np.abs(x[b])))
        s = F32(block_amax * F32(s_enc * sixth))
        s8 = np.array([min(s, F32(448.0))], dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
        scales[b] = s8.view(np.uint8)[0]
        s_f = F32(s8.astype(np.float32)[0])
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            mult = F32(min(F32(F32(1.0) / F32(s_f * s_dec)), FLT_MAX))
            y = np.clip((x[b] * mult).astype(np.float32), -6.0, 6.0)
        codes[b] = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    packed = codes.reshape(-1, 2)
    return (packed[:, 0] | (packed[:, 1] << 4)).astype(np.uint8), scales, s_dec


@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_te_recipe_matches_independent_formula(backend: str) -> None:
    for name, x in distributions((32, 64), seed=3):
        for dtype in (torch.float32, torch.bfloat16):
            xx = x.to(dtype)
            q = quantize(xx, "nvfp4", recipe="te", backend=backend)
            codes, scales, s_dec = _te_reference(xx.float().numpy())
            assert np.array_equal(q.qdata.flatten().numpy(), codes), name
            assert np.array_equal(q.scale_bytes.flatten().numpy(), scales), name
            assert float(q.global_scale) == float(s_dec), name


def test_te_differs_from_torchao_on_wide_data() -> None:
    """The two recipes are different formats in practice: always name the recipe."""
    x = torch.randn(64, 256) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    te = quantize(x, "nvfp4", recipe="te")
    ao = quantize(x, "nvfp4", global_scale=True)
    assert not torch.equal(te.scale_bytes, ao.scale_bytes)
    assert (te.scale_bytes == 0).any()  # no lower clamp: tiny blocks get a zero scale
