"""The torchtitan low-precision converter (the [titan] extra): torchtitan's llama3 debug model built through
``TorchnextLowpConverter`` has every Linear converted (31 of 31; ``convert_to_lowp_training`` of torch's exact
``nn.Linear`` type converted 0 before subclasses were handled), satisfies torchtitan's module protocol, and its own
meta-device initialisation gives the parameters the unconverted model gets plus initialised lowp buffers."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.titan, pytest.mark.timeout(300)]
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchnext[titan])")

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from torchnext.integrations.torchtitan import TorchnextLowpConverter, TorchnextLowpLinear  # noqa: E402
from torchnext.lowp import FormatError  # noqa: E402
from torchnext.lowp.training import LowpTrainingLinear, Recipe  # noqa: E402


def _build(converters: list[TorchnextLowpConverter.Config] | None) -> torch.nn.Module:
    spec = model_registry("debugmodel", converters=converters)
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    for b in model.buffers():  # uninitialised memory may hold anything
        if b.dtype == torch.int64:
            b.fill_(7)
    torch.manual_seed(0)
    model.init_states()
    return model


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_every_linear_converted_and_initialised_as_torchtitan_does(recipe: str) -> None:
    ref = _build(None)
    model = _build([TorchnextLowpConverter.Config(recipe=recipe, seed=3)])
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 31
    assert all(isinstance(m, TorchnextLowpLinear) and isinstance(m, Linear) for m in linears.values())
    assert {m.fqn for m in linears.values()} == set(linears)  # the layer part of the seeds is the module fqn
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name  # torchtitan's own init, unchanged by the conversion
    for m in linears.values():
        assert int(m.lowp_step) == 0 and int(m.lowp_seed) == 3
        assert m.recipe == (Recipe.NVFP4 if recipe == "nvfp4" else Recipe.MXFP8)
        if m.rht_signs is not None:
            assert bool(((m.rht_signs == 1) | (m.rht_signs == -1)).all())
    # a converted layer computes what torchnext's LowpTrainingLinear computes on the same weights
    lin = linears["layers.0.feed_forward.w1"]
    x = torch.randn(16, lin.in_features)
    plain = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    plain.weight = torch.nn.Parameter(lin.weight.detach().clone())
    twin = LowpTrainingLinear.from_linear(plain, lin.recipe, seed=3, fqn="layers.0.feed_forward.w1")
    assert torch.equal(lin(x), twin(x))


def test_fqn_filter_and_bad_recipe() -> None:
    model = _build([TorchnextLowpConverter.Config(recipe="nvfp4", fqns=["layers"])])
    converted = {n for n, m in model.named_modules() if isinstance(m, TorchnextLowpLinear)}
    assert len(converted) == 30 and all(n.startswith("layers.") for n in converted)  # the output head stays
    assert not isinstance(model.get_submodule("lm_head"), TorchnextLowpLinear)
    with pytest.raises(FormatError, match="unknown recipe 'fp3'"):
        TorchnextLowpConverter.Config(recipe="fp3").build()


def test_the_core_never_imports_torchtitan() -> None:
    import subprocess
    import sys

    code = ("import sys, torchnext, torchnext.lowp, torchnext.comms, torchnext.ft, torchnext.testing, torchnext.cli; "
            "sys.exit(int('torchtitan' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
