"""DiLoCo / LocalSGD for :class:`~torchnext.integrations.torchtitan.FaultTolerantTrainer`: what torchtitan's torchft
experiment takes from ``torchft.local_sgd`` (``DiLoCo(manager=, model_fragments=, inner_optimizer=,
outer_optimizer=, sync_every=, should_quantize=, fragment_sync_delay=, fragment_update_alpha=)`` and
``LocalSGD``), on :mod:`torchnext.ft`'s own :class:`~torchnext.ft.StreamingDiLoCo` and :class:`~torchnext.ft.LocalSGD`.

The ``--fault_tolerance.*`` fields (torchtitan's names where torchtitan has them) map so::

    semi_sync_method="diloco"    -> StreamingDiLoCo(ft, model, StreamingDiLoCoConfig(
                                        sync_every=sync_steps, num_fragments=..., fragment_pattern=...,
                                        fragment_sync_delay=..., fragment_update_alpha=...,
                                        outer_dtype="mxfp8" if should_quantize else outer_dtype,
                                        outer_lr=outer_lr, outer_momentum=outer_momentum),   # Nesterov SGD
                                    blocks=fragments or the model's units in order)
                                    # num_fragments=1, fragment_sync_delay=0, alpha=0, fp32: exactly ft.DiLoCo
    semi_sync_method="local_sgd" -> LocalSGD(ft, model, LocalSGDConfig(sync_every=sync_steps))
    semi_sync_method=None        -> FT-HSDP (gradients averaged across the live groups every step)

Fragments: ``module_fqns_per_model_fragment`` (torchtitan's field: one list of module fqns per fragment, e.g.
``[["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]``; every parameter in exactly one) or, when it
is empty, the model's units in order -- each top-level module, the entries of a ``ModuleList``/``ModuleDict`` one
by one (llama3: ``tok_embeddings``, ``layers.0`` ... ``layers.N-1``, ``norm``, ``lm_head``) -- grouped into
``num_fragments`` fragments by ``fragment_pattern`` (``"strided"``: unit ``i`` in fragment ``i % P``;
``"sequential"``: contiguous runs, as torchtitan's ``fragment_llm``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchnext.ft import (
    FaultTolerant,
    LocalSGD,
    LocalSGDConfig,
    OuterDType,
    StreamingDiLoCo,
    StreamingDiLoCoConfig,
)

if TYPE_CHECKING:
    from torchnext.integrations.torchtitan.ft import FaultTolerance

__all__ = ["OuterSyncRecord", "SemiSync", "SemiSyncMethod", "model_units", "semi_sync_config"]


class SemiSyncMethod(str, enum.Enum):
    """``--fault_tolerance.semi_sync_method`` (torchtitan's spellings)."""

    DILOCO = "diloco"
    """:class:`~torchnext.ft.StreamingDiLoCo` (plain DiLoCo with one fragment, no delay, alpha 0, fp32)."""
    LOCAL_SGD = "local_sgd"
    """:class:`~torchnext.ft.LocalSGD`: the parameters become the mean of the groups' every ``sync_steps``."""


def semi_sync_config(ftc: FaultTolerance) -> StreamingDiLoCoConfig | LocalSGDConfig | None:
    """The torchnext.ft config of ``ftc``'s semi-sync method (module docstring), or None for FT-HSDP.

    Raises:
        ValueError: an unknown method, a DiLoCo-only field set for ``local_sgd``, ``should_quantize`` beside an
            ``outer_dtype`` other than fp32, fragment fqns whose number differs from ``num_fragments``, or a value
            torchnext.ft refuses (the message names the ``--fault_tolerance`` field).
    """
    if ftc.semi_sync_method is None:
        return None
    try:
        method = SemiSyncMethod(str(ftc.semi_sync_method).lower())
    except ValueError:
        raise ValueError(f"--fault_tolerance.semi_sync_method must be one of {[m.value for m in SemiSyncMethod]} "
                         f"(or unset: FT-HSDP), got {ftc.semi_sync_method!r}") from None
    fqns = ftc.module_fqns_per_model_fragment
    if method is SemiSyncMethod.LOCAL_SGD:
        diloco_only = {"should_quantize": (ftc.should_quantize, False), "outer_dtype": (ftc.outer_dtype, "fp32"),
                       "num_fragments": (ftc.num_fragments, 1), "module_fqns_per_model_fragment": (fqns, []),
                       "fragment_sync_delay": (ftc.fragment_sync_delay, 0),
                       "fragment_update_alpha": (ftc.fragment_update_alpha, 0.0),
                       "outer_lr": (ftc.outer_lr, 0.7), "outer_momentum": (ftc.outer_momentum, 0.9)}
        changed = sorted(k for k, (v, default) in diloco_only.items() if v != default)
        if changed:
            raise ValueError(f"--fault_tolerance.semi_sync_method local_sgd has no outer optimizer, fragments or "
                             f"compression; these DiLoCo fields are set: {changed}")
        try:
            return LocalSGDConfig(sync_every=ftc.sync_steps)
        except ValueError as exc:
            raise ValueError(f"--fault_tolerance.sync_steps: {exc}") from None
    outer_dtype = str(ftc.outer_dtype)
    if ftc.should_quantize:
        if outer_dtype.lower() != OuterDType.FP32.value:
            raise ValueError(f"--fault_tolerance.should_quantize means outer_dtype mxfp8; outer_dtype is "
                             f"{outer_dtype!r}: set one or the other")
        outer_dtype = OuterDType.MXFP8.value
    fragments = ftc.num_fragments
    if fqns:
        if fragments not in (1, len(fqns)):
            raise ValueError(f"--fault_tolerance.module_fqns_per_model_fragment lists {len(fqns)} fragments but "
                             f"num_fragments is {fragments}")
        fragments = len(fqns)
    try:
        return StreamingDiLoCoConfig(
            sync_every=ftc.sync_steps, num_fragments=fragments, fragment_pattern=ftc.fragment_pattern,
            fragment_sync_delay=ftc.fragment_sync_delay, fragment_update_alpha=ftc.fragment_update_alpha,
            outer_dtype=outer_dtype, outer_lr=ftc.outer_lr, outer_momentum=ftc.outer_momentum)
    except ValueError as exc:
        raise ValueError(f"--fault_tolerance (sync_steps -> sync_every): {exc}") from None


def model_units(model: nn.Module, fqns_per_fragment: list[list[str]] | None = None) -> list[nn.Module]:
    """The blocks fragments are made of (module docstring): one per fragment of ``fqns_per_fragment``, else one
    per unit of ``model`` in order (its own parameters first, if any). A parameter shared by two units (tied
    weights) belongs to the first. Each block is a module whose ``parameters()`` are the model's own tensors.

    Raises:
        ValueError: an fqn names no submodule, a parameter is in two fragments, or in none.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()

    def block(params: Iterator[nn.Parameter], *, strict_label: str | None = None) -> _Params | None:
        ps: list[nn.Parameter] = []
        for p in params:
            if any(p is q for q in ps):
                continue  # tied within this block
            if id(p) in seen:
                if strict_label is not None:
                    raise ValueError(f"--fault_tolerance.module_fqns_per_model_fragment: parameter "
                                     f"{names.get(id(p), '?')!r} is in two fragments (again in {strict_label})")
                continue
            seen.add(id(p))
            ps.append(p)
        return _Params(ps) if ps else None

    out: list[nn.Module] = []
    if fqns_per_fragment:
        for k, fqns in enumerate(fqns_per_fragment):
            modules = []
            for fqn in fqns:
                try:
                    modules.append(model.get_submodule(fqn))
                except AttributeError:
                    raise ValueError(f"--fault_tolerance.module_fqns_per_model_fragment: fragment {k} names "
                                     f"{fqn!r}, which is no submodule of the model") from None
            b = block((p for m in modules for p in m.parameters()), strict_label=f"fragment {k}")
            if b is None:
                raise ValueError(f"--fault_tolerance.module_fqns_per_model_fragment: fragment {k} ({fqns}) has no "
                                 "parameters")
            out.append(b)
        missing = [n for n, p in model.named_parameters() if id(p) not in seen]
        if missing:
            raise ValueError(f"--fault_tolerance.module_fqns_per_model_fragment: parameters {missing[:6]} are in no "
                             "fragment (every parameter must be in exactly one)")
        return out
    units: list[Iterator[nn.Parameter]] = [model.parameters(recurse=False)]
    for child in model.children():
        subs = list(child.children()) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        units.extend(m.parameters() for m in subs)
    for params in units:
        b = block(params)
        if b is not None:
            out.append(b)
    return out


class _Params(nn.Module):
    """A block: a module whose ``parameters()`` are the given tensors themselves (nothing re-registered)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self._tensors = params

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self._tensors)


@dataclass(frozen=True, slots=True)
class OuterSyncRecord:
    """One committed outer synchronization, as the trainer logs it."""

    step: int
    """The training step after which it was applied."""
    fragment: int
    """Which fragment (0 with one fragment, and for LocalSGD)."""
    outer_step: int
    """Its index among this fragment's synchronizations (0 first)."""
    contributors: int
    """Replica groups whose pseudo-gradient was averaged."""
    generation: int
    """The fault-tolerant generation it committed in."""
    attempts: int
    """Fault-tolerant steps it took (1 without a failure)."""


class SemiSync:
    """The trainer's semi-sync method over ``ft``'s replica groups: a :class:`~torchnext.ft.StreamingDiLoCo` or a
    :class:`~torchnext.ft.LocalSGD` behind one interface. Semantics::

        semi.join()                     # ft.join(); a healed joiner takes part in the synchronization under way
        semi.position                   # inner steps taken by the job (healed into a joiner)
        semi.step(step)                 # after each inner step: the synchronization(s) due now -> OuterSyncRecord
        semi.finish(step)               # after the last step: complete a synchronization still in flight
        semi.state_dict() / load_state_dict()   # put into FaultTolerant's healed state

    Build it after the model is sharded inside the replica group (FSDP2 on the group's own ranks, never on
    ``ft.device_mesh``), with ``ft`` built ``join=False``.
    """

    def __init__(self, ft: FaultTolerant, model: nn.Module,
                 config: StreamingDiLoCoConfig | LocalSGDConfig, *,
                 fqns_per_fragment: list[list[str]] | None = None) -> None:
        self.config = config
        self.impl: StreamingDiLoCo | LocalSGD
        if isinstance(config, StreamingDiLoCoConfig):
            self.impl = StreamingDiLoCo(ft, model, config, blocks=model_units(model, fqns_per_fragment))
        elif isinstance(config, LocalSGDConfig):
            self.impl = LocalSGD(ft, model, config)
        else:
            raise TypeError(f"SemiSync: config must be a StreamingDiLoCoConfig or a LocalSGDConfig, got "
                            f"{type(config).__name__}")
        self._ft = ft

    @property
    def method(self) -> SemiSyncMethod:
        """Which method this is."""
        return SemiSyncMethod.DILOCO if isinstance(self.impl, StreamingDiLoCo) else SemiSyncMethod.LOCAL_SGD

    @property
    def position(self) -> int:
        """Inner steps taken by the job so far (the same on every live group; a healed joiner's is its donor's)."""
        impl = self.impl
        if isinstance(impl, StreamingDiLoCo):
            return impl.inner_steps
        return impl.outer_steps * impl.sync_every + impl.inner_steps

    @property
    def global_params(self) -> tuple[torch.Tensor, ...]:
        """The global copy (this rank's local shards), in parameter order."""
        return self.impl.global_params

    def join(self) -> None:
        """``ft.join()``; a joiner healed inside a synchronization takes part in it (sending zeros)."""
        self.impl.join()

    def step(self, step: int) -> OuterSyncRecord | None:
        """Count the inner step ``step`` just taken; run the synchronization due now. Returns it once committed."""
        impl = self.impl
        if isinstance(impl, StreamingDiLoCo):
            done = impl.step()
            return None if done is None else self._record(step, done.fragment, done.outer_step, done.contributors,
                                                          done.generation, done.attempts)
        if not impl.step() or impl.last_sync is None:
            return None
        s = impl.last_sync
        return self._record(step, 0, s.outer_step, s.contributors, s.generation, s.attempts)

    def finish(self, step: int) -> OuterSyncRecord | None:
        """After the last inner step ``step``: complete the fragment synchronization still in flight (DiLoCo with
        ``fragment_sync_delay > 0``), on every group alike. Returns it, or None."""
        if isinstance(self.impl, StreamingDiLoCo):
            done = self.impl.drain()
            if done is not None:
                return self._record(step, done.fragment, done.outer_step, done.contributors, done.generation,
                                    done.attempts)
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a joiner heals: the global copy, the outer optimizer state(s), the schedule's position."""
        return self.impl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a donor's :meth:`state_dict`; the local parameters become the global copy."""
        self.impl.load_state_dict(state)

    @staticmethod
    def _record(step: int, fragment: int, outer_step: int, contributors: int, generation: int,
                attempts: int) -> OuterSyncRecord:
        return OuterSyncRecord(step=step, fragment=fragment, outer_step=outer_step, contributors=contributors,
                               generation=generation, attempts=attempts)
