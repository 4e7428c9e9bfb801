"""``cpu``: torchnext's compiled C++ kernel for weight-only block-scaled matmul at small M (the decode GEMV).

Meaning: ``epilogue(a @ dequantize(w).T)`` for ``M <= 16`` rows of a dense fp32/bf16 ``a`` (a block-scaled ``a`` is
decoded first; other dense dtypes are widened to fp32) and an NVFP4 (either recipe, with or without the global
scale), MXFP4 or MXFP8 (E4M3 / E5M2) weight ``w``, on CPU tensors. The epilogue's scale, bias, activation (the
built-in ones: relu, gelu, gelu_tanh, silu), residual and output amax run in the kernel on the way out; the
optional ``out_format`` quantization then runs on the kernel's fp32 ``y`` (as in every backend).

How (csrc/gemv.cpp): the weight is repacked once (:func:`packed_weight`, cached per weight like torch's int4pack)
into 16-column tiles that the kernel streams once per call, decoding 16 columns per SIMD vector in registers (FP4: a
16-entry table permute, FP8: a binary16 conversion) and broadcasting activations, multi-threaded over the tiles with
torch's intra-op threads; the output is written once, in the requested dtype. The library is built on first use
(:mod:`torchnext.lowp.cpu`); without a compiler this backend reports unavailable and the autotuner keeps the
pure-torch backends (``inductor``'s GEMV, ``eager``).

Where it is eligible it *supersedes* ``inductor`` (the autotuner does not compile and time Inductor's GEMV for
those problems: it is the slower decode of the same data, see docs/benchmarks.md); ``inductor`` stays the path for
everything this kernel does not cover (M > 16, CUDA, registered custom formats) and when the build is unavailable.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torchnext.lowp.cpu import ISAS, describe, isa_index, ops, simd, unavailable
from torchnext.lowp.formats import FORMATS, FormatSpec
from torchnext.lowp.mm.backends import EPILOGUE_FEATURES, Capability, KernelBackend, Problem, check_capability
from torchnext.lowp.mm.epilogue import EpilogueOutput, finish_epilogue
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.tracing import compiling

__all__ = ["BACKEND", "KERNEL_ACTIVATIONS", "MAX_M", "CpuBackend", "packed_weight"]

MAX_M = 16
"""Largest M the kernel takes (rows are padded to 1, 2, 4, 8 or 16 inside)."""

_FORMAT_CODES: dict[str, int] = {"nvfp4": 0, "mxfp4": 1, "mxfp8_e4m3": 2, "mxfp8_e5m2": 3}
"""Weight formats the kernel decodes (csrc/gemv.cpp ``GemvFormat``)."""

KERNEL_ACTIVATIONS: dict[str | None, int] = {None: 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
"""Activation name → the kernel's code (csrc/epilogue.h ``Act``); an activation registered later by
``register_activation`` is not in the kernel, so this backend declines such epilogues."""

_SCALE_KINDS: dict[str | None, int] = {None: 0, "scalar": 1, "row": 2, "col": 3}

_BUILTIN_SPECS: dict[str, FormatSpec] = {s.name: s for s in FORMATS.values()}


class _Packed:
    __slots__ = ("flags", "fmt", "gscale", "kp", "n", "nan_cols", "packed", "version")

    def __init__(self, w: BlockScaledTensor, version: tuple[int, ...]) -> None:
        rows, nb = w.scale_matrix_shape
        codes = w.qdata.reshape(rows, -1).view(torch.uint8)
        scales = w.unswizzled_scales().reshape(rows, nb).view(torch.uint8)
        self.fmt = _FORMAT_CODES[w.spec.name]
        self.packed, self.nan_cols, self.flags = ops().gemv_pack(codes, scales, self.fmt)
        self.n = w.shape[0]
        self.kp = w.k_padded
        self.gscale = w.global_scale  # 0-d; the kernel reads it (a traced graph holds the tensor, not its value)
        self.version = version


_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(w: BlockScaledTensor) -> _Packed:
    """The kernel layout of an (N, K) weight blocked along K (see csrc/gemv.cpp), built once and cached, weakly keyed
    by ``w.qdata`` (a Linear module's buffer keeps it alive) and rebuilt if the codes, scales or global scale are
    modified in place. Costs one pass over the weight; the packed copy has the weight's size plus < 1 %.

    Inside ``torch.compile``/``torch.export`` the packing is an op of the graph (a cache of real tensors is not
    graph material): each call of the compiled function packs once more."""
    if compiling():
        return _Packed(w, ())
    version = (w.qdata._version, w.scales._version, -1 if w.global_scale is None else w.global_scale._version)
    hit = _PACKED.get(w.qdata)
    if hit is not None and hit.version == version and hit.n == w.shape[0]:
        return hit
    p = _Packed(w, version)
    _PACKED[w.qdata] = p
    return p


class CpuBackend:
    name = KernelBackend.CPU.value
    autotune_candidate = True
    isa: str | None = None
    """Instruction-set variant to run (one of :data:`torchnext.lowp.cpu.ISAS`; None: the best compiled one).
    Tests set it to check every variant against the reference."""

    def capability(self) -> Capability:
        return Capability(
            devices=frozenset({"cpu"}),
            formats=frozenset({"dense", *(f.value for f in FORMATS)}),
            epilogue=EPILOGUE_FEATURES,
            notes=f"M <= {MAX_M}; weight: {', '.join(_FORMAT_CODES)}; compiled C++ ({'/'.join(ISAS)})",
        )

    def available(self) -> tuple[bool, str]:
        why = unavailable()
        return (False, why) if why else (True, describe())

    def supports(self, problem: Problem) -> str | None:
        why = check_capability(self.capability(), problem)
        if why is not None:
            return why
        w = problem.w
        if not isinstance(w, BlockScaledTensor) or _BUILTIN_SPECS.get(w.spec.name) is not w.spec:
            return f"weight must be block-scaled in one of {list(_FORMAT_CODES)}"
        if w.spec.name not in _FORMAT_CODES:
            return f"weight format {w.spec.name!r} is not decoded by the kernel"
        if not 1 <= problem.m <= MAX_M:
            return f"M={problem.m} outside 1..{MAX_M} (the kernel is the small-M GEMV)"
        if problem.epilogue.activation not in KERNEL_ACTIVATIONS:
            return f"activation {problem.epilogue.activation!r} is not compiled into the kernel"
        return unavailable() or None

    def supersedes(self, problem: Problem) -> frozenset[str]:
        """Backends the autotuner need not time where this one is eligible (see the module docstring): Inductor's
        GEMV, when a SIMD variant is compiled (with only the portable one, both are timed)."""
        return frozenset({KernelBackend.INDUCTOR.value}) if simd() else frozenset()

    def run(self, problem: Problem) -> EpilogueOutput:
        ep = problem.epilogue
        w = problem.w
        assert isinstance(w, BlockScaledTensor)  # supports() checked it
        p = packed_weight(w)
        a = problem.a
        if isinstance(a, BlockScaledTensor):
            from torchnext.lowp.mm.decode import dequantize_operand

            x = dequantize_operand(a, torch.float32)
        elif a.dtype in (torch.float32, torch.bfloat16):
            x = a
        else:
            x = a.to(torch.float32)
        kind = ep.scale_kind
        scale = ep.scale_tensor(problem.device) if kind is not None else None
        bias = None if ep.bias is None else ep.bias.to(torch.float32)
        residual = None if ep.residual is None else ep.residual.to(torch.float32)
        direct = ep.out_format is None and problem.out_dtype in (torch.float32, torch.bfloat16)
        bf16_out = direct and problem.out_dtype == torch.bfloat16
        y, amax = ops().gemv(
            x,
            p.packed,
            p.nan_cols,
            p.flags,
            p.fmt,
            p.n,
            p.kp,
            p.gscale,
            scale,
            _SCALE_KINDS[kind],
            bias,
            KERNEL_ACTIVATIONS[ep.activation],
            residual,
            ep.output_amax,
            bf16_out,
            isa_index(self.isa),
        )
        return finish_epilogue(y, ep, problem.out_dtype, amax=amax if ep.output_amax else None)


BACKEND = CpuBackend()
