"""The 16-point random Hadamard transform: orthogonal, invertible, the GEMM identity it is used for, and the
documented butterfly reproduced bit for bit by an independent numpy implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchnext.lowp.hadamard import hadamard_matrix, inverse_rht, rht, rht_plain, rht_reference, rht_signs


def _numpy_rht(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """The module docstring's loop, written again in numpy float32 along axis 0 (length a multiple of 16)."""
    out = np.empty_like(x, dtype=np.float32)
    for g in range(0, x.shape[0], 16):
        u = (x[g : g + 16].astype(np.float32) * signs[:, None].astype(np.float32)).astype(np.float32)
        for h in (1, 2, 4, 8):
            u = u.copy()
            for i in range(16):
                if i & h == 0:
                    a, b = u[i].copy(), u[i + h].copy()
                    u[i], u[i + h] = a + b, a - b
        out[g : g + 16] = u * np.float32(0.25)
    return out


def test_matrix_is_orthogonal_and_symmetric() -> None:
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.T, torch.eye(16, dtype=torch.float64))
    assert torch.equal(h, h.T)
    assert set(h.abs().unique().tolist()) == {0.25}


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_signs_are_a_function_of_the_seed(seed: int) -> None:
    s = rht_signs(seed)
    assert s.shape == (16,) and s.dtype == torch.float32
    assert set(s.tolist()) <= {1.0, -1.0}
    assert torch.equal(s, rht_signs(seed))
    assert any(not torch.equal(rht_signs(seed), rht_signs(seed + d)) for d in (1, 2, 3))


def test_butterfly_bits_match_numpy_and_dense_product() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 24, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 24), generator=g).float())
    s = rht_signs(7)
    y = rht(x, s, dim=0)
    assert np.array_equal(y.numpy(), _numpy_rht(x.numpy(), s.numpy()))
    dense = rht_reference(x, s, dim=0)
    assert torch.allclose(y.double(), dense, rtol=0, atol=1e-6 * float(x.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invertible_and_padding(dtype: torch.dtype) -> None:
    x = torch.randn(37, 5).to(dtype)  # 37 rows: padded to 48
    s = rht_signs(3)
    y = rht(x, s, dim=0)
    assert y.shape == (48, 5) and y.dtype == torch.float32
    back = inverse_rht(y, s, dim=0)
    assert torch.allclose(back[:37], x.float(), atol=1e-6)
    assert back[37:].abs().max() < 1e-6
    # along the last dim too
    assert torch.allclose(inverse_rht(rht(x, s, dim=1), s, dim=1)[:, :5], x.float(), atol=1e-6)
    # norm preserved per group (orthogonal)
    assert torch.allclose(y.norm(), x.float().norm(), rtol=1e-5)


def test_wgrad_identity() -> None:
    """rht(a).T @ rht(b) == a.T @ b: the transform may be applied to both wgrad operands along M."""
    a, b = torch.randn(50, 8, dtype=torch.float64), torch.randn(50, 6, dtype=torch.float64)
    s = rht_signs(11)
    ra, rb = rht_reference(a, s, dim=0), rht_reference(b, s, dim=0)
    assert torch.allclose(ra.T @ rb, a.T @ b, atol=1e-12)


def test_bad_signs() -> None:
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        rht(torch.randn(16, 2), torch.ones(8))
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        rht(torch.randn(16, 2), torch.full((16,), 0.5))
    with pytest.raises(ValueError, match="floating"):
        rht(torch.ones(16, 2, dtype=torch.int64), torch.ones(16))


@pytest.mark.parametrize(("shape", "dim"), [((37, 5), 0), ((37, 5), 1), ((4, 48, 3), 1), ((64, 64), -1), ((16,), 0)])
def test_row_wise_fast_path_equals_the_plain_butterfly(shape: tuple[int, ...], dim: int) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    s = rht_signs(9)
    assert torch.equal(rht(x, s, dim=dim), rht_plain(x, s, dim=dim))
