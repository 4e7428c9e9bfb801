"""Training recipes: how each operand of the three GEMMs of a linear layer is quantized.

For ``Y = X @ W.T`` (X: (M, K) activations, W: (N, K) weight, dY: (M, N) output gradient) training runs::

    fprop:  Y  = X  @ W.T     X blocked along K,  W blocked along K
    dgrad:  dX = dY @ W       dY blocked along N, W blocked along N   (W's columnwise copy)
    wgrad:  dW = dY.T @ X     dY and X blocked along M                (their columnwise copies)

Each of the six copies is quantized from the high-precision tensor (:func:`torchnext.lowp.quantize_pair`), never
from another copy. A :class:`Recipe` says how: the format, its scale rule, whether W uses square 2-D blocks (then W
and W.T carry the same values), whether the wgrad operands go through the 16-point random Hadamard transform
(:mod:`torchnext.lowp.hadamard`) and whether dY is rounded stochastically. The two published recipes:

=========  ==============  ===========  ==================  ===============  ===========================
recipe     format          scales       W blocks            RHT (wgrad)      stochastic rounding
=========  ==============  ===========  ==================  ===============  ===========================
MXFP8      E4M3, block 32  E8M0, RCEIL  1 x 32 (K; N)       no               no
NVFP4      E2M1, block 16  E4M3 + fp32  16 x 16 (2-D)       X and dY         dY (dgrad and wgrad copies)
=========  ==============  ===========  ==================  ===============  ===========================

(MXFP8: TransformerEngine ``MXFP8BlockScaling`` / torchao ``MXFP8TrainingOpConfig`` RCEIL; NVFP4: "Pretraining
Large Language Models with NVFP4", arXiv 2509.25149, TE ``NVFP4BlockScaling``, with the ``"te"`` scale recipe of
:class:`~torchnext.lowp.QuantOptions`: ``S_enc = 448 * 6 / amax``, block scales ``e4m3(block_amax * S_enc / 6)``.)

Stochastic rounding streams: the copy ``operand`` of layer ``layer`` at step ``step`` draws from
``rng.stream_seed(seed, layer, step, operand)`` with offset 0 (:class:`Operand` numbers the copies), so
data-parallel replicas that share the model seed and the step draw the same noise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from torchnext.lowp.errors import FormatError
from torchnext.lowp.formats import Format, format_spec
from torchnext.lowp.options import SCALE_MODES, QuantOptions
from torchnext.lowp.rng import stream_seed

__all__ = ["GEMMS", "Operand", "Recipe"]


class Operand(enum.IntEnum):
    """The six quantized copies of a linear layer's training step (the ``operand`` part of stream seeds)."""

    X_ROW = 0
    """X blocked along K (fprop)."""
    X_COL = 1
    """X blocked along M (wgrad; RHT under NVFP4)."""
    W_ROW = 2
    """W blocked along K (fprop; 2-D tiles under NVFP4)."""
    W_COL = 3
    """W blocked along N (dgrad; the same tiles under NVFP4)."""
    DY_ROW = 4
    """dY blocked along N (dgrad)."""
    DY_COL = 5
    """dY blocked along M (wgrad; RHT under NVFP4)."""


GEMMS: dict[str, tuple[Operand, Operand]] = {
    "fprop": (Operand.X_ROW, Operand.W_ROW),
    "dgrad": (Operand.DY_ROW, Operand.W_COL),
    "wgrad": (Operand.DY_COL, Operand.X_COL),
}
"""GEMM → its (left, right) quantized operands."""

_ROLE_COPIES = {"x": (Operand.X_ROW, Operand.X_COL), "w": (Operand.W_ROW, Operand.W_COL),
                "dy": (Operand.DY_ROW, Operand.DY_COL)}


@dataclass(kw_only=True, frozen=True)
class Recipe:
    """How a training step quantizes X, W and dY (see the module docstring). ``Recipe.MXFP8`` and
    ``Recipe.NVFP4`` are the published recipes; ``Recipe.NVFP4.with_(rht=False)`` an ablation."""

    MXFP8: ClassVar[Recipe]
    NVFP4: ClassVar[Recipe]

    format: Format
    """Element format of every operand: ``Format.MXFP8_E4M3`` or ``Format.NVFP4`` (gradients included)."""
    scale_mode: str
    """Block-scale rule: ``"rceil"`` or ``"floor"`` for MX formats (E8M0 scales); ``"te"`` for NVFP4 (fp32
    per-tensor encode scale ``448 * 6 / amax`` and E4M3 block scales, the TransformerEngine formula)."""
    weight_2d: bool = False
    """W quantized in ``B x B`` tiles (``B`` = the block size; NVFP4: 16 x 16): one scale per tile, so the rowwise
    (fprop) and columnwise (dgrad) copies of W hold the same values."""
    rht: bool = False
    """The wgrad operands (X and dY blocked along M) go through the 16-point random Hadamard transform along M
    before quantization (their global amax is taken after it); the per-layer sign vector comes from the model
    seed and lives in the layer's state dict."""
    stochastic_rounding: bool = False
    """dY's two copies (dgrad and wgrad operands) are rounded stochastically; X and W always use RNE."""

    def __post_init__(self) -> None:
        spec = format_spec(self.format)
        if spec.name not in (Format.MXFP8_E4M3.value, Format.NVFP4.value):
            raise FormatError(f"Recipe: training supports mxfp8_e4m3 and nvfp4, not {spec.name}")
        object.__setattr__(self, "format", Format(spec.name))
        valid = ("te",) if self.format is Format.NVFP4 else SCALE_MODES
        if self.scale_mode not in valid:
            raise FormatError(f"Recipe: scale_mode={self.scale_mode!r} is not one of {list(valid)} for {spec.name}")
        for f in ("weight_2d", "rht", "stochastic_rounding"):
            if not isinstance(getattr(self, f), bool):
                raise FormatError(f"Recipe: {f} must be a bool, got {getattr(self, f)!r}")

    # -------------------------------------------------------------------------------------------- derived
    @property
    def block_size(self) -> int:
        return format_spec(self.format).block_size

    @property
    def block_shapes(self) -> dict[str, dict[str, tuple[int, int]]]:
        """GEMM → operand → block shape in that operand's own (rows, cols): X (M, K), W (N, K), dY (M, N).
        MXFP8: ``{"fprop": {"x": (1, 32), "w": (1, 32)}, "dgrad": {"dy": (1, 32), "w": (32, 1)}, "wgrad":
        {"dy": (32, 1), "x": (32, 1)}}``; NVFP4 has W in (16, 16) tiles."""
        b = self.block_size
        w_row, w_col = ((b, b), (b, b)) if self.weight_2d else ((1, b), (b, 1))
        return {
            "fprop": {"x": (1, b), "w": w_row},
            "dgrad": {"dy": (1, b), "w": w_col},
            "wgrad": {"dy": (b, 1), "x": (b, 1)},
        }

    @property
    def key(self) -> str:
        """A canonical string for the recipe (round-trips through :meth:`from_key`; used as a custom-op
        argument)."""
        return (f"{self.format.value}:{self.scale_mode}:2d={int(self.weight_2d)}:rht={int(self.rht)}"
                f":sr={int(self.stochastic_rounding)}")

    @classmethod
    def from_key(cls, key: str) -> Recipe:
        """Inverse of :attr:`key`."""
        try:
            fmt, scale, w2d, rht, sr = key.split(":")
            return cls(format=Format(fmt), scale_mode=scale, weight_2d=w2d == "2d=1", rht=rht == "rht=1",
                       stochastic_rounding=sr == "sr=1")
        except ValueError:
            raise FormatError(f"not a Recipe key: {key!r}") from None

    def with_(self, **changes: Any) -> Recipe:
        """A copy with ``changes`` (unknown field names raise FormatError)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise FormatError(f"Recipe has no field(s) {unknown}")
        return replace(self, **changes)

    def quant_options(self, operand: Operand, *, seed: int = 0, layer: int = 0, step: int = 0,
                      quantizer: str = "auto") -> QuantOptions:
        """The :class:`~torchnext.lowp.QuantOptions` of one copy (stochastic copies get their stream seed)."""
        base = QuantOptions(recipe="te", backend=quantizer) if self.format is Format.NVFP4 else QuantOptions(
            scale_mode=self.scale_mode, backend=quantizer)
        if self.stochastic_rounding and operand in (Operand.DY_ROW, Operand.DY_COL):
            return base.with_(rounding="stochastic", seed=stream_seed(seed, layer, step, int(operand)))
        return base

    def uses_rht(self, role: str) -> bool:
        """Whether the columnwise copy of ``role`` ("x", "w", "dy") is transformed."""
        return self.rht and role in ("x", "dy")

    def copies(self, role: str) -> tuple[Operand, Operand]:
        """(rowwise, columnwise) operands of ``role``."""
        try:
            return _ROLE_COPIES[role]
        except KeyError:
            raise FormatError(f"unknown operand role {role!r}; roles: {sorted(_ROLE_COPIES)}") from None

    def __str__(self) -> str:
        extras = [n for n, on in (("2-D W", self.weight_2d), ("RHT", self.rht), ("SR", self.stochastic_rounding)) if on]
        return f"{self.format.value}/{self.scale_mode}" + (f" ({', '.join(extras)})" if extras else "")


Recipe.MXFP8 = Recipe(format=Format.MXFP8_E4M3, scale_mode="rceil")
Recipe.NVFP4 = Recipe(format=Format.NVFP4, scale_mode="te", weight_2d=True, rht=True, stochastic_rounding=True)
