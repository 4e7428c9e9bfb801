"""``LowpTrainingLinear`` and :func:`convert_to_lowp_training`: swap a model's ``nn.Linear`` layers for training
in MXFP8 or NVFP4, keeping the master weights (and so gradients and optimizer state) in their own dtype.

``convert_to_lowp_training(model, recipe, module_filter_fn)`` converts, in place, every ``nn.Linear`` for which
``module_filter_fn(module, fqn)`` is true (None: all); what it does is what :func:`plan_lowp_training` says:

* an exact ``nn.Linear`` is replaced by a :class:`LowpTrainingLinear` that *shares* its ``weight`` and ``bias``
  parameters (an optimizer built before the conversion keeps working);
* a subclass of ``nn.Linear`` that keeps ``nn.Linear.forward`` (torchtitan's ``Linear``, a Linear carrying its own
  init or config protocol) stays the same object: its class becomes ``lowp_training_class(type(module))``, a
  subclass of *both* :class:`LowpTrainingLinear` and its own class, so ``isinstance`` checks, its attributes and its
  own initialisation (``reset_parameters``, ``init_weights``-style protocols) keep working;
* a subclass that overrides ``forward`` is skipped (converting it would replace its own computation), and so is a
  Linear whose weight is not 2-D floating point; each skipped module is named with its reason in one
  :class:`LowpConversionWarning` (``strict=True``: a :class:`~torchnext.lowp.FormatError` instead).

The layer adds its buffers to the state dict:

* ``lowp_step`` (0-d int64): counts the layer's training forward calls (grad enabled, ``module.training``); the step
  part of its stochastic-rounding seeds. Replicas that run the same schedule count alike; a loop that retries
  steps (fault tolerance) or heals replicas calls :func:`set_lowp_step` with its step number before each attempt,
  so every replica draws the same streams whatever happened before: it sets the counter to ``step * 2**20``, so
  the calls within a step (microbatches, an expert called several times) never reuse another step's streams.
* ``lowp_seed`` (0-d int64): the model seed the layer draws from (a loaded checkpoint continues its streams).
* ``rht_signs`` (16 fp32 +/-1, recipes with RHT): drawn from ``stream_seed(seed, layer)`` with ``layer =
  crc32(fqn)``: the same on every rank, kept so a loaded checkpoint keeps its transform.

A state dict of the unconverted model loads into a converted one (the two buffers keep their values).
``reset_parameters()`` (the ``to_empty()`` + ``reset_parameters()`` convention of meta-device initialisation)
re-initialises the parameters as the layer's own class does and then the buffers (:meth:`LowpTrainingLinear
.reset_lowp_buffers`), so a model built on the meta device and converted there initialises completely.

:func:`bf16_tail_filter` is the selection of the NVFP4 paper: the last ~15 % of the transformer blocks, the output
head and the MoE routers stay in high precision (in whatever dtype the model runs them: bf16 in a bf16 model or
under autocast); everything else (attention projections, MLPs, experts) is converted. Embeddings, norms and
attention scores are not ``nn.Linear`` and are never touched.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from torchnext.lowp.errors import FormatError
from torchnext.lowp.hadamard import rht_signs
from torchnext.lowp.rng import stream_seed
from torchnext.lowp.training.function import lowp_linear
from torchnext.lowp.training.recipe import Recipe

__all__ = [
    "CALLS_PER_STEP",
    "RHT_STREAM",
    "LowpConversionPlan",
    "LowpConversionWarning",
    "LowpTrainingLinear",
    "bf16_tail_filter",
    "convert_to_lowp_training",
    "layer_id",
    "lowp_training_class",
    "plan_lowp_training",
    "set_lowp_step",
]

ModuleFilter = Callable[[nn.Module, str], bool]

RHT_STREAM = 0x524854
"""The last part of a layer's RHT sign stream seed, ``stream_seed(seed, layer, RHT_STREAM)`` ("RHT" in ASCII)."""


def layer_id(fqn: str) -> int:
    """The layer part of the seeds: ``crc32(fqn)`` (stable across processes and conversions)."""
    return zlib.crc32(fqn.encode()) & 0x7FFFFFFF


class LowpTrainingLinear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in low precision (:func:`~torchnext.lowp.training
    .function.lowp_linear`); parameters stay in their dtype. Build it with :meth:`from_linear` or
    :func:`convert_to_lowp_training`."""

    lowp_step: torch.Tensor
    rht_signs: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Recipe,
        seed: int = 0,
        fqn: str = "",
        quantizer: str = "auto",
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe, seed=seed, fqn=fqn, quantizer=quantizer, backend=backend)

    def _setup(self, recipe: Recipe, *, seed: int, fqn: str, quantizer: str, backend: str) -> None:
        if not isinstance(recipe, Recipe):
            raise FormatError(f"LowpTrainingLinear: recipe must be a torchnext.lowp.Recipe, got {type(recipe).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise FormatError(f"LowpTrainingLinear: seed must be an int in [0, 2**63), got {seed!r}")
        self.recipe = recipe
        self.seed = seed
        self.fqn = fqn
        self.layer = layer_id(fqn)
        self.quantizer = quantizer
        self.backend = backend
        device = self.weight.device
        self.register_buffer("lowp_step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("lowp_seed", torch.tensor(seed, dtype=torch.int64, device=device))
        self.register_buffer("rht_signs", self._initial_signs(device))
        self._register_load_state_dict_pre_hook(_fill_missing_lowp_buffers, with_module=True)
        self.register_load_state_dict_post_hook(_adopt_loaded_seed)

    def _initial_signs(self, device: torch.device) -> torch.Tensor | None:
        if not self.recipe.rht:
            return None
        signs = rht_signs(stream_seed(self.seed, self.layer, RHT_STREAM))  # drawn on the CPU: meta has no values
        return signs.to(device)

    @torch.no_grad()
    def reset_lowp_buffers(self) -> None:
        """Give the buffers their initial values in place, on their current device (after ``to_empty()``, whose
        memory is uninitialised): ``lowp_step = 0``, ``lowp_seed = self.seed``, ``rht_signs`` from the seed."""
        self.lowp_step.zero_()
        cast(torch.Tensor, self.lowp_seed).fill_(self.seed)
        if self.rht_signs is not None:
            signs = self._initial_signs(self.rht_signs.device)
            assert signs is not None  # a recipe with RHT draws signs
            self.rht_signs.copy_(signs)

    def reset_parameters(self) -> None:
        """The parameters as the layer's own class initialises them, then :meth:`reset_lowp_buffers` (called from
        ``nn.Linear.__init__`` too, before the buffers exist: then only the parameters)."""
        super().reset_parameters()
        if "lowp_step" in self._buffers:
            self.reset_lowp_buffers()

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Recipe, *, seed: int = 0, fqn: str = "", quantizer: str = "auto",
        backend: str = "auto",
    ) -> LowpTrainingLinear:
        """A training layer sharing ``linear``'s parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise FormatError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        mod.weight = linear.weight
        mod.bias = linear.bias
        mod._setup(recipe, seed=seed, fqn=fqn, quantizer=quantizer, backend=backend)
        mod.train(linear.training)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise FormatError(f"LowpTrainingLinear({self.fqn}): input has {x.shape[-1]} features, expected {self.in_features}")
        if self.training and torch.is_grad_enabled():
            # increment first, then derive this call's step arithmetically: a clone taken before the in-place add
            # can be aliased to the mutated buffer by torch.compile (the saved step then reads one too many)
            self.lowp_step.add_(1)
            step = self.lowp_step - 1
        else:
            step = self.lowp_step + 0
        return lowp_linear(
            x, self.weight, self.bias, recipe=self.recipe, step=step, rht_signs=self.rht_signs, seed=self.seed,
            layer=self.layer, quantizer=self.quantizer, backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fqn={self.fqn!r}"


def _fill_missing_lowp_buffers(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Loading a checkpoint of the unconverted model: its missing lowp buffers keep their current values."""
    for name in ("lowp_step", "lowp_seed", "rht_signs"):
        buf = getattr(module, name, None)
        if buf is not None and prefix + name not in state_dict:
            state_dict[prefix + name] = buf.detach().clone()


CALLS_PER_STEP = 1 << 20
"""Forward calls a layer may make within one training step before it would reach the next step's streams."""


def set_lowp_step(model: nn.Module, step: int) -> int:
    """Start training step ``step``: every low-precision training layer's ``lowp_step`` counter becomes
    ``step * CALLS_PER_STEP`` (then counts that step's forward calls); returns how many layers were set.

    Raises:
        ValueError: ``step`` is not an int in [0, 2**43).
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63 // CALLS_PER_STEP:
        raise ValueError(f"step must be an int in [0, 2**43), got {step!r}")
    n = 0
    for mod in model.modules():
        buf = getattr(mod, "lowp_step", None)
        if isinstance(buf, torch.Tensor) and buf.dtype == torch.int64 and buf.dim() == 0:
            buf.fill_(step * CALLS_PER_STEP)
            n += 1
    return n


def _adopt_loaded_seed(module: nn.Module, incompatible: Any) -> None:
    """After a load, the layer draws from the loaded seed (so a resumed run continues the same streams)."""
    if isinstance(module, LowpTrainingLinear):
        module.seed = int(cast(torch.Tensor, module.lowp_seed).item())


class LowpConversionWarning(UserWarning):
    """:func:`convert_to_lowp_training` left some accepted ``nn.Linear`` modules in high precision; the message
    names each (fqn, class) and why."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LowpConversionPlan:
    """What :func:`convert_to_lowp_training` does to a model, decided before anything changes."""

    replaced: tuple[str, ...]
    """fqns of exact ``nn.Linear`` modules replaced by a :class:`LowpTrainingLinear` sharing their parameters."""
    converted_in_place: tuple[str, ...]
    """fqns of ``nn.Linear`` subclasses whose class becomes ``lowp_training_class(type(module))``."""
    skipped: tuple[tuple[str, str], ...]
    """(fqn, reason) of accepted ``nn.Linear`` modules left as they are."""
    already_converted: tuple[str, ...]
    """fqns of modules that already are :class:`LowpTrainingLinear` (left alone)."""

    @property
    def converted(self) -> tuple[str, ...]:
        """Every fqn that trains in low precision after the conversion (sorted)."""
        return tuple(sorted(self.replaced + self.converted_in_place))


_LOWP_CLASSES: dict[type[nn.Linear], type[LowpTrainingLinear]] = {}


def lowp_training_class(cls: type[nn.Linear]) -> type[LowpTrainingLinear]:
    """The low-precision training class of an ``nn.Linear`` subclass: ``class Lowp<cls>(LowpTrainingLinear, cls)``
    (made once per class, cached): the forward of :class:`LowpTrainingLinear`, everything else of ``cls``;
    ``LowpTrainingLinear`` itself for ``nn.Linear``.

    Raises:
        FormatError: ``cls`` is not an ``nn.Linear`` subclass, or it overrides ``forward``.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
        raise FormatError(f"lowp_training_class expects an nn.Linear subclass, got {cls!r}")
    if issubclass(cls, LowpTrainingLinear):
        return cls
    if cls is nn.Linear:
        return LowpTrainingLinear
    reason = _subclass_skip_reason(cls)
    if reason is not None:
        raise FormatError(f"lowp_training_class({cls.__qualname__}): {reason}")
    made = _LOWP_CLASSES.get(cls)
    if made is None:
        made = cast(type[LowpTrainingLinear], type(f"Lowp{cls.__name__}", (LowpTrainingLinear, cls), {
            "__module__": cls.__module__, "__qualname__": f"Lowp{cls.__qualname__}",
            "__doc__": f"{cls.__qualname__} training in low precision (torchnext.lowp.LowpTrainingLinear's forward).",
        }))
        _LOWP_CLASSES[cls] = made
    return made


def _subclass_skip_reason(cls: type[nn.Linear]) -> str | None:
    if cls.forward is not nn.Linear.forward:
        return f"{cls.__qualname__} overrides forward (its own computation would be replaced)"
    return None


def _skip_reason(module: nn.Linear) -> str | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        return f"its weight is not a 2-D floating-point tensor ({getattr(weight, 'dtype', type(weight).__name__)})"
    return _subclass_skip_reason(type(module))


def plan_lowp_training(model: nn.Module, module_filter_fn: ModuleFilter | None = None) -> LowpConversionPlan:
    """What :func:`convert_to_lowp_training` ``(model, recipe, module_filter_fn)`` would do; changes nothing.
    ``model`` itself is reported under the fqn ``""``."""
    replaced: list[str] = []
    in_place: list[str] = []
    skipped: list[tuple[str, str]] = []
    already: list[str] = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if isinstance(mod, LowpTrainingLinear):
            already.append(fqn)
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        reason = _skip_reason(mod)
        if reason is not None:
            skipped.append((fqn, reason))
        elif type(mod) is nn.Linear:
            replaced.append(fqn)
        else:
            in_place.append(fqn)
    return LowpConversionPlan(replaced=tuple(replaced), converted_in_place=tuple(in_place), skipped=tuple(skipped),
                              already_converted=tuple(already))


def convert_to_lowp_training(
    model: nn.Module,
    recipe: Recipe,
    module_filter_fn: ModuleFilter | None = None,
    *,
    seed: int = 0,
    quantizer: str = "auto",
    backend: str = "auto",
    strict: bool = False,
) -> nn.Module:
    """Convert every ``nn.Linear`` of ``model`` (subclasses included) that ``module_filter_fn(module, fqn)``
    accepts (None: all) to train with ``recipe``, in place; returns ``model`` (or the new layer when ``model`` is
    itself an exact ``nn.Linear`` that is accepted). Reference semantics::

        plan = plan_lowp_training(model, module_filter_fn)
        if plan.skipped: (raise FormatError if strict else warn LowpConversionWarning)(plan.skipped)
        for fqn in plan.replaced:            # exact nn.Linear
            set(model, fqn, LowpTrainingLinear.from_linear(get(model, fqn), recipe, fqn=fqn, seed=seed, ...))
        for fqn in plan.converted_in_place:  # subclasses keeping nn.Linear.forward
            m = get(model, fqn); m.__class__ = lowp_training_class(type(m)); m._setup(recipe, fqn=fqn, ...)

    A module reached under several names (shared) is converted once, under its first name.

    Args:
        model: any module.
        recipe: ``Recipe.MXFP8``, ``Recipe.NVFP4`` or a variant.
        module_filter_fn: ``(module, fully qualified name) -> bool``; e.g. :func:`bf16_tail_filter`.
        seed: the model seed (RHT signs, stochastic rounding streams): use the same on every rank.
        quantizer, backend: the quantizer kernel and the ``scaled_mm`` backend (``"auto"``: autotuned).
        strict: raise instead of warning when an accepted Linear cannot be converted.

    Raises:
        FormatError: a bad recipe or seed; with ``strict``, a module that cannot be converted (named, with why).

    Warns:
        LowpConversionWarning: accepted modules that were skipped, each named with its reason.
    """
    if not isinstance(recipe, Recipe):
        raise FormatError(f"convert_to_lowp_training: recipe must be a torchnext.lowp.Recipe, got {type(recipe).__name__}")
    plan = plan_lowp_training(model, module_filter_fn)
    if plan.skipped:
        listing = "; ".join(f"{fqn or '<root>'} ({type(model.get_submodule(fqn)).__qualname__}): {why}"
                            for fqn, why in plan.skipped)
        message = f"convert_to_lowp_training left {len(plan.skipped)} Linear module(s) in high precision: {listing}"
        if strict:
            raise FormatError(message)
        warnings.warn(message, LowpConversionWarning, stacklevel=2)

    def make(child: nn.Linear, fqn: str) -> LowpTrainingLinear:
        return LowpTrainingLinear.from_linear(child, recipe, seed=seed, fqn=fqn, quantizer=quantizer, backend=backend)

    for fqn in plan.converted_in_place:
        mod = model.get_submodule(fqn)
        training = mod.training
        mod.__class__ = lowp_training_class(cast(type[nn.Linear], type(mod)))
        cast(LowpTrainingLinear, mod)._setup(recipe, seed=seed, fqn=fqn, quantizer=quantizer, backend=backend)
        mod.train(training)
    if "" in plan.replaced:
        return make(cast(nn.Linear, model), "")
    made = {id(m): make(m, fqn) for fqn in plan.replaced for m in [cast(nn.Linear, model.get_submodule(fqn))]}
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):  # named_children() would hide a repeated child
            if child is not None and id(child) in made:  # every name of a shared module gets the one replacement
                setattr(parent, child_name, made[id(child)])
    return model


def _block_list(model: nn.Module) -> tuple[str, int] | None:
    """(fqn, length) of the model's transformer block list: the outermost ``nn.ModuleList`` of one module type
    that holds Linear layers (the longest such list at that depth; a MoE's expert list sits deeper)."""
    best: tuple[int, int, str] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(c) for c in mod}) == 1:
            if any(isinstance(m, nn.Linear) for m in mod.modules()):
                key = (name.count(".") if name else -1, -len(mod), name)
                if best is None or key < best:
                    best = key
    return None if best is None else (best[2], -best[1])


def bf16_tail_filter(
    model: nn.Module,
    *,
    tail_fraction: float = 0.15,
    keep_names: Iterable[str] = ("head", "lm_head", "output", "router", "gate"),
    block_list: str | None = None,
) -> ModuleFilter:
    """A ``module_filter_fn`` keeping in high precision what the NVFP4 paper keeps: the last
    ``ceil(tail_fraction * n_blocks)`` blocks of the model's block list, and every Linear whose own name (last fqn
    component) is in ``keep_names`` (output head, MoE routers/gates). Everything else is converted.

    ``block_list``: the fqn of the ``nn.ModuleList`` of blocks; None finds it: the outermost ModuleList of one
    module type holding Linear layers (``model.layers``, ``model.blocks``, ``transformer.h``, ...).

    Raises:
        ValueError: ``tail_fraction`` outside [0, 1], or ``block_list`` names no ModuleList.
    """
    if not 0.0 <= tail_fraction <= 1.0:
        raise ValueError(f"tail_fraction must be in [0, 1], got {tail_fraction}")
    names = frozenset(keep_names)
    if block_list is not None:
        found = dict(model.named_modules()).get(block_list)
        if not isinstance(found, nn.ModuleList):
            raise ValueError(f"block_list={block_list!r} is not an nn.ModuleList of {type(model).__name__}")
        blocks: tuple[str, int] | None = (block_list, len(found))
    else:
        blocks = _block_list(model)
    kept_prefixes: list[str] = []
    if blocks is not None:
        list_name, n = blocks
        tail = math.ceil(tail_fraction * n - 1e-9)
        kept_prefixes = [f"{list_name}.{i}." if list_name else f"{i}." for i in range(n - tail, n)]

    def keep_low_precision(module: nn.Module, fqn: str) -> bool:
        if fqn.rsplit(".", 1)[-1] in names:
            return False
        return not any(fqn.startswith(p) for p in kept_prefixes)

    return keep_low_precision
