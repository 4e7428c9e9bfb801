"""Epilogue semantics: documented order, amax, output quantization, validation, activation registry."""

from __future__ import annotations

import pytest
import torch

from torchnext.lowp import Epilogue, EpilogueError, quantize, register_activation
from torchnext.lowp.mm.epilogue import ACTIVATIONS, apply_epilogue


def _inputs(m: int = 6, n: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "acc": torch.randn(m, n, generator=g) * 3,
        "col": torch.rand(n, generator=g) + 0.5,
        "row": torch.rand(m, 1, generator=g) + 0.5,
        "bias": torch.randn(n, generator=g),
        "res": torch.randn(m, n, generator=g),
    }


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("scale_kind", ["scalar", "row", "col"])
def test_order_is_scale_bias_act_residual(act: str, scale_kind: str) -> None:
    t = _inputs()
    scale = {"scalar": 0.75, "row": t["row"], "col": t["col"]}[scale_kind]
    ep = Epilogue(scale=scale, bias=t["bias"], activation=act, residual=t["res"], output_amax=True)
    out = apply_epilogue(t["acc"], ep, torch.float32)
    fn = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
          "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh")}[act]
    want = fn(t["acc"] * scale + t["bias"]) + t["res"]
    torch.testing.assert_close(out.output, want, rtol=0, atol=1e-6)
    assert out.amax is not None and float(out.amax) == float(out.output.abs().max())
    # another order (residual before the activation) gives a different result: the test can tell them apart
    other = fn(t["acc"] * scale + t["bias"] + t["res"])
    assert (other - want).abs().max() > 1e-2


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3"])
def test_output_quantization_is_quantize_of_fp32_y(fmt: str) -> None:
    t = _inputs(n=64)
    ep = Epilogue(bias=t["bias"][:1].expand(64).contiguous(), activation="silu", out_format=fmt, out_dtype=torch.bfloat16)
    out = apply_epilogue(t["acc"], ep, torch.bfloat16)
    y = torch.nn.functional.silu(t["acc"] + ep.bias)
    q = quantize(y, fmt, dim=-1)
    assert out.quantized is not None
    assert torch.equal(out.quantized.qdata.view(torch.uint8), q.qdata.view(torch.uint8))
    assert torch.equal(out.quantized.scale_bytes, q.scale_bytes)
    assert out.output.dtype == torch.bfloat16
    assert torch.equal(out.output, y.to(torch.bfloat16))


def test_amax_nan_and_empty() -> None:
    acc = torch.tensor([[1.0, float("nan")], [3.0, -4.0]])
    out = apply_epilogue(acc, Epilogue(output_amax=True), torch.float32)
    assert out.amax is not None and torch.isnan(out.amax)
    out = apply_epilogue(torch.zeros(0, 5), Epilogue(output_amax=True), torch.float32)
    assert out.amax is not None and float(out.amax) == 0.0


def test_validation_errors() -> None:
    with pytest.raises(EpilogueError, match="unknown activation"):
        Epilogue(activation="swish9")
    with pytest.raises(ValueError, match="unknown block-scaled format"):
        Epilogue(out_format="fp3")
    with pytest.raises(EpilogueError, match="out_dtype"):
        Epilogue(out_dtype=torch.int32)
    ep = Epilogue(bias=torch.zeros(7))
    with pytest.raises(EpilogueError, match=r"bias must be a \(8,\)"):
        ep.check(2, 8)
    with pytest.raises(EpilogueError, match=r"residual must be an \(2, 8\)"):
        Epilogue(residual=torch.zeros(8, 2)).check(2, 8)
    with pytest.raises(EpilogueError, match=r"per-row scale must have shape \(2, 1\)"):
        Epilogue(scale=torch.ones(3, 1)).check(2, 8)
    with pytest.raises(EpilogueError, match="scale must be finite"):
        Epilogue(scale=float("inf")).check(2, 8)


def test_signature_and_features() -> None:
    ep = Epilogue(scale=torch.ones(4), bias=torch.zeros(4), activation="relu", output_amax=True, out_format="nvfp4")
    assert ep.signature() == "scale:col,bias,act:relu,amax,q:nvfp4"
    assert ep.features == {"scale", "bias", "activation", "amax", "out_format"}
    assert Epilogue().signature() == "none"


def test_register_activation() -> None:
    register_activation("test_square", lambda y: y * y)
    try:
        with pytest.raises(EpilogueError, match="already registered"):
            register_activation("test_square", torch.relu)
        out = apply_epilogue(torch.tensor([[2.0, -3.0]]), Epilogue(activation="test_square"), torch.float32)
        assert out.output.tolist() == [[4.0, 9.0]]
    finally:
        ACTIVATIONS.pop("test_square")
