"""Quantization options: :class:`QuantOptions`, one kw-only dataclass for every format.

Fields that only apply to some formats default to ``None`` ("the format's default"); giving one to a format it does
not apply to raises :class:`~torchnext.lowp.errors.FormatError` instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from torchnext.lowp.errors import DeterminismError, FormatError
from torchnext.lowp.formats import FormatSpec, ScaleKind
from torchnext.lowp.rng import CounterNoise

__all__ = ["BACKENDS", "NVFP4_RECIPES", "QuantOptions", "ROUNDINGS", "SCALE_MODES", "ResolvedOptions"]

NVFP4_RECIPES = ("torchao", "te")
"""``"torchao"``: block scale amax/6 clamped to [2**-6, 448]; ``"te"``: TransformerEngine/mslk/flashinfer, encode
scale 2688/amax, no lower clamp. See docs/lowp.md for the exact formulas."""
SCALE_MODES = ("floor", "rceil")
"""MX E8M0 scale: ``"floor"`` (OCP MX v1.0) or ``"rceil"`` (cuBLAS: round the descale up to a power of two)."""
ROUNDINGS = ("rne", "stochastic")
"""Element rounding: round-to-nearest-even, or stochastic (unbiased; see :class:`QuantOptions`)."""
BACKENDS = ("auto", "cpu", "eager", "reference", "triton")
"""``"auto"``: ``"cpu"`` for CPU tensors when torchnext's compiled kernels are available, else ``"eager"``;
``"cpu"``: one compiled C++ pass (built on first use; needs a C++ compiler); ``"eager"``: vectorized, chunked torch
ops; ``"reference"``: the plain readable implementation; ``"triton"``: one fused Triton kernel (CUDA tensors, or CPU
under ``TRITON_INTERPRET=1``; opt-in until it has been timed on a GPU). (A ``torch.compile``d version of the eager pipeline was measured 3.5-4x *slower* on CPU, so it is
not offered; see docs/lowp.md.)"""


@dataclass(kw_only=True, frozen=True)
class QuantOptions:
    """How to quantize. Every field has a default; :func:`~torchnext.lowp.quantize` also takes them as keywords."""

    recipe: str | None = None
    """NVFP4 only: ``"torchao"`` (default) or ``"te"``."""
    global_scale: bool | float | torch.Tensor | None = None
    """NVFP4 only: the per-tensor (second-level) fp32 *decode* scale. ``None``: the recipe's default (torchao: no
    global scale; te: computed). ``True``: computed from the tensor's amax (torchao: ``amax / (448 * 6)``; te:
    ``1 / (2688 / amax)``). ``False``: none (torchao recipe only). A positive finite float or 0-d tensor: use it
    (a calibrated scale)."""
    amax: float | torch.Tensor | None = None
    """NVFP4 with a computed global scale only: use this tensor amax instead of the input's own (e.g. the
    all-reduced amax of a tensor sharded over ranks, so each shard quantizes exactly as the whole tensor would)."""
    scale_mode: str | None = None
    """MX only: ``"floor"`` (default) or ``"rceil"``."""
    rounding: str = "rne"
    """``"rne"`` or ``"stochastic"``. Scales are always computed with round-to-nearest-even; stochastic rounding
    applies to elements: ``|y|`` becomes the grid neighbour above with probability ``(|y| - lo) / (hi - lo)``."""
    seed: int | None = None
    """Stochastic rounding: the 64-bit stream seed of the counter-based generator (:mod:`torchnext.lowp.rng`).
    The noise of element ``i`` of the padded block matrix (see :func:`~torchnext.lowp.quantize`) is
    ``rng.uniform(seed, offset + i)``: same seed, offset and input → same bytes on every backend and every
    process. ``None``: a seed is drawn from torch's global RNG (refused when determinism is requested)."""
    offset: int = 0
    """Stochastic rounding: the counter of the first element (in [0, 2**64)); quantizing pieces of one stream
    with disjoint counter ranges keeps their noise independent."""
    deterministic: bool | None = None
    """Whether results must be reproducible; ``None`` follows ``torch.are_deterministic_algorithms_enabled()``.
    Stochastic rounding without a ``seed`` draws its seed from torch's global RNG, which is refused
    (DeterminismError) when determinism is requested."""
    swizzle: bool = False
    """Store scales in the cuBLAS/CUTLASS SWIZZLE_32_4_4 layout (padded to 128x4 tiles) instead of row-major."""
    backend: str = "auto"
    """Implementation: one of :data:`BACKENDS` or a name given to
    :func:`~torchnext.lowp.quantizers.register_quantizer` (checked when the kernel is looked up). Every backend
    produces the same bytes."""

    def resolve(self, spec: FormatSpec) -> ResolvedOptions:
        """Check the options against ``spec`` and fill in the format's defaults.

        Raises:
            FormatError: an option that does not apply to the format, or an unknown value.
            DeterminismError: stochastic rounding without a seed while determinism is requested.
        """
        _check_choice("rounding", self.rounding, ROUNDINGS)
        if not isinstance(self.backend, str) or not self.backend:
            raise FormatError(f"backend must be a quantizer name (one of {list(BACKENDS)} or a registered one), got {self.backend!r}")
        if not isinstance(self.swizzle, bool):
            raise FormatError(f"swizzle must be a bool, got {self.swizzle!r}")
        if spec.scale is ScaleKind.E4M3:
            if self.scale_mode is not None:
                raise FormatError(f"scale_mode={self.scale_mode!r} applies to MX formats only, not {spec.name}")
            recipe = self.recipe if self.recipe is not None else "torchao"
            _check_choice("recipe", recipe, NVFP4_RECIPES)
            scale_mode = None
            gs = self.global_scale
            if gs is None:
                gs = recipe == "te"
            if gs is False and recipe == "te":
                raise FormatError("the 'te' NVFP4 recipe is two-level: global_scale=False is not allowed")
            if not isinstance(gs, bool):
                value = float(gs.detach().float().reshape(()).item()) if isinstance(gs, torch.Tensor) else gs
                if isinstance(gs, torch.Tensor) and gs.numel() != 1:
                    raise FormatError(f"global_scale tensor must hold one value, got shape {tuple(gs.shape)}")
                if not isinstance(value, (int, float)) or not (2.0**-126 <= value < float("inf")):
                    raise FormatError(
                        f"global_scale must be a finite decode scale >= 2**-126 (its reciprocal must be finite), "
                        f"got {gs!r}"
                    )
                gs = float(value)
            if self.amax is not None and gs is not True:
                raise FormatError("amax= replaces the input's amax in a computed global scale: it needs a two-level "
                                  "NVFP4 recipe without a given global_scale")
        else:
            if self.amax is not None:
                raise FormatError(f"amax applies to NVFP4's global scale only, not {spec.name}")
            if self.recipe is not None:
                raise FormatError(f"recipe={self.recipe!r} applies to NVFP4 only, not {spec.name}")
            if self.global_scale not in (None, False):
                raise FormatError(f"global_scale applies to NVFP4 only, not {spec.name}")
            recipe = None
            scale_mode = self.scale_mode if self.scale_mode is not None else "floor"
            _check_choice("scale_mode", scale_mode, SCALE_MODES)
            gs = False
        deterministic = (
            self.deterministic if self.deterministic is not None else torch.are_deterministic_algorithms_enabled()
        )
        seed = self.seed
        for what, counter in (("seed", seed), ("offset", self.offset)):
            if counter is not None and (
                isinstance(counter, bool) or not isinstance(counter, int) or not 0 <= counter < 2**64
            ):
                raise FormatError(f"{what} must be an int in [0, 2**64), got {counter!r}")
        if self.rounding != "stochastic" and (seed is not None or self.offset != 0):
            raise FormatError("seed and offset are only used with rounding='stochastic'")
        if self.rounding == "stochastic" and seed is None:
            if deterministic:
                raise DeterminismError(
                    "rounding='stochastic' needs a seed when determinism is requested "
                    "(deterministic=True or torch.use_deterministic_algorithms(True)); pass seed=..."
                )
            seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
        return ResolvedOptions(
            recipe=recipe,
            scale_mode=scale_mode,
            global_scale=gs,
            amax=_amax_tensor(self.amax),
            rounding=self.rounding,
            noise=CounterNoise(seed=seed, offset=self.offset) if seed is not None else None,
            swizzle=self.swizzle,
            backend=self.backend,
        )

    def with_(self, **changes: Any) -> QuantOptions:
        """A copy with ``changes`` applied (unknown names raise FormatError)."""
        known = set(self.__dataclass_fields__)
        unknown = sorted(set(changes) - known)
        if unknown:
            hint = " (stochastic rounding takes seed=/offset= since the counter-based generator replaced generator=)" if "generator" in unknown else ""
            raise FormatError(f"unknown quantization option(s) {unknown}; known: {sorted(known)}{hint}")
        return replace(self, **changes)


@dataclass(kw_only=True, frozen=True)
class ResolvedOptions:
    """:class:`QuantOptions` checked against one format, defaults filled in (internal)."""

    recipe: str | None
    scale_mode: str | None
    global_scale: bool | float
    """False: none; True: computed from the tensor; float: given decode scale."""
    amax: torch.Tensor | None
    """A given tensor amax for the computed global scale (0-d fp32), or None: the input's."""
    rounding: str
    noise: CounterNoise | None
    """Stochastic rounding: the (seed, offset) of the noise; None for RNE."""
    swizzle: bool
    backend: str

    @property
    def scale_recipe(self) -> str:
        """The key of the scale recipe the quantizers run: the named recipe (``te``, ``torchao``) or, for MX
        formats, the scale mode (``floor``, ``rceil``)."""
        name = self.recipe if self.recipe is not None else self.scale_mode
        if name is None:  # resolve() always sets one of the two
            raise FormatError("ResolvedOptions has neither a recipe nor a scale mode")
        return name


def block_outputs(x2: torch.Tensor, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized outputs of a ``quantize_blocks`` kernel for the rows of ``x2`` (one block per row): the codes
    (``el.torch_dtype`` or packed uint8, ``block / per_byte`` per row) and one scale byte per row (uint8; view it
    as ``spec.scale_dtype``)."""
    el = spec.element
    n, block = x2.shape
    storage = el.torch_dtype if el.torch_dtype is not None else torch.uint8
    codes = torch.empty(n, block // el.per_byte, dtype=storage, device=x2.device)
    return codes, torch.empty(n, dtype=torch.uint8, device=x2.device)


def _amax_tensor(amax: float | torch.Tensor | None) -> torch.Tensor | None:
    if amax is None:
        return None
    if isinstance(amax, torch.Tensor):
        if amax.numel() != 1:
            raise FormatError(f"amax must hold one value, got shape {tuple(amax.shape)}")
        return amax.detach().float().reshape(())
    if isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise FormatError(f"amax must be a float or a 0-d tensor, got {amax!r}")
    return torch.tensor(float(amax), dtype=torch.float32)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FormatError(f"{name}={value!r} is not one of {list(choices)}")
