"""BlockScaledTensor: serialization, transpose, layout changes, repr, nbytes, device moves."""

from __future__ import annotations

import io

import pytest
import torch

from torchnext.lowp import BlockScaledTensor, Format, FormatError, quantize

ALL = [f.value for f in Format]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("swizzle", [False, True])
def test_save_load_roundtrip(fmt: str, swizzle: bool) -> None:
    x = torch.randn(3, 40, 70)
    q = quantize(x, fmt, swizzle=swizzle, dim=1, **({"global_scale": True} if fmt == "nvfp4" else {}))
    buf = io.BytesIO()
    torch.save({"w": q.to_dict()}, buf)
    buf.seek(0)
    d = torch.load(buf, weights_only=True)["w"]  # no custom classes needed to load
    r = BlockScaledTensor.from_dict(d)
    assert r.shape == q.shape and r.block_dim == 1 and r.swizzled == swizzle and r.format == Format(fmt)
    assert torch.equal(r.dequantize(), q.dequantize())
    assert r.recipe == q.recipe and r.scale_mode == q.scale_mode


def test_from_dict_rejects_inconsistent_data() -> None:
    d = quantize(torch.randn(4, 32), "nvfp4").to_dict()
    with pytest.raises(FormatError, match="qdata shape"):
        BlockScaledTensor.from_dict({**d, "shape": [4, 64]})
    with pytest.raises(FormatError, match="version"):
        BlockScaledTensor.from_dict({**d, "version": 99})
    with pytest.raises(FormatError, match="unknown block-scaled format"):
        BlockScaledTensor.from_dict({**d, "format": "fp3"})
    with pytest.raises(FormatError, match="scales dtype"):
        BlockScaledTensor.from_dict({**d, "scales": d["scales"].view(torch.uint8)})


@pytest.mark.parametrize("fmt", ALL)
def test_transpose_is_metadata_only(fmt: str) -> None:
    w = torch.randn(24, 64)  # (N, K), blocks along K
    q = quantize(w, fmt)
    qt = q.t()
    assert qt.shape == (64, 24) and qt.block_dim == 0
    assert qt.qdata is q.qdata
    assert torch.equal(qt.dequantize(), q.dequantize().t())
    assert torch.equal(qt.t().dequantize(), q.dequantize())
    with pytest.raises(FormatError, match="2-D"):
        quantize(torch.randn(2, 3, 32), fmt).t()


@pytest.mark.parametrize("fmt", ALL)
def test_layout_change(fmt: str) -> None:
    x = torch.randn(200, 96)
    plain = quantize(x, fmt)
    sw = quantize(x, fmt, swizzle=True)
    assert sw.scales.shape == (64, 16 * -(-plain.scales.shape[1] // 4))
    assert torch.equal(plain.with_layout(swizzle=True).scale_bytes, sw.scale_bytes)
    assert torch.equal(sw.with_layout(swizzle=False).scale_bytes, plain.scale_bytes)
    assert torch.equal(sw.dequantize(), plain.dequantize())


def test_repr_and_nbytes() -> None:
    x = torch.randn(4096, 256)
    q = quantize(x, "nvfp4", recipe="te")
    assert q.nbytes == 4096 * 128 + 4096 * 16 + 4
    assert q.dense_nbytes == 4096 * 256 * 4
    text = repr(q)
    assert "format=nvfp4" in text and "recipe=te" in text and "qdata=uint8(4096, 128)" in text
    assert "smaller than float32" in text
    assert "scales=float8_e8m0fnu" in repr(quantize(x, "mxfp4"))


def test_to_device_keeps_everything() -> None:
    q = quantize(torch.randn(8, 64), "nvfp4", global_scale=True)
    r = q.to("cpu")
    assert torch.equal(r.dequantize(), q.dequantize()) and r.global_scale is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda_roundtrip() -> None:
    q = quantize(torch.randn(8, 64), "mxfp8_e4m3")
    assert torch.equal(q.to("cuda").to("cpu").dequantize(), q.dequantize())
