"""Autotuning never changes results: with ``TORCHNEXT_AUTOTUNE=1`` the timing chooses only among candidates bitwise
equal to the static choice, so NVFP4 and MXFP8 training gives the same losses whichever backend the timings favour
(and the same as with the autotuner off); ``TORCHNEXT_AUTOTUNE=fastest`` admits the others (and then NVFP4 losses
depend on the timings: the proof that the rule is what keeps them equal)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchnext.lowp import quantize, scaled_mm
from torchnext.lowp.mm import autotune as at
from torchnext.lowp.mm.backends import BACKENDS, get_backend, register_backend
from torchnext.lowp.mm.scaled_mm import make_problem
from torchnext.lowp.training import Recipe, convert_to_lowp_training

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE_CACHE", str(path))
    at.clear_memory_cache()
    yield path
    at.clear_memory_cache()


def _rig(monkeypatch: pytest.MonkeyPatch, favourite: str) -> None:
    """Timings that always make ``favourite`` the fastest candidate (the others run, but 'take' longer)."""
    real = at._time

    def rigged(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
        real(fn, device, warmup, 0)
        name = (fn.__defaults__ or ("",))[0]
        name = name if isinstance(name, str) else getattr(name, "name", "")
        return 1.0 if name == favourite else 2.0

    monkeypatch.setattr(at, "_time", rigged)


def _train(recipe: Recipe, steps: int = 3) -> tuple[list[str], set[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 64))
    convert_to_lowp_training(model, recipe, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x = torch.randn(96, 256, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    chosen = {r.backend for r in at._MEMORY.values()}
    at.clear_memory_cache()
    return losses, chosen


def _candidates(recipe: Recipe) -> list[str]:
    fmt = "nvfp4" if recipe.format == "nvfp4" else "mxfp8_e4m3"
    a, w = quantize(torch.randn(96, 256), fmt), quantize(torch.randn(512, 256), fmt)
    return at.eligible_backends(make_problem(a, w, None))


@pytest.mark.parametrize("recipe", [Recipe.NVFP4, Recipe.MXFP8], ids=lambda r: r.format)
def test_training_losses_do_not_depend_on_the_timings(recipe: Recipe, cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    names = _candidates(recipe)
    assert len(names) >= 2, f"needs two candidates to mean anything, has {names}"
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "0")
    static, _ = _train(recipe)
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "1")
    for favourite in names:  # each candidate made the fastest in turn: a new process with other timings
        cache.unlink(missing_ok=True)
        _rig(monkeypatch, favourite)
        losses, _ = _train(recipe)
        assert losses == static, f"{recipe.format}: timings favouring {favourite} changed the losses"
    # what was recorded says why a faster candidate was passed over
    entries = json.loads(cache.read_text())["entries"]
    assert all(e["policy"] == "bitwise" for e in entries.values())


def test_fastest_policy_lets_timings_change_nvfp4_results(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule the same runs differ: the test above can fail."""
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "fastest")
    runs = {}
    for favourite in _candidates(Recipe.NVFP4):
        cache.unlink(missing_ok=True)
        _rig(monkeypatch, favourite)
        runs[favourite] = _train(Recipe.NVFP4)
    assert len({tuple(losses) for losses, _ in runs.values()}) > 1, runs
    assert all(chosen == {fav} for fav, (_, chosen) in runs.items())  # the timings decided


class _Shifted:
    """A fast candidate within tolerance whose bits differ from the static choice (one ulp up)."""

    autotune_candidate = True
    name = "t_shifted"

    def capability(self) -> Any:
        return get_backend("eager").capability()

    def available(self) -> tuple[bool, str]:
        return True, "test"

    def supports(self, problem: Any) -> str | None:
        return None

    def run(self, problem: Any) -> Any:
        out = get_backend("eager").run(problem)
        out.output = torch.nextafter(out.output, torch.full_like(out.output, float("inf")))
        return out


def test_bitwise_rule_names_the_excluded_candidate_and_a_stale_policy_is_retuned(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    register_backend(_Shifted(), overwrite=True)  # type: ignore[arg-type]
    try:
        monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "fastest")
        _rig(monkeypatch, "t_shifted")
        a, w = torch.randn(5, 64), quantize(torch.randn(32, 64), "nvfp4")
        problem = make_problem(a, w, None)
        scaled_mm(a, w)
        assert at.memory_record(problem).backend == "t_shifted"  # type: ignore[union-attr]
        monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "1")  # the disk entry was made under "fastest": not reused
        scaled_mm(a, w)
        rec = at.memory_record(problem)
        assert rec is not None and rec.policy == "bitwise" and rec.backend != "t_shifted"
        assert "not bitwise equal" in rec.rejected["t_shifted"]
        assert json.loads(cache.read_text())["entries"][rec.key]["policy"] == "bitwise"
    finally:
        BACKENDS.pop("t_shifted", None)
