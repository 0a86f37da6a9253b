"""Named resources: a short name (``cpu.small``, ``aws_p3.2xlarge``) standing for a ``Resource``.

The builtin names are TorchX 0.7's: its generic set (``cpu.nano`` ... ``gpu.xlarge``, plus ``NULL``
and ``MISSING`` for "no requirement") with the same numbers, and its AWS instance types
(``asynctorchx.specs.named_resources_aws``). Packages add their own names through two entry-point
groups, read the same way: ``asynctorchx.named_resources`` and TorchX's ``torchx.named_resources``
(so resources registered for TorchX work unchanged). Each entry point's object is a callable taking
no argument and returning a ``Resource`` (a TorchX ``Resource`` is converted field by field).

On a clash the builtins win over both groups and ``asynctorchx.named_resources`` wins over
``torchx.named_resources``; the losing entry point is ignored with a logged warning. The entry points
are read once per process (``_plugins.cache_clear()`` re-reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

from asynctorchx.specs.api import NULL_RESOURCE, InvalidAppDefException, Resource
from asynctorchx.specs.named_resources_aws import NAMED_RESOURCES as AWS_NAMED_RESOURCES

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint


GiB = 1024

ENTRY_POINT_GROUP = "asynctorchx.named_resources"
TORCHX_ENTRY_POINT_GROUP = "torchx.named_resources"


def _null() -> Resource:
    return Resource(cpu=NULL_RESOURCE.cpu, gpu=NULL_RESOURCE.gpu, memMB=NULL_RESOURCE.memMB)


GENERIC_NAMED_RESOURCES: Mapping[str, Callable[[], Resource]] = {
    "cpu.nano": lambda: Resource(cpu=1, gpu=0, memMB=512),
    "cpu.micro": lambda: Resource(cpu=1, gpu=0, memMB=1 * GiB),
    "cpu.small": lambda: Resource(cpu=1, gpu=0, memMB=2 * GiB),
    "cpu.medium": lambda: Resource(cpu=2, gpu=0, memMB=4 * GiB),
    "cpu.large": lambda: Resource(cpu=2, gpu=0, memMB=8 * GiB),
    "cpu.xlarge": lambda: Resource(cpu=8, gpu=0, memMB=32 * GiB),
    "gpu.small": lambda: Resource(cpu=8, gpu=1, memMB=32 * GiB),
    "gpu.medium": lambda: Resource(cpu=16, gpu=2, memMB=64 * GiB),
    "gpu.large": lambda: Resource(cpu=32, gpu=4, memMB=128 * GiB),
    "gpu.xlarge": lambda: Resource(cpu=64, gpu=8, memMB=256 * GiB),
}
"""TorchX's generic names: CPU/GPU/memory ratios of common hardware, not of a given instance type."""

_BUILTIN: dict[str, Callable[[], Resource]] = {
    **GENERIC_NAMED_RESOURCES,
    **AWS_NAMED_RESOURCES,
    "NULL": _null,
    "MISSING": _null,
}


class UnknownNamedResourceException(InvalidAppDefException, KeyError):
    """An unknown named resource (a ValueError, and a KeyError for ``named_resources[name]``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _plugin_factory(ep: EntryPoint) -> Callable[[], Resource]:
    def factory() -> Resource:
        try:
            made: Any = ep.load()()
        except Exception as e:
            raise InvalidAppDefException(
                f"named resource {ep.name!r} (entry point {ep.value!r} in group "
                f"{ep.group!r}) failed: {type(e).__name__}: {e}",
                field_name="resource",
            ) from e
        if not isinstance(made, Resource):
            from asynctorchx.specs._torchx import is_torchx_object, resource_from_torchx

            if is_torchx_object(made, "Resource"):
                return resource_from_torchx(made)
            raise InvalidAppDefException(
                f"named resource {ep.name!r} (entry point {ep.value!r} in group {ep.group!r}) "
                f"must return a Resource, got {made!r}",
                field_name="resource",
            )
        return made

    return factory


@cache
def _plugins() -> Mapping[str, Callable[[], Resource]]:
    import logging
    from importlib.metadata import entry_points  # costly to import: only when a lookup needs it

    logger = logging.getLogger(__name__)

    found: dict[str, Callable[[], Resource]] = {}
    origin: dict[str, str] = {}
    for group in (ENTRY_POINT_GROUP, TORCHX_ENTRY_POINT_GROUP):
        for ep in entry_points(group=group):
            where = f"{ep.name} = {ep.value} (group {group!r})"
            if ep.name in _BUILTIN:
                logger.warning(
                    "ignoring named resource %s: %r is a builtin named resource", where, ep.name
                )
                continue
            if ep.name in found:
                logger.warning(
                    "ignoring named resource %s: %r is already registered by %s",
                    where,
                    ep.name,
                    origin[ep.name],
                )
                continue
            found[ep.name] = _plugin_factory(ep)
            origin[ep.name] = where
    return found


def named_resource_names() -> list[str]:
    """Every known named resource, builtins first."""
    return [*_BUILTIN, *sorted(_plugins())]


def get_named_resource(name: str) -> Resource:
    """The ``Resource`` for ``name`` (a fresh object each time, safe to modify).

    Entry points are loaded on first use of their name, so a broken plugin only fails its own names.

    Raises:
        UnknownNamedResourceException: unknown name; the message suggests the closest known names.
        InvalidAppDefException: a plugin's factory failed or did not return a ``Resource``.
    """
    factory = _BUILTIN.get(name) or _plugins().get(name)
    if factory is None:
        import difflib

        known = named_resource_names()
        close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownNamedResourceException(
            f"unknown named resource {name!r}{hint} (known: {', '.join(known)})",
            field_name="resource",
        )
    return factory()


def get_named_resources(name: str) -> Resource:
    """TorchX's name for ``get_named_resource``."""
    return get_named_resource(name)


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
        return isinstance(name, str) and (name in _BUILTIN or name in _plugins())

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

    ``h`` wins over the numbers when given. Unset numbers default to TorchX's: 2 CPUs, 0 GPU and
    1024 MiB (an explicit 0 is kept, where TorchX would replace it by the default).
    """
    if h:
        return get_named_resource(h)
    return Resource(
        cpu=2 if cpu is None else cpu,
        gpu=0 if gpu is None else gpu,
        memMB=1024 if memMB is None else memMB,
    )
