"""Same seed, same bits on every quantizer backend: one NVFP4 and one MXFP8 training step with the reference,
eager and Triton quantizers (Triton under TRITON_INTERPRET=1 on CPU, in a subprocess so the interpreter flag is
set before triton is imported) give identical casts and identical gradients."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from torchnext.lowp.training import Recipe, convert_to_lowp_training

ROOT = Path(__file__).resolve().parents[3]
HAS_TRITON = importlib.util.find_spec("triton") is not None

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from torchnext.lowp.training import Recipe, convert_to_lowp_training
    from torchnext.lowp.training import function as fn
    bad = []
    for recipe in (Recipe.NVFP4, Recipe.MXFP8):
        results = {}
        for quantizer in ("reference", "eager", "triton"):
            rec = []
            real = fn.train_cast
            fn.train_cast = lambda *a, _r=real, _rec=rec: _rec.append(_r(*a)) or _rec[-1]
            torch.manual_seed(0)
            model = convert_to_lowp_training(nn.Sequential(nn.Linear(80, 48)), recipe, seed=5, quantizer=quantizer,
                                             backend="eager")
            g = torch.Generator().manual_seed(1)
            x = torch.randn(40, 80, generator=g).to(torch.bfloat16).requires_grad_()
            for _ in range(2):  # two steps: the step counter changes the noise
                model(x).float().backward(torch.randn(40, 48, generator=g))
            fn.train_cast = real
            results[quantizer] = ([t.clone() for out in rec for t in out], x.grad.clone(), model[0].weight.grad.clone())
        ref = results["reference"]
        for q in ("eager", "triton"):
            casts, dx, dw = results[q]
            if not all(torch.equal(a, b) for a, b in zip(ref[0], casts, strict=True)):
                bad.append((recipe.key, q, "casts"))
            if not (torch.equal(ref[1], dx) and torch.equal(ref[2], dw)):
                bad.append((recipe.key, q, "grads"))
    print("MISMATCHES", bad)
    sys.exit(1 if bad else 0)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (in the [test] extra)")
def test_same_bits_on_reference_eager_and_triton() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "MISMATCHES []" in proc.stdout


def test_same_bits_on_reference_and_eager_in_process() -> None:
    """The CPU-only part of the check above, without a subprocess (runs even without triton)."""
    grads = {}
    for quantizer in ("reference", "eager"):
        torch.manual_seed(0)
        model = convert_to_lowp_training(nn.Sequential(nn.Linear(64, 48)), Recipe.NVFP4, seed=5,
                                         quantizer=quantizer, backend="eager")
        x = torch.randn(33, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model(x).backward(torch.randn(33, 48, generator=torch.Generator().manual_seed(2)))
        grads[quantizer] = (x.grad, model[0].weight.grad)
    assert torch.equal(grads["reference"][0], grads["eager"][0])
    assert torch.equal(grads["reference"][1], grads["eager"][1])
