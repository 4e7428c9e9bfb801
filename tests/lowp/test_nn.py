"""NVFP4Linear / MXFP8Linear and quantize_: error bound on a small MLP, state_dict round trip, modes, report."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from torchnext.lowp import FormatError, MXFP8Linear, NVFP4Linear, quantize_
from torchnext.lowp.nn import BlockScaledLinear

# relative L2 error bound of the MLP output vs fp32 (Gaussian init), per format and mode
BOUND = {("nvfp4", True): 0.2, ("nvfp4", False): 0.3, ("mxfp8_e4m3", True): 0.06, ("mxfp8_e4m3", False): 0.1}


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 40), nn.GELU(), nn.Linear(40, 8))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("weight_only", [True, False])
def test_quantize_mlp_within_bound_and_state_dict_round_trip(fmt: str, weight_only: bool) -> None:
    model = _mlp()
    x = torch.randn(5, 64)
    want = model(x).detach()
    report = quantize_(model, fmt, weight_only=weight_only, backend="eager")
    assert report.layers == ["0", "2", "4"]
    assert 0 < report.quantized_bytes < report.dense_bytes and report.saved_bytes > 0
    assert "saved" in str(report)
    cls = NVFP4Linear if fmt == "nvfp4" else MXFP8Linear
    assert all(isinstance(model[i], cls) for i in (0, 2, 4))
    y = model(x).detach()
    assert _rel(y, want) <= BOUND[(fmt, weight_only)]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = _mlp(seed=1)
    quantize_(fresh, fmt, weight_only=weight_only, backend="eager")
    assert not torch.equal(fresh(x), y)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(fresh(x).detach(), y)


def test_filter_fn_and_3d_input_and_bf16() -> None:
    model = _mlp().to(torch.bfloat16)
    report = quantize_(model, "nvfp4", filter_fn=lambda m, name: name != "4", backend="eager")
    assert report.layers == ["0", "2"] and type(model[4]) is nn.Linear
    y = model(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert y.shape == (2, 3, 8) and y.dtype == torch.bfloat16


def test_module_matches_direct_construction() -> None:
    lin = nn.Linear(48, 32)
    q = NVFP4Linear.from_linear(lin, backend="eager")
    fresh = NVFP4Linear(48, 32, backend="eager")
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(3, 48)
    assert torch.equal(fresh(x), q(x))
    assert "format=nvfp4" in repr(q)
    assert isinstance(q, BlockScaledLinear) and q.weight.shape == (32, 48)


def test_two_level_nvfp4_options_pass_through() -> None:
    lin = nn.Linear(32, 16)
    q = NVFP4Linear.from_linear(lin, backend="eager", recipe="te")
    assert q.weight_global_scale is not None and "weight_global_scale" in q.state_dict()
    x = torch.randn(2, 32)
    assert _rel(q(x).detach(), lin(x).detach()) < 0.2


def test_errors() -> None:
    with pytest.raises(FormatError, match="no Linear module for format"):
        quantize_(_mlp(), "mxfp4")
    with pytest.raises(FormatError, match="root module"):
        quantize_(nn.Linear(4, 4), "nvfp4")
    q = NVFP4Linear(32, 16, backend="eager")
    with pytest.raises(FormatError, match="input has 31 features"):
        q(torch.randn(2, 31))
