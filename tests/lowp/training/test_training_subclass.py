"""convert_to_lowp_training on nn.Linear subclasses: converted in place (class swap) keeping the model's own
initialisation, or skipped with the reason named; the plan; shared modules; meta-device initialisation."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnext.lowp import FormatError
from torchnext.lowp.training import (
    LowpConversionWarning,
    LowpTrainingLinear,
    Recipe,
    convert_to_lowp_training,
    lowp_training_class,
    plan_lowp_training,
)

RECIPES = [Recipe.MXFP8, Recipe.NVFP4]


class ProtocolLinear(nn.Linear):
    """A Linear carrying its own init protocol, as torchtitan's ``Linear`` does (nn.Linear + its Module)."""

    init_std: float

    def __init__(self, d_in: int, d_out: int, *, init_std: float = 0.02) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.init_std = init_std

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=getattr(self, "init_std", 0.02))

    def init_states(self) -> None:  # the model's protocol (torchtitan: Module.init_states)
        self.reset_parameters()


class ScaledLinear(nn.Linear):
    """Overrides forward: converting it would drop its own computation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 0.5


class Net(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = ProtocolLinear(d, 2 * d, init_std=0.05)
        self.down = ProtocolLinear(2 * d, d)
        self.scaled = ScaledLinear(d, d)
        self.plain = nn.Linear(d, d)

    def init_states(self) -> None:
        for m in self.modules():
            if isinstance(m, ProtocolLinear):
                m.init_states()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.scaled(self.down(torch.relu(self.up(x)))))


def test_plan_names_what_is_converted_and_what_is_skipped() -> None:
    net = Net()
    plan = plan_lowp_training(net)
    assert plan.replaced == ("plain",)
    assert plan.converted_in_place == ("up", "down")
    assert plan.converted == ("down", "plain", "up")
    assert [fqn for fqn, _ in plan.skipped] == ["scaled"]
    assert "ScaledLinear overrides forward" in plan.skipped[0][1]
    assert plan_lowp_training(net, lambda m, fqn: fqn != "scaled").skipped == ()
    assert isinstance(net.up, ProtocolLinear) and not isinstance(net.up, LowpTrainingLinear)  # the plan changes nothing


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.format)
def test_subclasses_convert_in_place_and_compute_like_a_replaced_layer(recipe: Recipe) -> None:
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    up, up_weight = net.up, net.up.weight
    with pytest.warns(LowpConversionWarning, match=r"1 Linear module\(s\).*scaled \(ScaledLinear\): ScaledLinear overrides forward"):
        out = convert_to_lowp_training(net, recipe, seed=3)
    assert out is net and net.up is up and net.up.weight is up_weight  # the same object, its parameters shared
    for name in ("up", "down"):
        mod = getattr(net, name)
        assert isinstance(mod, ProtocolLinear) and isinstance(mod, LowpTrainingLinear) and mod.fqn == name
        assert type(mod) is lowp_training_class(ProtocolLinear) and type(mod).__name__ == "LowpProtocolLinear"
    assert type(net.scaled) is ScaledLinear and type(net.plain) is LowpTrainingLinear
    assert net.up.init_std == 0.05  # its own attributes stay

    # the converted subclass computes what an exact nn.Linear replaced by LowpTrainingLinear computes
    x = torch.randn(8, 64)
    plain = nn.Linear(64, 128, bias=False)
    plain.weight = nn.Parameter(ref.up.weight.detach().clone())
    twin = LowpTrainingLinear.from_linear(plain, recipe, seed=3, fqn="up")
    got, want = net.up(x), twin(x)
    assert torch.equal(got, want)
    assert not torch.equal(got, F.linear(x, ref.up.weight))  # it really runs in low precision
    got.sum().backward()
    want.sum().backward()
    assert net.up.weight.grad is not None and twin.weight.grad is not None
    assert torch.equal(net.up.weight.grad, twin.weight.grad)
    assert set(net.state_dict()) == set(ref.state_dict()) | {
        f"{n}.{b}" for n in ("up", "down", "plain") for b in ("lowp_step", "lowp_seed", *(["rht_signs"] * recipe.rht))}


def test_strict_raises_naming_the_module() -> None:
    net = Net()
    with pytest.raises(FormatError, match=r"scaled \(ScaledLinear\): ScaledLinear overrides forward"):
        convert_to_lowp_training(net, Recipe.MXFP8, strict=True)
    assert type(net.up) is ProtocolLinear  # nothing converted
    with pytest.raises(FormatError, match="overrides forward"):
        lowp_training_class(ScaledLinear)
    with pytest.raises(FormatError, match=r"nn\.Linear subclass"):
        lowp_training_class(nn.Conv1d)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a filter that excludes the skipped module: no warning
        convert_to_lowp_training(net, Recipe.MXFP8, lambda m, fqn: fqn != "scaled")
    assert convert_to_lowp_training(net, Recipe.NVFP4, lambda m, fqn: fqn != "scaled") is net  # idempotent
    assert net.up.recipe == Recipe.MXFP8


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.format)
def test_meta_device_model_keeps_its_own_initialisation(recipe: Recipe) -> None:
    """Build on meta, convert, ``to_empty``, run the model's own init: the parameters are what the unconverted
    model's init gives under the same seed, and the lowp buffers are initialised (not to_empty's garbage)."""
    with torch.device("meta"):
        net = Net()
    convert_to_lowp_training(net, recipe, lambda m, fqn: fqn != "scaled", seed=11)
    net.to_empty(device="cpu")
    for m in net.modules():  # fill the buffers with garbage, as uninitialised memory may hold
        for b in m.buffers(recurse=False):
            b.fill_(7)
    torch.manual_seed(5)
    net.init_states()  # the model's own protocol: ProtocolLinear.reset_parameters through the converted class
    ref = Net()
    ref.to_empty(device="cpu")
    torch.manual_seed(5)
    ref.init_states()
    assert torch.equal(net.up.weight, ref.up.weight) and torch.equal(net.down.weight, ref.down.weight)
    assert 0.03 < float(net.up.weight.detach().std()) < 0.06  # its own init_std, not nn.Linear's kaiming init
    fresh = lowp_training_class(ProtocolLinear)
    for name in ("up", "down"):
        mod = getattr(net, name)
        assert isinstance(mod, fresh)
        assert int(mod.lowp_step) == 0 and int(mod.lowp_seed) == 11
        if recipe.rht:
            cpu = Net()
            convert_to_lowp_training(cpu, recipe, lambda m, fqn: fqn != "scaled", seed=11)
            assert torch.equal(mod.rht_signs, getattr(cpu, name).rht_signs)
    net.plain.reset_parameters()  # the replaced exact Linear: nn.Linear's init, then its buffers
    assert int(net.plain.lowp_step) == 0 and int(net.plain.lowp_seed) == 11


def test_shared_module_is_replaced_under_every_name() -> None:
    lin = nn.Linear(32, 32)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    plan = plan_lowp_training(model)
    assert plan.replaced == ("0",)
    convert_to_lowp_training(model, Recipe.MXFP8)
    assert isinstance(model[0], LowpTrainingLinear) and model[0] is model[2] and model[0].weight is lin.weight


def test_root_subclass_is_converted_in_place() -> None:
    lin = ProtocolLinear(32, 64)
    assert convert_to_lowp_training(lin, Recipe.MXFP8) is lin
    assert isinstance(lin, LowpTrainingLinear) and lin.fqn == ""
