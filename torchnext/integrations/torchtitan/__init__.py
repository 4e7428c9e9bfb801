"""torchnext inside torchtitan (>= 0.3.0; the ``[titan]`` extra).

torchtitan 0.3.0 has no string registry of model converters (no ``--model.converters``): a converter is a
``ModelConfigConverter`` whose ``convert(model_config)`` rewrites the config tree before the model is built, listed
in a ``config_registry`` function. So the low-precision converter comes in the two forms torchtitan takes:

* :class:`TorchnextLowpConverter` -- ``model_registry("debugmodel", converters=[TorchnextLowpConverter.Config(
  recipe="mxfp8", fqns=["layers"])])`` in your own config function: every ``Linear.Config`` whose fqn contains one of
  ``fqns`` (empty: all) becomes a :class:`TorchnextLowpLinear.Config`;
* ready-made config functions in :mod:`torchnext.integrations.torchtitan.config_registry`, reached from the command
  line as torchtitan reaches its own: ``-m torchtitan.train --module torchnext.integrations.torchtitan --config
  llama3_debugmodel_torchnext_mxfp8`` (or ``..._nvfp4``).

:class:`TorchnextLowpLinear` is torchtitan's ``Linear`` trained through :class:`torchnext.lowp.LowpTrainingLinear`
(``lowp_training_class(Linear)``): it keeps torchtitan's module protocol (``init_states``, ``param_init``,
sharding) and resets its low-precision buffers in ``_init_self_buffers`` (torchtitan builds on the meta device,
then ``to_empty`` and ``init_states``).

Process group: torchtitan calls ``init_process_group`` with the device's default backend and skips it when a
group exists; ``torchnext run`` (torchrun whose workers get torchnext groups) runs it on ``backend="torchnext"``
unedited: ``torchnext run --nproc-per-node 2 -m torchtitan.train --module ... --config ...``.

Fault tolerance: :class:`FaultTolerantTrainer` is torchtitan's trainer on :mod:`torchnext.ft` (replica groups, one
``torchnext run`` job each, FT-HSDP over ``ft.device_mesh``, healing), reached as ``--config
llama3_debugmodel_torchnext_ft``; or semi-synchronous, DiLoCo / LocalSGD across the groups
(``--fault_tolerance.semi_sync_method diloco|local_sgd``, ``--config llama3_debugmodel_torchnext_diloco``:
:mod:`torchnext.integrations.torchtitan.semi_sync`); see :mod:`torchnext.integrations.torchtitan.ft`.
"""

from torchnext.integrations.torchtitan.converter import TorchnextLowpConverter as TorchnextLowpConverter
from torchnext.integrations.torchtitan.converter import TorchnextLowpLinear as TorchnextLowpLinear
from torchnext.integrations.torchtitan.ft import FaultTolerance as FaultTolerance
from torchnext.integrations.torchtitan.ft import FaultTolerantTrainer as FaultTolerantTrainer

__all__ = ["FaultTolerance", "FaultTolerantTrainer", "TorchnextLowpConverter", "TorchnextLowpLinear"]
