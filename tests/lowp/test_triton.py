"""The Triton quantizer: bit-exact with the reference, run under the Triton interpreter on CPU (needs the triton
package) and for real on a CUDA device (needs one)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from lowp_data import distributions
    from torchnext.lowp import quantize
    device = {device!r}
    cases = [("nvfp4", {{}}), ("nvfp4", {{"global_scale": True}}), ("nvfp4", {{"recipe": "te"}}),
             ("mxfp8_e4m3", {{}}), ("mxfp8_e4m3", {{"scale_mode": "rceil"}}), ("mxfp8_e5m2", {{}}),
             ("mxfp4", {{}}), ("mxfp4", {{"scale_mode": "rceil"}})]
    bad = []
    for name, x in distributions((33, 96)):
        for dtype in (torch.float32, torch.bfloat16):
            xx = x.to(dtype)
            for fmt, opts in cases:
                a = quantize(xx, fmt, backend="reference", **opts)
                b = quantize(xx.to(device), fmt, backend="triton", **opts).to("cpu")
                if not (torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
                        and torch.equal(a.scale_bytes, b.scale_bytes)):
                    bad.append((name, str(dtype), fmt, opts))
    g = lambda: torch.Generator().manual_seed(3)
    x = torch.randn(64, 64)
    a = quantize(x, "nvfp4", rounding="stochastic", generator=g(), backend="reference")
    b = quantize(x.to(device), "nvfp4", rounding="stochastic", generator=g(), backend="triton").to("cpu")
    if not torch.equal(a.qdata, b.qdata):
        bad.append("stochastic")
    print("MISMATCHES", bad)
    sys.exit(1 if bad else 0)
    """
)


def _run(device: str, env: dict[str, str]) -> None:
    code = CHECK.format(tests=str(ROOT / "tests" / "lowp"), device=device)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **env}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=full_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton); the interpreter check needs it")
def test_triton_kernel_under_interpreter_matches_reference() -> None:
    _run("cpu", {"TRITON_INTERPRET": "1"})


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
def test_triton_kernel_on_cuda_matches_reference() -> None:
    _run("cuda", {})


def test_triton_backend_error_without_triton() -> None:
    if HAS_TRITON:
        pytest.skip("triton is installed: the missing-package error cannot be observed")
    from torchnext.lowp import FormatError, quantize

    with pytest.raises(FormatError, match="triton"):
        quantize(torch.randn(4, 32), "nvfp4", backend="triton")
