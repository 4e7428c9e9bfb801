"""The torchtitan model converter that trains Linear layers in MXFP8 / NVFP4 through torchnext.lowp.

Reference semantics of :meth:`TorchnextLowpConverter.convert`::

    for fqn, cfg, parent, attr in model_config.traverse(Linear.Config):
        if (not fqns or any(f in fqn for f in fqns)) and owner(cfg) keeps nn.Linear.forward:
            replace cfg by TorchnextLowpLinear.Config(**cfg's fields, recipe=recipe, seed=seed, fqn=fqn)
        elif accepted: log it as skipped, with the reason
    return model_config
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear

from torchnext.lowp.errors import FormatError
from torchnext.lowp.training import Recipe, lowp_training_class

__all__ = ["RECIPES", "TorchnextLowpConverter", "TorchnextLowpLinear"]

_LOG = logging.getLogger("torchnext.integrations.torchtitan")

RECIPES: dict[str, Recipe] = {"mxfp8": Recipe.MXFP8, "nvfp4": Recipe.NVFP4}
"""The converter's ``recipe`` names; any ``Recipe.key`` is accepted too."""


def recipe_named(name: str) -> Recipe:
    """``RECIPES[name]`` or ``Recipe.from_key(name)``; ``FormatError`` naming the known names otherwise."""
    found = RECIPES.get(name)
    if found is not None:
        return found
    try:
        return Recipe.from_key(name)
    except (FormatError, ValueError, KeyError) as exc:
        raise FormatError(f"torchnext_lowp: unknown recipe {name!r}; expected one of {sorted(RECIPES)} or a "
                          f"Recipe.key") from exc


_Base = cast(type[Linear], lowp_training_class(Linear))


class TorchnextLowpLinear(_Base):  # type: ignore[misc, valid-type]
    """torchtitan's ``Linear`` whose three GEMMs run in low precision (:class:`torchnext.lowp.LowpTrainingLinear`);
    torchtitan's module protocol (``init_states``, ``param_init``, sharding) is Linear's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = "mxfp8"
        """``mxfp8``, ``nvfp4`` or a ``torchnext.lowp.Recipe`` key."""
        seed: int = 0
        """The model seed of the layer's streams (RHT signs, stochastic rounding): the same on every rank."""
        fqn: str = ""
        """The layer's fqn: the layer part of its seeds (set by the converter)."""

    def __init__(self, config: Config) -> None:
        Linear.__init__(self, config)
        self._setup(recipe_named(config.recipe), seed=config.seed, fqn=config.fqn, quantizer="auto", backend="auto")

    def _init_self_buffers(self, *, buffer_device: Any = None) -> None:
        """torchtitan's ``init_states`` hook: after ``to_empty`` the buffers hold garbage; give them their values."""
        parent = getattr(super(), "_init_self_buffers", None)
        if callable(parent):
            parent(buffer_device=buffer_device)
        self.reset_lowp_buffers()


def _skip_reason(config: Any) -> str | None:
    owner = getattr(type(config), "_owner", None)
    if isinstance(owner, type) and issubclass(owner, nn.Linear) and owner.forward is not nn.Linear.forward:
        return f"{owner.__qualname__} overrides forward"
    return None


class TorchnextLowpConverter(QuantizationConverter):
    """Swap matching ``Linear.Config`` entries for :class:`TorchnextLowpLinear.Config` before the model is built."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "mxfp8"
        """``mxfp8``, ``nvfp4`` or a ``torchnext.lowp.Recipe`` key."""
        fqns: list[str] = field(default_factory=list)
        """Convert the Linear configs whose fqn contains one of these (empty: every Linear)."""
        seed: int = 0
        """The model seed (use the same on every rank)."""

    def __init__(self, config: Config) -> None:
        recipe_named(config.recipe)  # fail at build time, naming the recipe
        self.config = config
        self.converted: list[str] = []
        self.skipped: list[tuple[str, str]] = []

    def convert(self, model_config: Any) -> Any:
        cfg = self.config
        for fqn, lin, parent, attr in list(model_config.traverse(Linear.Config)):
            if isinstance(lin, TorchnextLowpLinear.Config) or (cfg.fqns and not any(f in fqn for f in cfg.fqns)):
                continue
            why = _skip_reason(lin)
            if why is not None:
                self.skipped.append((fqn, why))
                continue
            shared = {f.name: getattr(lin, f.name) for f in dataclasses.fields(Linear.Config)}
            new = TorchnextLowpLinear.Config(**shared, recipe=cfg.recipe, seed=cfg.seed, fqn=fqn)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[cast(int, attr)] = new
            else:
                setattr(parent, cast(str, attr), new)
            self.converted.append(fqn)
        _LOG.info("torchnext_lowp (%s): %d Linear layers converted%s", cfg.recipe, len(self.converted),
                  "".join(f"; skipped {f}: {w}" for f, w in self.skipped))
        return model_config
