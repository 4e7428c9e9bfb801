"""Low-precision training: MXFP8 and NVFP4 recipes for the three GEMMs of every converted linear layer.

``convert_to_lowp_training(model, Recipe.NVFP4, bf16_tail_filter(model))`` swaps ``nn.Linear`` layers for
:class:`LowpTrainingLinear`, whose one autograd function quantizes X, W and dY as the :class:`Recipe` says
(:func:`torchnext.lowp.quantize_pair`: each copy from the high-precision tensor; 2-D weight tiles, the random
Hadamard transform and stochastic rounding for NVFP4) and runs fprop, dgrad and wgrad through
:func:`torchnext.lowp.scaled_mm` (so every backend and the autotuner serve training). Grouped (MoE) training is
:func:`lowp_grouped_mm`; FSDP2 low-precision all-gathers live in :mod:`torchnext.lowp.training.fsdp`. See
docs/lowp_training.md.
"""

from torchnext.lowp.training.fsdp import enable_fsdp_lowp_all_gather as enable_fsdp_lowp_all_gather
from torchnext.lowp.training.function import lowp_linear as lowp_linear
from torchnext.lowp.training.grouped import LowpGroupedLinear as LowpGroupedLinear
from torchnext.lowp.training.grouped import lowp_grouped_mm as lowp_grouped_mm
from torchnext.lowp.training.module import LowpConversionPlan as LowpConversionPlan
from torchnext.lowp.training.module import LowpConversionWarning as LowpConversionWarning
from torchnext.lowp.training.module import LowpTrainingLinear as LowpTrainingLinear
from torchnext.lowp.training.module import bf16_tail_filter as bf16_tail_filter
from torchnext.lowp.training.module import convert_to_lowp_training as convert_to_lowp_training
from torchnext.lowp.training.module import lowp_training_class as lowp_training_class
from torchnext.lowp.training.module import plan_lowp_training as plan_lowp_training
from torchnext.lowp.training.module import set_lowp_step as set_lowp_step
from torchnext.lowp.training.recipe import Operand as Operand
from torchnext.lowp.training.recipe import Recipe as Recipe

__all__ = [
    "LowpConversionPlan",
    "LowpConversionWarning",
    "LowpGroupedLinear",
    "LowpTrainingLinear",
    "Operand",
    "Recipe",
    "bf16_tail_filter",
    "convert_to_lowp_training",
    "enable_fsdp_lowp_all_gather",
    "lowp_grouped_mm",
    "lowp_linear",
    "lowp_training_class",
    "plan_lowp_training",
    "set_lowp_step",
]
