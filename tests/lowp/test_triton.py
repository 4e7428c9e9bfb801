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
    x = torch.randn(64, 64)
    for fmt in ("nvfp4", "mxfp8_e4m3"):
        a = quantize(x, fmt, rounding="stochastic", seed=3, offset=5, backend="reference")
        b = quantize(x.to(device), fmt, rounding="stochastic", seed=3, offset=5, backend="triton").to("cpu")
        if not torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)):
            bad.append(("stochastic", fmt))
    print("MISMATCHES", bad)
    sys.exit(1 if bad else 0)
    """
)


MM_CHECK = textwrap.dedent(
    """
    import sys, torch
    from torchnext.lowp import Epilogue, quantize, scaled_mm
    from torchnext.lowp.mm.backends.triton import BACKEND
    from torchnext.lowp.mm.scaled_mm import make_problem
    device = {device!r}
    g = torch.Generator().manual_seed(0)
    bad = []
    fmts = [("nvfp4", {{}}), ("nvfp4", {{"global_scale": True}}), ("mxfp8_e4m3", {{}}), ("mxfp8_e5m2", {{}}), ("mxfp4", {{}})]
    for fmt, opts in fmts:
        for m, n, k in [(5, 48, 64), (33, 70, 96)]:   # tails in every tile dimension
            a = torch.randn(m, k, generator=g)
            w = quantize(torch.randn(n, k, generator=g), fmt, **opts)
            eps = [Epilogue(),
                   Epilogue(scale=torch.rand(m, 1, generator=g), bias=torch.randn(n, generator=g), activation="gelu",
                            residual=torch.randn(m, n, generator=g), output_amax=True),
                   Epilogue(scale=torch.rand(n, generator=g), activation="gelu_tanh"),
                   Epilogue(scale=0.5, activation="silu", output_amax=True),
                   Epilogue(activation="relu", out_dtype=torch.bfloat16)]
            for ep in eps:
                ref = scaled_mm(a, w, epilogue=ep, backend="reference")
                ref = ref.output if hasattr(ref, "output") else ref
                dev_ep = Epilogue(**{{f: (getattr(ep, f).to(device) if isinstance(getattr(ep, f), torch.Tensor) else getattr(ep, f))
                                     for f in ("scale", "bias", "activation", "residual", "output_amax", "out_dtype")}})
                got = BACKEND.run(make_problem(a.to(device), w.to(device), dev_ep))
                out = got.output.cpu()
                err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
                tol = 1e-5 if out.dtype == torch.float32 else 1e-2
                amax_ok = not ep.output_amax or float(got.amax) == float(got.output.float().abs().max())
                if not (err <= tol and amax_ok and out.dtype == ref.dtype):
                    bad.append((fmt, opts, m, n, k, ep.activation, err, amax_ok))
    print("MISMATCHES", bad)
    sys.exit(1 if bad else 0)
    """
)


def _run(device: str, env: dict[str, str], check: str = CHECK) -> None:
    code = check.format(tests=str(ROOT / "tests" / "lowp"), device=device)
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


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton); the interpreter check needs it")
def test_triton_scaled_mm_kernel_under_interpreter_matches_reference() -> None:
    """The fused scaled_mm kernel (in-kernel decode, tl.dot, epilogue, atomic amax) on CPU tensors under the Triton
    interpreter: every format, every epilogue feature the kernel implements, ragged tiles, vs ``reference``."""
    _run("cpu", {"TRITON_INTERPRET": "1"}, MM_CHECK)


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA device")
def test_triton_scaled_mm_kernel_on_cuda_matches_reference() -> None:
    _run("cuda", {}, MM_CHECK)


def test_triton_backend_error_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    # simulate a missing package whether or not triton is installed (None in sys.modules makes `import` fail)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "torchnext.lowp.quantizers.triton", raising=False)
    import torchnext.lowp

    monkeypatch.delattr(torchnext.lowp, "triton_backend", raising=False)  # else `from ... import` finds the attribute
    from torchnext.lowp import FormatError, quantize

    with pytest.raises(FormatError, match="triton"):
        quantize(torch.randn(4, 32), "nvfp4", backend="triton")
