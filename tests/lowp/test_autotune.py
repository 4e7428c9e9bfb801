"""Autotuner: selection, correctness gate, memory + disk cache, modes, corrupt cache (cache isolated in tmp)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torchnext.lowp import Epilogue, quantize, scaled_mm
from torchnext.lowp.mm import autotune as at
from torchnext.lowp.mm.backends import BACKENDS, Capability, Problem, get_backend, register_backend
from torchnext.lowp.mm.epilogue import EpilogueOutput, apply_epilogue
from torchnext.lowp.mm.scaled_mm import make_problem


class _Fake:
    """A test backend: eager math, optionally slowed down or made wrong."""

    autotune_candidate = True

    def __init__(self, name: str, *, delay: float = 0.0, wrong: bool = False, crash: bool = False) -> None:
        self.name, self.delay, self.wrong, self.crash = name, delay, wrong, crash
        self.calls = 0

    def capability(self) -> Capability:
        return Capability(devices=frozenset({"cpu"}), formats=frozenset({"dense", "nvfp4", "mxfp8_e4m3"}))

    def available(self) -> tuple[bool, str]:
        return True, "test"

    def supports(self, problem: Problem) -> str | None:
        return None

    def run(self, problem: Problem) -> EpilogueOutput:
        self.calls += 1
        if self.crash:
            raise RuntimeError("boom")
        time.sleep(self.delay)
        out = get_backend("eager").run(problem)
        if self.wrong:
            return apply_epilogue(out.output * 1.5, Epilogue(), problem.out_dtype)
        return out


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "cache" / "autotune.json"
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE_CACHE", str(path))
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "1")
    get_backend("eager")  # load the built-ins
    # keep the real backends out of the way: only the fakes are candidates
    for name in list(BACKENDS):
        monkeypatch.setattr(BACKENDS[name], "autotune_candidate", False, raising=False)
    at.clear_memory_cache()
    added: list[str] = []
    monkeypatch.setattr(at, "_added", added, raising=False)
    yield path
    for name in added:
        BACKENDS.pop(name, None)
    at.clear_memory_cache()


def _add(isolated_added: list[str], *fakes: _Fake) -> None:
    for f in fakes:
        register_backend(f, overwrite=True)  # type: ignore[arg-type]
        isolated_added.append(f.name)


def _problem(m: int = 3) -> tuple[torch.Tensor, object]:
    return torch.randn(m, 64), quantize(torch.randn(32, 64), "nvfp4")


def test_picks_fastest_correct_and_caches(isolated: Path, caplog: pytest.LogCaptureFixture) -> None:
    fast_wrong, crash = _Fake("t_fast_wrong", wrong=True), _Fake("t_crash", crash=True)
    slow, fast = _Fake("t_slow", delay=0.02), _Fake("t_fast", delay=0.0)
    _add(at._added, fast_wrong, crash, slow, fast)  # type: ignore[attr-defined]
    a, w = _problem()
    with caplog.at_level(logging.INFO, logger="torchnext.lowp.mm.autotune"):
        y = scaled_mm(a, w)  # type: ignore[arg-type]
    assert "chose t_fast" in caplog.text
    rec = at.memory_record(make_problem(a, w, None))  # type: ignore[arg-type]
    assert rec is not None and rec.backend == "t_fast"
    assert "t_fast_wrong" in rec.rejected and "rel L2" in rec.rejected["t_fast_wrong"]
    assert "t_crash" in rec.rejected and "boom" in rec.rejected["t_crash"]
    assert set(rec.times_ms) == {"t_slow", "t_fast"}
    torch.testing.assert_close(y, scaled_mm(a, w, backend="reference"))  # type: ignore[arg-type]
    data = json.loads(isolated.read_text())
    assert data["entries"][rec.key]["backend"] == "t_fast"
    # second call: memory hit, nothing re-timed
    calls = slow.calls
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert slow.calls == calls
    # new process (memory cleared): disk hit, nothing re-timed
    at.clear_memory_cache()
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert slow.calls == calls
    assert at.memory_record(make_problem(a, w, None)).source == "disk"  # type: ignore[arg-type,union-attr]


def test_key_buckets_m_and_epilogue(isolated: Path) -> None:
    a, w = _problem(3)
    p3 = make_problem(a, w, None)  # type: ignore[arg-type]
    p4 = make_problem(torch.randn(4, 64), w, None)  # type: ignore[arg-type]
    p5 = make_problem(torch.randn(5, 64), w, None)  # type: ignore[arg-type]
    pe = make_problem(a, w, Epilogue(activation="relu"))  # type: ignore[arg-type]
    assert at.problem_key(p3) == at.problem_key(p4) != at.problem_key(p5)
    assert at.problem_key(p3) != at.problem_key(pe)
    assert [at.m_bucket(m) for m in (1, 2, 3, 16, 17, 10**6)] == [1, 2, 4, 16, 32, 4096]


def test_corrupt_cache_warns_and_is_ignored(isolated: Path) -> None:
    _add(at._added, _Fake("t_a"), _Fake("t_b", delay=0.01))  # type: ignore[attr-defined]
    isolated.parent.mkdir(parents=True)
    isolated.write_text("{not json")
    a, w = _problem()
    with pytest.warns(at.AutotuneCacheWarning, match="ignoring unreadable autotune cache"):
        scaled_mm(a, w)  # type: ignore[arg-type]
    assert json.loads(isolated.read_text())["version"] == 1  # rewritten atomically, valid again
    isolated.write_text(json.dumps({"version": 1, "entries": {"k": {"nobackend": 1}}}))
    at.clear_memory_cache()
    with pytest.warns(at.AutotuneCacheWarning):
        scaled_mm(a, w)  # type: ignore[arg-type]


def test_readonly_and_off_modes(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, fast = _Fake("t_slow2", delay=0.01), _Fake("t_fast2")
    _add(at._added, slow, fast)  # type: ignore[attr-defined]
    a, w = _problem()
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "readonly")
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert not isolated.exists()  # nothing written
    rec = at.memory_record(make_problem(a, w, None))  # type: ignore[arg-type]
    first = at.eligible_backends(make_problem(a, w, None))[0]  # type: ignore[arg-type]
    assert rec is not None and rec.source == "static" and rec.backend == first == "t_fast2"
    assert fast.calls == 1 and slow.calls == 0  # no timing: one run of the static choice
    at.clear_memory_cache()
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "0")
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert not isolated.exists()
    # readonly uses an existing disk entry
    at.clear_memory_cache()
    isolated.parent.mkdir(parents=True, exist_ok=True)
    key = at.problem_key(make_problem(a, w, None))  # type: ignore[arg-type]
    isolated.write_text(json.dumps({"version": 1, "entries": {key: {"backend": "t_fast2"}}}))
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "readonly")
    before = fast.calls
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert fast.calls == before + 1


def test_stale_disk_entry_for_missing_backend_is_retuned(isolated: Path) -> None:
    _add(at._added, _Fake("t_only"))  # type: ignore[attr-defined]
    a, w = _problem()
    key = at.problem_key(make_problem(a, w, None))  # type: ignore[arg-type]
    isolated.parent.mkdir(parents=True)
    isolated.write_text(json.dumps({"version": 1, "entries": {key: {"backend": "gone_backend"}}}))
    scaled_mm(a, w)  # type: ignore[arg-type]
    assert at.memory_record(make_problem(a, w, None)).backend == "t_only"  # type: ignore[arg-type,union-attr]


def test_real_backends_auto_eligibility() -> None:
    a, w = _problem()
    names = at.eligible_backends(make_problem(a, w, Epilogue(output_amax=True)))  # type: ignore[arg-type]
    assert "reference" not in names and "eager" in names
    if not torch.cuda.is_available():
        assert "triton" not in names and "aten" not in names and "cutlass" not in names


def test_quick_check_uses_exact_corner_of_large_problems(isolated: Path) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(70, 64, generator=g)
    w = quantize(torch.randn(300, 64, generator=g), "nvfp4", swizzle=True)
    ep = Epilogue(scale=torch.rand(70, 1, generator=g), bias=torch.randn(300, generator=g), activation="relu",
                  residual=torch.randn(70, 300, generator=g), output_amax=True)
    p = make_problem(a, w, ep)
    corner = at._corner_problem(p)
    assert (corner.m, corner.n) == (at.CHECK_ROWS, at.CHECK_COLS)
    full = get_backend("reference").run(p)
    sub = get_backend("reference").run(corner)
    torch.testing.assert_close(sub.output, full.output[: corner.m, : corner.n], rtol=0, atol=0)
    good, bad = _Fake("t_good"), _Fake("t_bad", wrong=True)
    _add(at._added, good, bad)  # type: ignore[attr-defined]
    rec = at.tune(p, ["t_good", "t_bad"])
    assert rec.backend == "t_good" and "t_bad" in rec.rejected
