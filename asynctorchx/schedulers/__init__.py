"""The scheduler registry: builtin backends plus the ``asynctorchx.schedulers`` entry-point group.

Backends are imported only when one is created, so optional dependencies (aiodocker, a Kubernetes
client) are needed only by the backend that uses them. A factory is called as
``factory(session_name, **scheduler_params)`` and must ignore parameters it does not know.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import cache
from typing import Any, Protocol

from asynctorchx.schedulers.api import Scheduler
from asynctorchx.specs.api import UnknownSchedulerException

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asynctorchx.schedulers"
DEFAULT_SCHEDULER = "local_cwd"

BUILTIN_SCHEDULERS: dict[str, str] = {
    "local_cwd": "asynctorchx.schedulers.local:create_cwd_scheduler",
    "local_dir": "asynctorchx.schedulers.local:create_dir_scheduler",
    "local_docker": "asynctorchx.schedulers.docker:create_scheduler",
    "slurm": "asynctorchx.schedulers.slurm:create_scheduler",
    "kubernetes": "asynctorchx.schedulers.kubernetes:create_scheduler",
}


class SchedulerFactory(Protocol):
    """Creates a scheduler for a session."""

    def __call__(self, session_name: str, **kwargs: Any) -> Scheduler[Any]: ...


def _lazy(target: str) -> SchedulerFactory:
    module_name, _, attr = target.partition(":")

    def factory(session_name: str, **kwargs: Any) -> Scheduler[Any]:
        fn: Callable[..., Scheduler[Any]] = getattr(importlib.import_module(module_name), attr)
        return fn(session_name, **kwargs)

    return factory


def builtin_scheduler_factory(name: str) -> SchedulerFactory | None:
    """The factory of the builtin scheduler ``name``, or None; never scans the installed packages.

    Plugins cannot replace a builtin, so a builtin name needs no entry-point lookup (which costs tens
    of milliseconds at a command's start).
    """
    target = BUILTIN_SCHEDULERS.get(name)
    return None if target is None else _lazy(target)


@cache
def _plugin_factories() -> dict[str, SchedulerFactory]:
    from importlib.metadata import entry_points

    found: dict[str, SchedulerFactory] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_SCHEDULERS:
            logger.warning(
                "ignoring entry point %r: it would replace a builtin scheduler", ep.value
            )
            continue
        found[ep.name] = _lazy(ep.value)
    return found


def get_scheduler_factories() -> dict[str, SchedulerFactory]:
    """Every scheduler factory by name: the builtins, then the entry-point plugins (never replacing one)."""
    factories = {name: _lazy(target) for name, target in BUILTIN_SCHEDULERS.items()}
    factories.update(_plugin_factories())
    return factories


def scheduler_names() -> list[str]:
    """The names of every available scheduler backend."""
    return list(get_scheduler_factories())


def get_default_scheduler_name() -> str:
    """The scheduler used when none is named."""
    return DEFAULT_SCHEDULER


def create_scheduler(name: str, session_name: str, **kwargs: Any) -> Scheduler[Any]:
    """Creates the scheduler registered as ``name``.

    Raises:
        UnknownSchedulerException: no scheduler has that name (the message lists the available ones).
    """
    factories = get_scheduler_factories()
    if name not in factories:
        raise UnknownSchedulerException(name, factories)
    return factories[name](session_name, **kwargs)
