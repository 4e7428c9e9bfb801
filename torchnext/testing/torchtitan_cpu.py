"""torchtitan on a machine with no accelerator: the CPU shims torchnext's own tests run it under (not a library path).

torchtitan (>= 0.3.0) is written for accelerators. Unedited, on a CPU-only machine with torch 2.13, it stops at four
places; :func:`torchtitan_on_cpu` patches each of them, in this process only, for as long as it is entered::

    with torchtitan_on_cpu() as shims:       # before or after torchtitan is imported
        runpy.run_module("torchtitan.train", run_name="__main__")
    # shims.applied: the names below that were needed here, in order

* ``device`` -- torchtitan picks ``device_type = "cuda"`` when no accelerator exists
  (``_get_available_device_type() or "cuda"``) and calls ``torch.cuda.set_device``, ``memory_stats``, ... on it. Its
  ``device_type`` / ``device_module`` (in ``torchtitan.tools.utils`` and every torchtitan module that imported them)
  become ``"cpu"`` and :data:`CPU_DEVICE`, the part of ``torch.cuda``'s surface torchtitan calls, answered for the
  host. Skipped where an accelerator exists.
* ``set_timeout`` -- torchtitan calls ``torch.distributed.set_timeout(timeout, group)`` after the first step; torch
  2.13 has no such function (2.14 does). It becomes :func:`torchnext.comms.process_group.set_timeout` (which reaches
  Gloo groups through torch's ``_set_pg_timeout``, and torchnext groups through their own setter). Skipped where torch
  has it.
* ``attention`` -- FlexAttention on CPU runs through inductor's C++ code generation (a C++ compiler at run time) and
  has no CPU backward in torch 2.13. ``FlexAttention.compiled_flex_attn`` becomes
  :func:`dense_flex_attention` (the same mask, materialised, and plain softmax attention) and the compiled
  ``create_block_mask`` the eager one.
* ``gloo_force_sum`` -- torchtitan sets FSDP2's gradient divide factor, so FSDP2 reduce-scatters with
  ``PREMUL_SUM``, which Gloo refuses. On a Gloo default group, ``FSDPModule.set_gradient_divide_factor`` also calls
  ``set_force_sum_reduction_for_comms(True)`` (SUM, then the division on each rank). torchnext groups take
  ``PREMUL_SUM`` and are left alone; with torchtitan's factor of 1.0 the two give the same bits.

One more is a command-line flag, not a patch (:data:`CPU_FLAGS`): ``--parallelism.spmd_backend partial_dtensor``.
And torchtitan has no knob for the process-group backend: ``torchnext run`` gives its workers torchnext groups.

``python -m torchnext.testing.torchtitan_cpu [--runs RUNS.json] (-m module | script.py) [args]`` runs a module or
script under the shims (``torchnext run ... -m torchnext.testing.torchtitan_cpu -m torchtitan.train ...``), once, or
once per argument list of ``RUNS.json`` in the same processes (:func:`main`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import runpy
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CPU_DEVICE", "CPU_FLAGS", "GRAD_NORM_TAG", "LOSS_TAG", "CpuDeviceModule", "CpuShims", "dense_flex_attention", "main",
    "read_scalars", "torchtitan_on_cpu", "write_tiny_assets",
]

CPU_FLAGS: tuple[str, ...] = ("--parallelism.spmd_backend", "partial_dtensor")
"""torchtitan flags a torch 2.13 run needs: under the default ``spmd_types`` backend torchtitan hands FSDP2 plain
parameters with ``dp_mesh_dims``, which torch 2.13's ``fully_shard`` refuses ("all parameters must be DTensors on
the full SPMD mesh"); ``partial_dtensor`` keeps DTensor for the model-parallel axes only."""


# ------------------------------------------------------------------------------------------------ the device module
def _total_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kilobytes on Linux


class _CpuProperties(types.SimpleNamespace):
    name: str
    total_memory: int
    multi_processor_count: int


class CpuDeviceModule(types.ModuleType):
    """The part of ``torch.cuda``'s surface that torchtitan calls, answered for the host (one device, index 0).

    ``memory_stats`` reports the process's peak resident set size as both the active and the reserved peak (the
    host has no caching allocator; the peak cannot be reset, so ``reset_peak_memory_stats`` changes nothing).
    ``memory._record_memory_history`` / ``memory._snapshot`` (torchtitan's memory profiler) raise.
    """

    def __init__(self) -> None:
        super().__init__("torchnext.testing.torchtitan_cpu.CPU_DEVICE")
        self.memory = types.SimpleNamespace(_record_memory_history=self._no_memory_profile,
                                            _snapshot=self._no_memory_profile)

    @staticmethod
    def _no_memory_profile(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the CPU device module has no memory profiler (turn the memory snapshot off)")

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        """Accepts ``cpu``, ``cpu:0``, 0 and ``torch.device("cpu", 0)``; anything else is a ``ValueError``."""
        d = torch.device("cpu", device) if isinstance(device, int) else torch.device(device)
        if d.type != "cpu" or (d.index not in (None, 0)):
            raise ValueError(f"CPU device module: set_device({device!r}) names no host device (cpu or cpu:0)")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.cpu.synchronize()

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @classmethod
    def get_device_properties(cls, device: Any = None) -> _CpuProperties:
        return _CpuProperties(name=cls.get_device_name(), total_memory=_total_memory(),
                              multi_processor_count=os.cpu_count() or 1)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = _peak_rss()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
                "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        return None  # torch.manual_seed seeds the host generator

    manual_seed_all = manual_seed


CPU_DEVICE = CpuDeviceModule()
"""The device module torchtitan gets on a machine with no accelerator."""


# ------------------------------------------------------------------------------------------------- dense attention
def dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any, block_mask: Any,
                         scale: float | None, enable_gqa: bool, return_aux: Any, kernel_options: Any = None
                         ) -> tuple[torch.Tensor, Any]:
    """FlexAttention's result, computed densely (torchtitan's ``FlexAttention.compiled_flex_attn`` signature).

    Semantics (``q``: (B, H, L, E), ``k``/``v``: (B, Hkv, S, E); ``allowed`` is ``block_mask.mask_mod`` at every
    (b, h, i, j))::

        s = (q @ k.T) * (scale or 1 / sqrt(E)), -inf where not allowed
        out = softmax(s, -1) @ v        # a row with nothing allowed gives 0, as flex_attention does
        lse = logsumexp(s, -1)          # when return_aux.lse

    Scores and softmax in float32, the output in ``q``'s dtype.

    Raises:
        NotImplementedError: a ``score_mod`` is given, or ``max_scores`` is requested.
    """
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None:
        raise NotImplementedError("dense_flex_attention: score_mod is not supported (torchtitan's llama3 has none)")
    if getattr(return_aux, "max_scores", False):
        raise NotImplementedError("dense_flex_attention: return_aux.max_scores is not supported")
    b, h, n_q, e = q.shape
    n_kv = k.shape[-2]
    if enable_gqa and k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(e))
    if block_mask is not None:
        allowed = create_mask(block_mask.mask_mod, b, h, n_q, n_kv, device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows with nothing allowed: lse = -inf
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return out, AuxOutput(lse=lse if getattr(return_aux, "lse", False) else None)


# ------------------------------------------------------------------------------------- assets and what a run logs
def write_tiny_assets(folder: str | os.PathLike[str], *, documents: int = 400, seed: int = 0) -> tuple[str, str]:
    """A tokenizer and a text data set for torchtitan's ``c4_test`` loader, made here (nothing downloaded).

    The tokenizer is a word-level one over ``w0`` ... ``w999`` plus ``<unk>``, ``<|begin_of_text|>`` and
    ``<|end_of_text|>`` (1,003 ids, under the debug model's 2,048); each document is a walk ``w <- (7 w + d) % 1000``,
    ``d`` drawn from {1, 2, 3}, so a model can learn it. Returns ``(hf_assets_path, dataset_path)``: pass them as
    ``--hf_assets_path`` and ``--dataloader.dataset_path``.
    """
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    root = os.fspath(folder)
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    words = [f"w{i}" for i in range(1000)]
    vocab = {t: i for i, t in enumerate(["<unk>", "<|begin_of_text|>", "<|end_of_text|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    rng = random.Random(seed)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for _ in range(documents):
            w, text = rng.randrange(1000), []
            for _ in range(rng.randrange(50, 300)):
                w = (w * 7 + rng.choice((1, 2, 3))) % 1000
                text.append(words[w])
            f.write(json.dumps({"text": " ".join(text)}) + "\n")
    return tok_dir, data_dir


LOSS_TAG = "loss_metrics/global_avg_loss"
GRAD_NORM_TAG = "grad_norm"


def read_scalars(tb_folder: str | os.PathLike[str], tags: Sequence[str] = (LOSS_TAG, GRAD_NORM_TAG)
                 ) -> dict[int, dict[str, dict[int, float]]]:
    """What torchtitan logged to TensorBoard under ``tb_folder`` (``<dump_folder>/tb``, written with
    ``--metrics.enable_tensorboard --metrics.save_for_all_ranks``): ``{rank: {tag: {step: value}}}``.

    The values are the float32 TensorBoard stores; torchtitan's loss and grad norm are float32 tensors, so they are
    exact.

    Raises:
        FileNotFoundError: no ``<run>/rank_<r>`` event files under ``tb_folder``.
        ValueError: more than one run's folder under ``tb_folder`` (use a fresh dump folder per run).
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    root = os.fspath(tb_folder)
    runs = sorted(d for d in os.listdir(root)) if os.path.isdir(root) else []
    if not runs:
        raise FileNotFoundError(f"read_scalars: no TensorBoard run under {root}")
    if len(runs) > 1:
        raise ValueError(f"read_scalars: {len(runs)} runs under {root} ({runs}); expected one")
    out: dict[int, dict[str, dict[int, float]]] = {}
    run_dir = os.path.join(root, runs[0])
    for rank_dir in sorted(os.listdir(run_dir)):
        if not rank_dir.startswith("rank_"):
            continue
        per_tag: dict[str, dict[int, float]] = {t: {} for t in tags}
        folder = os.path.join(run_dir, rank_dir)
        for name in sorted(os.listdir(folder)):
            for event in EventFileLoader(os.path.join(folder, name)).Load():
                for value in event.summary.value:
                    if value.tag in per_tag:
                        v = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
                        per_tag[value.tag][int(event.step)] = float(v)
        out[int(rank_dir.removeprefix("rank_"))] = per_tag
    if not out:
        raise FileNotFoundError(f"read_scalars: no rank_<r> folders under {run_dir}")
    return out


# ----------------------------------------------------------------------------------------------------- the patches
@dataclass
class CpuShims:
    """What :func:`torchtitan_on_cpu` patched here (``applied``, in order) and how to undo it."""

    applied: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def _set(self, obj: Any, name: str, value: Any) -> None:
        missing = object()
        old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name) if old is missing else setattr(obj, name, old))

    def undo(self) -> None:
        """Restore everything patched, newest first."""
        while self._undo:
            self._undo.pop()()
        self.applied.clear()


def _patch_device(shims: CpuShims) -> None:
    from torch._utils import _get_available_device_type

    if _get_available_device_type() is not None:
        return  # torchtitan finds the accelerator itself
    import torchtitan.tools.utils as tt_utils

    old_type, old_module = tt_utils.device_type, tt_utils.device_module
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        if getattr(mod, "device_type", None) is old_type and isinstance(old_type, str):
            shims._set(mod, "device_type", "cpu")
        if getattr(mod, "device_module", None) is old_module:
            shims._set(mod, "device_module", CPU_DEVICE)
    shims.applied.append("device")


def _patch_set_timeout(shims: CpuShims) -> None:
    if hasattr(dist, "set_timeout"):
        return
    from torchnext.comms.process_group import set_timeout

    def _set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        """``torch.distributed.set_timeout`` of torch >= 2.14, for torch 2.13 (torchnext's ``set_timeout``)."""
        set_timeout(timeout, group)

    shims._set(dist, "set_timeout", _set_timeout)
    shims.applied.append("set_timeout")


def _patch_attention(shims: CpuShims) -> None:
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    shims._set(attention.FlexAttention, "compiled_flex_attn", staticmethod(dense_flex_attention))
    shims._set(attention, "_compiled_create_block_mask", create_block_mask)
    shims.applied.append("attention")


def _patch_gloo_force_sum(shims: CpuShims) -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
        original(self, factor)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            self.set_force_sum_reduction_for_comms(True)  # Gloo refuses the PREMUL_SUM the factor would need

    set_gradient_divide_factor.__doc__ = original.__doc__
    shims._set(FSDPModule, "set_gradient_divide_factor", set_gradient_divide_factor)
    shims.applied.append("gloo_force_sum")


_PATCHES: dict[str, Callable[[CpuShims], None]] = {
    "device": _patch_device, "set_timeout": _patch_set_timeout, "attention": _patch_attention,
    "gloo_force_sum": _patch_gloo_force_sum,
}


@contextlib.contextmanager
def torchtitan_on_cpu(*, skip: Sequence[str] = ()) -> Iterator[CpuShims]:
    """Patch torchtitan and torch (this process only) so torchtitan trains on CPU with torch 2.13; undo on exit.

    Each patch in the module docstring is applied where it is needed (``device`` only without an accelerator,
    ``set_timeout`` only where torch lacks it); ``skip`` names patches not to apply.

    Raises:
        ValueError: ``skip`` names no patch.
        ModuleNotFoundError: torchtitan is not installed.
    """
    unknown = sorted(set(skip) - set(_PATCHES))
    if unknown:
        raise ValueError(f"torchtitan_on_cpu: unknown patches {unknown}; known: {sorted(_PATCHES)}")
    shims = CpuShims()
    try:
        for name, patch in _PATCHES.items():
            if name not in skip:
                patch(shims)
        yield shims
    finally:
        shims.undo()


@contextlib.contextmanager
def _store_per_run(index: int, base: dist.Store) -> Iterator[None]:
    """``init_process_group`` calls that name no store and no init method rendezvous under
    ``torchnext-run-<restart>-<index>/`` in ``base`` (torch reuses the same keys after ``destroy_process_group``; a
    second job in the same processes -- or the workers torchrun restarts, ``TORCHELASTIC_RESTART_COUNT`` -- would read
    the first one's addresses). The backend and every other argument pass through unchanged; the backend the
    group got is printed (``torchtitan_cpu: run <index> rank <r> backend <name>``) for the caller to check."""
    c10d: Any = dist.distributed_c10d
    original = c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            kwargs.pop("init_method", None)
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            kwargs.update(store=dist.PrefixStore(f"torchnext-run-{restart}-{index}/", base), rank=int(os.environ["RANK"]),
                          world_size=int(os.environ["WORLD_SIZE"]))
        out = original(*args, **kwargs)
        # one write() of the whole line: print() writes the text and its newline separately, and two ranks sharing
        # the log interleaved them ("...backend glootorchtitan_cpu: run 0 rank 0 ...": a line lost to the parser)
        sys.stderr.write(f"torchtitan_cpu: run {index} rank {dist.get_rank()} backend {dist.get_backend()}\n")
        sys.stderr.flush()
        return out

    c10d.init_process_group = dist.init_process_group = init_process_group
    try:
        yield
    finally:
        c10d.init_process_group = dist.init_process_group = original


def _env_store() -> dist.Store:
    """The job's store from ``MASTER_ADDR``/``MASTER_PORT`` (torchrun's agent store under torchrun)."""
    store, _, _ = next(iter(dist.rendezvous("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))))
    return store


def _run_target(target: list[str], extra: Sequence[str]) -> None:
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:], *extra]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [*target, *extra]
        runpy.run_path(target[0], run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m torchnext.testing.torchtitan_cpu [--runs RUNS.json] (-m module | script.py) [args]``.

    Runs the module or script under :func:`torchtitan_on_cpu`. With ``--runs``, a JSON list of argument lists, it
    runs it once per list, in this process, one after the other, each list appended to ``args``: several torchtitan
    jobs for the price of one start (torch and torchtitan imported once). Under torchrun each job's
    ``init_process_group`` rendezvous under its own store prefix (``torchnext-run-<restart>-<i>/``, see
    :func:`_store_per_run`); the backend is the caller's (``torchnext run``'s swap included). A job that raises ends
    the process with that error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    runs: list[list[str]] | None = None
    if args[:1] == ["--runs"]:
        if len(args) < 2:
            raise SystemExit("--runs needs a JSON file")
        with open(args[1]) as f:
            runs = json.load(f)
        if not isinstance(runs, list) or not all(isinstance(r, list) and all(isinstance(a, str) for a in r)
                                                 for r in runs):
            raise SystemExit(f"--runs {args[1]}: expected a JSON list of lists of strings")
        args = args[2:]
    if not args or (args[0] == "-m" and len(args) < 2):
        raise SystemExit("usage: python -m torchnext.testing.torchtitan_cpu [--runs RUNS.json] "
                         "(-m module | script.py) [args]")
    with torchtitan_on_cpu():
        base = _env_store() if {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ) else None
        for i, extra in enumerate(runs if runs is not None else [[]]):
            with _store_per_run(i, base) if base is not None else contextlib.nullcontext():
                _run_target(args, extra)


if __name__ == "__main__":
    main()
