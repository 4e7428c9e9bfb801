"""The autotuner behind ``scaled_mm(..., backend="auto")``.

For a problem key ``(torch version, device, formats, M bucket, N, K, epilogue signature, out dtype)``::

    candidates = [b for b in registry if b.autotune_candidate and b.available() and b.supports(problem) is None]
    candidates = [b for b in candidates if no other candidate c has b.name in c.supersedes(problem)]
    policy = "fastest" if TORCHNEXT_AUTOTUNE == "fastest" else "bitwise"
    if key in memory or on disk with this policy (and its backend is still a candidate): return it
    if TORCHNEXT_AUTOTUNE in ("0", "readonly"): return first candidate in PREFERENCE      # nothing timed or written
    anchor = None
    for b in candidates:
        out = b.run(problem)                          # warm-up (includes any compile); an exception disqualifies
        if rel_l2(out[:64, :256], reference(corner of problem)) > tol: disqualify   # never pick a wrong backend
        if amax asked and amax != max|out| (rel 1e-2): disqualify
        if policy == "bitwise":
            anchor = anchor or (b, out)               # the first passing candidate: the static preference's
            if bits(out) != bits(anchor.out): disqualify   # never let timing change a result
    times = median over `reps` round-robin rounds of each passing candidate
    choice = argmin(times); memory[key] = disk[key] = (choice, policy); log it

**Under ``torch.compile`` / ``torch.export``** nothing is timed, locked or read inside the trace: the choice is made
at trace time from what is already decided, and becomes a constant of the graph::

    traceable = [b for b in candidates if getattr(b, "traceable", True)]   # not those that compile or launch
    return remembered(key, policy) if it is in traceable else traceable[0]  # memory or disk; else the static order

(``inductor`` is not traceable -- under an outer compile the outer compiler generates that code; ``triton`` and
``cutlass`` launch their own kernels.) Where the eager choice is traceable, compiled and eager calls give the same
bits; under the default policy every tuned choice gives the static choice's bits anyway.

**Results never depend on timing** (``TORCHNEXT_AUTOTUNE=1``, the default): the candidates the timing chooses
among are those whose outputs (dense output, amax, quantized output) are bitwise equal, on the problem being tuned,
to the first candidate that passes the check -- the one ``TORCHNEXT_AUTOTUNE=0`` uses. So two runs of a seed,
two ranks, and a run with the autotuner off give the same bits whatever the timings were (a candidate equal on
one full-size problem computes in the same order; the check is per key, and a key's choice is recorded with its
policy and never changes within a process). ``TORCHNEXT_AUTOTUNE=fastest`` lifts the rule: every candidate within
tolerance competes (faster where kernels round differently; reruns and replicas may then differ in the last bits).

The disk cache is a JSON file (``TORCHNEXT_AUTOTUNE_CACHE``, default ``~/.cache/torchnext/autotune.json``), written
atomically (temp file + ``os.replace``) and merged with entries other processes wrote meanwhile; a corrupt or
unreadable file triggers an :class:`AutotuneCacheWarning` and is ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from torchnext._config import env_config
from torchnext.lowp.mm.backends import BACKENDS, Problem, get_backend
from torchnext.lowp.mm.epilogue import EpilogueOutput
from torchnext.lowp.tensor import BlockScaledTensor
from torchnext.lowp.tracing import compiling, trace_time_constant

__all__ = [
    "PREFERENCE",
    "AutotuneCacheWarning",
    "TuneConfig",
    "TuneRecord",
    "clear_memory_cache",
    "eligible_backends",
    "m_bucket",
    "problem_key",
    "select",
    "tune",
]

log = logging.getLogger("torchnext.lowp.mm.autotune")

PREFERENCE = ("triton", "aten", "cpu", "inductor", "eager", "cutlass")
"""Static order used when timing is off (``TORCHNEXT_AUTOTUNE=0``) or not allowed (``readonly``) for a new key."""

_CACHE_VERSION = 1


class AutotuneCacheWarning(UserWarning):
    """The on-disk autotune cache could not be read (corrupt JSON, wrong schema) and was ignored."""


@dataclass(kw_only=True)
class TuneConfig:
    """Timing and correctness-check parameters."""

    warmup: int = 1
    """Untimed runs per candidate after the first (checked) run."""
    reps: int = 7
    """Timed rounds (each runs every candidate once, round-robin); the median per candidate is used."""
    rtol: float = 1e-3
    """Largest relative L2 error against the reference for fp32/fp64 outputs (1e-2 for 16-bit outputs)."""


@dataclass(kw_only=True)
class TuneRecord:
    """What the autotuner decided for one key."""

    key: str
    backend: str
    times_ms: dict[str, float] = field(default_factory=dict)
    """Median time per candidate that passed the check."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Candidate → why it was disqualified."""
    source: str = "tuned"
    """``tuned``, ``memory``, ``disk`` or ``static``."""
    policy: str = "bitwise"
    """``bitwise`` (the choice gives the static choice's bits) or ``fastest`` (any candidate within tolerance)."""


CONFIG = TuneConfig()
_MEMORY: dict[str, TuneRecord] = {}
_LOCK = threading.RLock()


def clear_memory_cache() -> None:
    """Forget in-memory decisions (the disk cache is untouched)."""
    with _LOCK:
        _MEMORY.clear()


def m_bucket(m: int) -> int:
    """1, 2, 4, 8, ... (next power of two), capped at 4096."""
    return 1 if m <= 1 else min(4096, 1 << (m - 1).bit_length())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def problem_key(problem: Problem) -> str:
    """The cache key of ``problem`` (a readable string)."""
    fa, fw = problem.formats
    dt = str(problem.out_dtype).removeprefix("torch.")
    return (
        f"torch={torch.__version__}|{_device_name(problem.device)}|{fa}x{fw}|m{m_bucket(problem.m)}|n{problem.n}|"
        f"k{problem.k}|{problem.epilogue.signature()}|{dt}"
    )


def eligible_backends(problem: Problem) -> list[str]:
    """Candidates for ``problem`` in :data:`PREFERENCE` order (then any other registered ones), without those an
    eligible backend supersedes (its optional ``supersedes(problem)``)."""
    out = []
    for name in _registry_order():
        b = BACKENDS[name]
        if not getattr(b, "autotune_candidate", True):
            continue
        ok, _ = b.available()
        if ok and b.supports(problem) is None:
            out.append(name)
    return _without_superseded(out, problem)


def _registry_order() -> list[str]:
    """Registered backends in :data:`PREFERENCE` order, then any others by name (loads the built-ins)."""
    get_backend("reference")
    return [n for n in PREFERENCE if n in BACKENDS] + sorted(n for n in BACKENDS if n not in PREFERENCE)


def _without_superseded(names: list[str], problem: Problem) -> list[str]:
    """``names`` without those one of them supersedes for ``problem`` (a backend's optional ``supersedes``)."""
    superseded: set[str] = set()
    for name in names:
        sup = getattr(BACKENDS[name], "supersedes", None)
        if sup is not None:
            superseded |= set(sup(problem)) - {name}
    return [n for n in names if n not in superseded]


def _policy_of(autotune: str) -> str:
    """The policy that ``TORCHNEXT_AUTOTUNE=<autotune>`` selects."""
    return "fastest" if autotune == "fastest" else "bitwise"


def _still_eligible(name: str, problem: Problem) -> bool:
    b = BACKENDS.get(name)
    return b is not None and getattr(b, "autotune_candidate", True) and b.available()[0] and b.supports(problem) is None


# ------------------------------------------------------------------------------------------------ disk cache
def _read_disk(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION or not isinstance(data.get("entries"), dict):
            raise ValueError("unexpected schema")
        entries = data["entries"]
        for k, v in entries.items():
            if not isinstance(k, str) or not isinstance(v, dict) or not isinstance(v.get("backend"), str):
                raise ValueError(f"bad entry {k!r}")
        return entries
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring unreadable autotune cache {path}: {exc}", AutotuneCacheWarning, stacklevel=3)
        return {}


def _write_disk(path: Path, record: TuneRecord) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AutotuneCacheWarning)
            entries = _read_disk(path)
        entries[record.key] = {"backend": record.backend, "times_ms": record.times_ms, "rejected": record.rejected,
                               "policy": record.policy}
        fd, tmp = tempfile.mkstemp(prefix=".autotune-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.warning("could not write autotune cache %s: %s", path, exc)


# ------------------------------------------------------------------------------------------------ tuning
def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error over the finite entries; inf if the non-finite entries differ."""
    x64, r64 = x.double(), ref.double()
    fin = torch.isfinite(r64)
    if not bool(torch.equal(fin, torch.isfinite(x64))) or not bool(torch.equal(x64[~fin].nan_to_num(), r64[~fin].nan_to_num())):
        return math.inf
    x64, r64 = x64[fin], r64[fin]
    denom = float(r64.norm())
    err = float((x64 - r64).norm())
    return err / denom if denom > 0 else err


CHECK_ROWS = 64
CHECK_COLS = 256
"""The correctness check compares the top-left (CHECK_ROWS, CHECK_COLS) corner of a candidate's output with the
reference computed on just those rows of ``a`` and ``w`` (output entries depend only on their row and column, so
this is exact and keeps the fp64 reference cheap for large problems)."""


def _rows(x: torch.Tensor | BlockScaledTensor, r: int) -> torch.Tensor | BlockScaledTensor:
    if isinstance(x, torch.Tensor):
        return x[:r]
    return replace(x, qdata=x.qdata[:r], scales=x.unswizzled_scales()[:r], swizzled=False, shape=torch.Size((r, x.shape[1])))


def _corner_problem(problem: Problem) -> Problem:
    m, n = min(problem.m, CHECK_ROWS), min(problem.n, CHECK_COLS)
    if (m, n) == (problem.m, problem.n):
        return problem
    ep = problem.epilogue
    s = ep.scale
    if isinstance(s, torch.Tensor) and ep.scale_kind == "row":
        s = s[:m]
    elif isinstance(s, torch.Tensor) and ep.scale_kind == "col":
        s = s[:n]
    sub = replace(
        ep,
        scale=s,
        bias=None if ep.bias is None else ep.bias[:n],
        residual=None if ep.residual is None else ep.residual[:m, :n],
        output_amax=False,
        out_format=None,
    )
    return replace(problem, a=_rows(problem.a, m), w=_rows(problem.w, n), epilogue=sub, m=m, n=n)


def _check(out: EpilogueOutput, ref: EpilogueOutput, problem: Problem, rtol: float) -> str | None:
    tol = rtol if out.output.dtype.itemsize >= 4 else max(rtol, 1e-2)
    m, n = ref.output.shape
    e = _rel_l2(out.output[:m, :n], ref.output)
    if not e <= tol:
        return f"output rel L2 error {e:.3g} > {tol:g} against the reference"
    if problem.epilogue.output_amax:
        if out.amax is None:
            return "no amax returned"
        own = out.output.abs().amax().float() if out.output.numel() else torch.zeros(())
        ea = _rel_l2(out.amax.reshape(1), own.reshape(1))
        if not ea <= max(tol, 1e-2):  # against max|output| after the output cast
            return f"amax {float(out.amax):.6g} does not match max|output| {float(own):.6g}"
    if problem.epilogue.out_format is not None and out.quantized is None:
        return "no quantized output returned"
    return None


def _bits(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    if t is None:
        return None
    flat = t.detach().contiguous().reshape(-1)
    return (t.dtype, tuple(t.shape), flat.view(torch.uint8) if flat.numel() else flat)


def _same_bits(a: EpilogueOutput, b: EpilogueOutput) -> bool:
    """Whether two outputs are bitwise equal (output, amax, quantized data and scales; NaNs compare by bits)."""
    pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(a.output, b.output), (a.amax, b.amax)]
    if (a.quantized is None) != (b.quantized is None):
        return False
    if a.quantized is not None and b.quantized is not None:
        if a.quantized.swizzled != b.quantized.swizzled:
            return False
        pairs += [(a.quantized.qdata, b.quantized.qdata), (a.quantized.scales, b.quantized.scales),
                  (a.quantized.global_scale, b.quantized.global_scale)]
    for x, y in pairs:
        bx, by = _bits(x), _bits(y)
        if bx is None or by is None:
            if bx is not by:
                return False
            continue
        if bx[:2] != by[:2] or not torch.equal(bx[2], by[2]):
            return False
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Any, device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    if reps <= 0:
        return math.nan
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def tune(problem: Problem, candidates: list[str] | None = None, config: TuneConfig | None = None, *,
         policy: str = "bitwise") -> TuneRecord:
    """Time ``candidates`` (default: :func:`eligible_backends`) on ``problem`` after checking each against the
    reference (``policy="bitwise"``: and against the first passing candidate's bits); return the record (not
    cached — :func:`select` caches).

    Raises:
        ValueError: an unknown ``policy``.
        RuntimeError: no candidate passed.
    """
    if policy not in _POLICIES:
        raise ValueError(f"autotune policy must be one of {_POLICIES}, got {policy!r}")
    cfg = config or CONFIG
    names = candidates if candidates is not None else eligible_backends(problem)
    key = problem_key(problem)
    ref = get_backend("reference").run(_corner_problem(problem))
    times: dict[str, float] = {}
    rejected: dict[str, str] = {}
    passed = []
    anchor: tuple[str, EpilogueOutput] | None = None
    for name in names:
        b = get_backend(name)
        try:
            out = b.run(problem)
            why = _check(out, ref, problem, cfg.rtol)
            if why is None and policy == "bitwise":
                if anchor is None:
                    anchor = (name, out)
                elif not _same_bits(out, anchor[1]):
                    why = (f"not bitwise equal to {anchor[0]} (the static choice): excluded so that timing never "
                           "changes results (TORCHNEXT_AUTOTUNE=fastest admits it)")
            if why is not None:
                rejected[name] = why
                log.warning("autotune %s: %s rejected: %s", key, name, why)
                continue
            _time(lambda b=b: b.run(problem), problem.device, cfg.warmup, 0)
            passed.append(name)
        except Exception as exc:  # a failing candidate is disqualified, not fatal
            rejected[name] = f"{type(exc).__name__}: {exc}"
            log.warning("autotune %s: %s failed: %s", key, name, rejected[name])
    # timed round-robin (one run of each candidate per round) so that background load hits all of them alike
    samples: dict[str, list[float]] = {n: [] for n in passed}
    for _ in range(max(1, cfg.reps)):
        for name in passed:
            samples[name].append(_time(lambda n=name: get_backend(n).run(problem), problem.device, 0, 1))
    times = {n: statistics.median(v) for n, v in samples.items()}
    if not times:
        raise RuntimeError(f"autotune {key}: no candidate passed ({rejected or 'no candidates'})")
    best = min(times, key=times.__getitem__)
    return TuneRecord(key=key, backend=best, times_ms=times, rejected=rejected, policy=policy)


_POLICIES = ("bitwise", "fastest")


@trace_time_constant
def _policy() -> str:
    return _policy_of(env_config().autotune)


@trace_time_constant
def _traceable_order() -> tuple[str, ...]:
    """Registered, available autotune candidates that a trace may contain, in :data:`PREFERENCE` order."""
    return tuple(n for n in _registry_order() if getattr(BACKENDS[n], "autotune_candidate", True)
                 and getattr(BACKENDS[n], "traceable", True) and BACKENDS[n].available()[0])


@trace_time_constant
def _remembered(key: str, policy: str) -> str:
    """The backend decided for ``key`` under ``policy`` in this process or on disk (``""``: none)."""
    with _LOCK:
        rec = _MEMORY.get(key)
        if rec is not None and rec.policy == policy:
            return rec.backend
    cfg = env_config()
    if cfg.autotune == "0":
        return ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutotuneCacheWarning)
        entry = _read_disk(Path(cfg.autotune_cache)).get(key)
    return entry["backend"] if entry is not None and entry.get("policy", "fastest") == policy else ""


def _select_in_trace(problem: Problem) -> str:
    # traced by dynamo: only metadata checks here (supports() reads formats, shapes, the epilogue); everything
    # stateful is a trace-time constant above
    names = _without_superseded([n for n in _traceable_order() if BACKENDS[n].supports(problem) is None], problem)
    if not names:
        raise RuntimeError(f"autotune: no traceable backend supports {problem.formats} on {problem.device.type} "
                           "(inductor, triton and cutlass are not used inside torch.compile/export)")
    chosen = _remembered(problem_key(problem), _policy())
    return chosen if chosen in names else names[0]


def select(problem: Problem) -> str:
    """The backend name to use for ``problem`` (see the module docstring)."""
    if compiling():
        return _select_in_trace(problem)
    cfg = env_config()
    key = problem_key(problem)
    policy = _policy_of(cfg.autotune)
    with _LOCK:
        rec = _MEMORY.get(key)
        if rec is not None and rec.policy == policy and _still_eligible(rec.backend, problem):  # hot path
            return rec.backend
        candidates = eligible_backends(problem)
        path = Path(cfg.autotune_cache)
        if cfg.autotune != "0":
            entry = _read_disk(path).get(key)
            if entry is not None and entry["backend"] in candidates and entry.get("policy", "fastest") == policy:
                rec = TuneRecord(key=key, backend=entry["backend"], times_ms=dict(entry.get("times_ms", {})),
                                 source="disk", policy=policy)
                _MEMORY[key] = rec
                log.info("autotune %s: %s (from %s)", key, rec.backend, path)
                return rec.backend
        if cfg.autotune in ("0", "readonly") or len(candidates) == 1:
            if not candidates:
                raise RuntimeError(f"autotune {key}: no backend supports this problem")
            rec = TuneRecord(key=key, backend=candidates[0], source="static")
            _MEMORY[key] = rec
            log.info("autotune %s: %s (static preference, TORCHNEXT_AUTOTUNE=%s)", key, rec.backend, cfg.autotune)
            return rec.backend
        rec = tune(problem, candidates, policy=policy)
        _MEMORY[key] = rec
        times = ", ".join(f"{n}={t:.3g}ms" for n, t in sorted(rec.times_ms.items(), key=lambda kv: kv[1]))
        log.info("autotune %s: chose %s (%s; rejected %s)", key, rec.backend, times, rec.rejected or "none")
        _write_disk(path, rec)
        return rec.backend


def memory_record(problem: Problem) -> TuneRecord | None:
    """The in-memory decision for ``problem``'s key, if any."""
    with _LOCK:
        return _MEMORY.get(problem_key(problem))
