"""``triton``: one Triton kernel per launch — block-scaled weight decoded in-kernel, ``tl.dot``, epilogue and amax
in the kernel's tail (CUDA only).

The weight ``w`` (N, K) is block-scaled (any built-in format); the activation is dense (a block-scaled activation is
dequantized first). This is the *decomposed* path that works on any CUDA GPU Triton supports: codes and scales are
loaded, decoded to fp32 and fed to ``tl.dot`` in IEEE fp32; the native ``tl.dot_scaled`` path of sm_100 is not
used. Tile loop per output tile (BM x BN)::

    acc = 0
    for k0 in range(0, K, BK):
        w_tile = decode(codes[n, k0:k0+BK]) * scale[n, (k0:k0+BK) // block]      # (BN, BK) fp32
        acc += a[m, k0:k0+BK] @ w_tile.T
    y = epilogue(acc * global_scale); atomic_max(amax, max|y|)

Status: written against Triton's public API but never executed in this project's CI (no GPU and no triton package
on the build machine); :meth:`TritonBackend.available` reports that, and the GPU tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from torchnext.lowp.formats import FORMATS, ScaleKind
from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem, check_capability
from torchnext.lowp.mm.decode import is_fp4
from torchnext.lowp.mm.epilogue import EpilogueOutput, finish_epilogue
from torchnext.lowp.tensor import BlockScaledTensor

__all__ = ["BACKEND", "TritonBackend"]

_ACT_CODES = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
_SCALE_CODES = {None: 0, "scalar": 1, "row": 2, "col": 3}
_KERNEL: Any = None


def _build_kernel() -> Any:  # pragma: no cover - needs triton + CUDA
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(  # type: ignore[no-untyped-def]
        a_ptr, q_ptr, s_ptr, out_ptr, es_ptr, bias_ptr, res_ptr, amax_ptr, gs,
        M, N, K, stride_am, stride_qn, stride_sn,
        FP4: tl.constexpr, BLOCK: tl.constexpr, E8M0: tl.constexpr, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr, HAS_RES: tl.constexpr, AMAX: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wmask = mask_n[:, None] & mask_k[None, :]
            if FP4:
                byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=wmask, other=0).to(tl.int32)
                nib = tl.where(offs_k[None, :] % 2 == 0, byte & 15, byte >> 4)
                mm = (nib & 7).to(tl.float32)
                mag = mm + tl.maximum(mm - 4.0, 0.0) + 2.0 * tl.maximum(mm - 6.0, 0.0)
                val = tl.where(nib >= 8, -mag, mag) * 0.5
            else:
                val = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask, other=0.0).to(tl.float32)
            sb = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // BLOCK, mask=wmask, other=0)
            if E8M0:
                f = tl.exp2(sb.to(tl.float32) - 127.0)
            else:
                f = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            w = val * f
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        y = acc * gs
        if SCALE == 1:
            y = y * tl.load(es_ptr)
        if SCALE == 2:
            y = y * tl.load(es_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        if SCALE == 3:
            y = y * tl.load(es_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if ACT == 1:
            y = tl.maximum(y, 0.0)
        if ACT == 2:
            y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
        if ACT == 3:
            inner = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            y = 0.5 * y * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        if ACT == 4:
            y = y * tl.sigmoid(y)
        omask = mask_m[:, None] & mask_n[None, :]
        if HAS_RES:
            y = y + tl.load(res_ptr + offs_m[:, None] * N + offs_n[None, :], mask=omask, other=0.0)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=omask)
        if AMAX:
            tile = tl.max(tl.max(tl.where(omask, tl.abs(y), 0.0), axis=1), axis=0)
            tl.atomic_max(amax_ptr, tile)

    return kernel


class TritonBackend:
    name = KernelBackend.TRITON.value
    autotune_candidate = True
    traceable = False
    """Not chosen inside torch.compile/export: it launches its own Triton kernel."""

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cuda"}),
            formats=frozenset({"dense", *(f.value for f in FORMATS)}),
            epilogue=EPILOGUE_FEATURES,
            notes="w block-scaled; built-in activations only; decomposed tl.dot (no tl.dot_scaled)",
        )

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed"
        if not torch.cuda.is_available():
            return False, "triton is installed but no CUDA device is available"
        return True, "triton + CUDA"

    def supports(self, problem: Problem) -> str | None:
        ok, why = self.available()
        if not ok:
            return why
        why2 = check_capability(self.capability(), problem)
        if why2 is not None:
            return why2
        if not isinstance(problem.w, BlockScaledTensor):
            return "the triton kernel needs a block-scaled weight"
        if problem.epilogue.activation not in _ACT_CODES:
            return f"activation {problem.epilogue.activation!r} has no Triton implementation"
        return None

    def run(self, problem: Problem) -> EpilogueOutput:  # pragma: no cover - needs triton + CUDA
        global _KERNEL
        if _KERNEL is None:
            _KERNEL = _build_kernel()
        from torchnext.lowp.mm.backends._common import dense_operand
        from torchnext.lowp.mm.epilogue import epilogue_tensors

        w = problem.w
        assert isinstance(w, BlockScaledTensor)
        ep = problem.epilogue
        ep.check(problem.m, problem.n)
        t = epilogue_tensors(ep, problem.device)
        a = dense_operand(problem.a).contiguous()
        m, n, k = problem.m, problem.n, problem.k
        codes = w.qdata.reshape(n, -1)
        scales = w.unswizzled_scales().reshape(n, -1).view(torch.uint8)
        gs = float(w.global_scale) if w.global_scale is not None else 1.0
        out = torch.empty(m, n, dtype=torch.float32, device=problem.device)
        amax = torch.zeros((), dtype=torch.float32, device=problem.device)
        dummy = out
        es = t["scale"]
        bm, bn, bk = 32, 64, 64
        grid = (-(-m // bm), -(-n // bn))
        _KERNEL[grid](
            a, codes, scales, out,
            es.reshape(-1).contiguous() if es is not None else dummy,
            t["bias"] if t["bias"] is not None else dummy,
            t["residual"].contiguous() if t["residual"] is not None else dummy,
            amax, gs, m, n, k, a.stride(0), codes.stride(0), scales.stride(0),
            FP4=is_fp4(w.spec), BLOCK=w.spec.block_size, E8M0=w.spec.scale is ScaleKind.E8M0,
            SCALE=_SCALE_CODES[ep.scale_kind], HAS_BIAS=t["bias"] is not None, ACT=_ACT_CODES[ep.activation],
            HAS_RES=t["residual"] is not None, AMAX=ep.output_amax, BM=bm, BN=bn, BK=bk,
        )
        return finish_epilogue(out, ep, problem.out_dtype, amax=amax if ep.output_amax else None)


BACKEND = TritonBackend()
