"""Extensions of the Communicator: how subsystems built on the core attach to it without the core importing them.

The core (:mod:`torchnext.comms.communicator` and what it imports) knows no extension by module, and importing it
loads none of them. Its user-facing doors to extensions dispatch through this registry, which an extension package
fills when it is imported; a built-in entry asked for before its package was imported imports that package then
(:data:`_PROVIDERS`: the one place the core names them, as strings), so ``Communicator(..., flight_recorder=True)``
works on a process that imported only the core:

* ``Communicator(..., flight_recorder=value)`` -> ``option("flight_recorder")``, and ``check_collectives=value`` ->
  ``option("check_collectives")``: an :class:`OptionHandler` whose ``check(value)`` runs before the communicator
  connects (bad input fails fast) and ``attach(comm, value)`` after;
* ``comm.new_window(tensor, ...)`` -> ``factory("new_window")(comm, tensor, ...)``;
* ``comm.as_process_group()`` -> ``factory("as_process_group")(comm, ...)``.

Extensions keep per-communicator state in ``comm.extensions`` (a dict keyed by the extension's name) and follow
its life through the core's hooks: ``register_split_hook`` (every child a split creates on this rank),
``register_abort_hook``, ``register_shutdown_hook``, and ``register_check_hook`` (which may refuse an op). Semantics::

    register_option(name, handler); option(name) is handler        # KeyError-free: unknown -> RuntimeError
    register_factory(name, fn);     factory(name) is fn
    option("flight_recorder")  # not registered yet: import torchnext.comms.flight_recorder (it registers), then look
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torchnext.comms.communicator import Communicator

__all__ = ["OptionHandler", "factory", "option", "register_factory", "register_option"]


class OptionHandler(Protocol):
    """A constructor keyword of :class:`~torchnext.comms.Communicator` served by an extension."""

    def check(self, value: object) -> None:
        """Raise ``TypeError``/``ValueError`` for a bad value (called before the communicator connects)."""

    def attach(self, comm: Communicator, value: Any) -> None:
        """Apply ``value`` to the connected ``comm``."""


_OPTIONS: dict[str, OptionHandler] = {}
_FACTORIES: dict[str, Callable[..., Any]] = {}
_PROVIDERS = {"flight_recorder": "torchnext.comms.flight_recorder", "new_window": "torchnext.comms.window",
              "as_process_group": "torchnext.comms.process_group", "check_collectives": "torchnext.comms.consistency"}
"""Which package provides each built-in entry: imported on the first lookup of an entry not yet registered (the
core imports none of them eagerly)."""


def register_option(name: str, handler: OptionHandler) -> None:
    """Serve ``Communicator(..., name=value)`` with ``handler`` (a later registration replaces an earlier one)."""
    _OPTIONS[name] = handler


def register_factory(name: str, fn: Callable[..., Any]) -> None:
    """Serve the Communicator method ``name`` with ``fn(comm, *args, **kwargs)``."""
    _FACTORIES[name] = fn


def _missing(kind: str, name: str) -> RuntimeError:
    provider = _PROVIDERS.get(name, "the package that provides it")
    return RuntimeError(f"communicator {kind} {name!r} is not registered: import {provider}")


def _load_provider(name: str) -> None:
    """Import the package that provides built-in entry ``name`` (it registers the entry on import)."""
    provider = _PROVIDERS.get(name)
    if provider is not None:
        importlib.import_module(provider)


def option(name: str) -> OptionHandler:
    """The handler of constructor option ``name`` (its provider imported on first use); ``RuntimeError`` naming the
    package to import when none is registered."""
    handler = _OPTIONS.get(name)
    if handler is None:
        _load_provider(name)
        handler = _OPTIONS.get(name)
        if handler is None:
            raise _missing("option", name)
    return handler


def factory(name: str) -> Callable[..., Any]:
    """The function behind the Communicator method ``name`` (its provider imported on first use); ``RuntimeError``
    when none is registered."""
    fn = _FACTORIES.get(name)
    if fn is None:
        _load_provider(name)
        fn = _FACTORIES.get(name)
        if fn is None:
            raise _missing("method", name)
    return fn
