"""Named resources: a short name (``cpu.small``, ``gpu.large``) standing for a ``Resource``.

The generic table below works on any scheduler. Packages add their own names (e.g. cloud instance
types) through the entry-point group ``asynctorchx.named_resources``: each entry point's object is a
callable taking no argument and returning a ``Resource``. Builtin names are never replaced.
The entry points are read once per process (``_plugins.cache_clear()`` re-reads them).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING

from asynctorchx.specs.api import InvalidAppDefException, Resource

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GiB = 1024

ENTRY_POINT_GROUP = "asynctorchx.named_resources"

_GENERIC: dict[str, Callable[[], Resource]] = {
    "cpu.nano": lambda: Resource(cpu=1, gpu=0, memMB=512),
    "cpu.micro": lambda: Resource(cpu=1, gpu=0, memMB=1 * GiB),
    "cpu.small": lambda: Resource(cpu=1, gpu=0, memMB=2 * GiB),
    "cpu.medium": lambda: Resource(cpu=2, gpu=0, memMB=4 * GiB),
    "cpu.large": lambda: Resource(cpu=4, gpu=0, memMB=16 * GiB),
    "cpu.xlarge": lambda: Resource(cpu=8, gpu=0, memMB=32 * GiB),
    "gpu.small": lambda: Resource(cpu=8, gpu=1, memMB=32 * GiB),
    "gpu.medium": lambda: Resource(cpu=16, gpu=2, memMB=64 * GiB),
    "gpu.large": lambda: Resource(cpu=32, gpu=4, memMB=128 * GiB),
    "gpu.xlarge": lambda: Resource(cpu=64, gpu=8, memMB=256 * GiB),
}


class UnknownNamedResourceException(InvalidAppDefException, KeyError):
    """An unknown named resource (a ValueError, and a KeyError for ``named_resources[name]``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _plugin_factory(ep: EntryPoint) -> Callable[[], Resource]:
    def factory() -> Resource:
        try:
            made = ep.load()()
        except Exception as e:
            raise InvalidAppDefException(
                f"named resource {ep.name!r} (entry point {ep.value!r} in group "
                f"{ENTRY_POINT_GROUP!r}) failed: {type(e).__name__}: {e}",
                field_name="resource",
            ) from e
        if not isinstance(made, Resource):
            raise InvalidAppDefException(
                f"named resource {ep.name!r} (entry point {ep.value!r}) must return a Resource, "
                f"got {made!r}",
                field_name="resource",
            )
        return made

    return factory


@cache
def _plugins() -> Mapping[str, Callable[[], Resource]]:
    from importlib.metadata import entry_points  # costly to import: only when a lookup needs it

    found: dict[str, Callable[[], Resource]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _GENERIC and ep.name not in found:
            found[ep.name] = _plugin_factory(ep)
    return found


def named_resource_names() -> list[str]:
    """Every known named resource, builtins first."""
    return [*_GENERIC, *sorted(_plugins())]


def get_named_resource(name: str) -> Resource:
    """The ``Resource`` for ``name`` (a fresh object each time, safe to modify).

    Entry points are loaded on first use of their name, so a broken plugin only fails its own names.

    Raises:
        UnknownNamedResourceException: unknown name; the message suggests the closest known names.
        InvalidAppDefException: a plugin's factory failed or did not return a ``Resource``.
    """
    factory = _GENERIC.get(name) or _plugins().get(name)
    if factory is None:
        known = named_resource_names()
        close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownNamedResourceException(
            f"unknown named resource {name!r}{hint} (known: {', '.join(known)})",
            field_name="resource",
        )
    return factory()


class NamedResources(Mapping[str, Resource]):
    """Every named resource as a read-only mapping; also callable like ``get_named_resource``.

    ``NAMED_RESOURCES["cpu.small"]``, ``"cpu.small" in NAMED_RESOURCES`` and
    ``NAMED_RESOURCES("cpu.small")`` all work; each lookup returns a fresh ``Resource``.
    """

    def __getitem__(self, name: str) -> Resource:
        return get_named_resource(name)

    def __call__(self, name: str) -> Resource:
        return get_named_resource(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in _GENERIC or name in _plugins())

    def __iter__(self) -> Iterator[str]:
        return iter(named_resource_names())

    def __len__(self) -> int:
        return len(named_resource_names())


NAMED_RESOURCES = NamedResources()


def resource(
    cpu: int | None = None,
    gpu: int | None = None,
    memMB: int | None = None,
    h: str | None = None,
) -> Resource:
    """A ``Resource`` from a named resource ``h`` or from explicit numbers.

    ``h`` wins over the numbers when given. Unset numbers default to 1 CPU, 0 GPU and 1024 MiB.
    """
    if h:
        return get_named_resource(h)
    return Resource(
        cpu=1 if cpu is None else cpu,
        gpu=0 if gpu is None else gpu,
        memMB=1024 if memMB is None else memMB,
    )
