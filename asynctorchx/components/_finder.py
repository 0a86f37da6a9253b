"""Finding components by name: builtins, entry-point plugins and component files.

* Builtins are the public functions returning ``AppDef`` of the modules of this package, named
  ``module.function`` (``utils.echo``, ``dist.ddp``). A module is imported only when one of its
  components is asked for (or when every component is listed).
* Plugins come from the entry-point groups ``asynctorchx.components`` and TorchX's
  ``torchx.components``, read the same way: an entry point ``name = pkg.module`` contributes each
  component function of ``pkg.module`` as ``name.fn`` (and, for a package, of each submodule as
  ``name.sub.fn``); one naming a function (``name = pkg.module:fn``) contributes it as ``name``. As in
  TorchX, a ``torchx.components`` entry named ``_...`` adds no prefix. Plugins are merged with the
  builtins and never hide one (TorchX would hide every builtin as soon as the group exists); on a
  name registered in both groups, ours wins. Every entry point skipped is warned about.
* ``path/to/file.py:fn`` names the function ``fn`` of a file, which is linted before it is imported.
  A file written for TorchX loads unchanged: with the ``torchx`` package installed its AppDef is
  converted field by field (``asynctorchx.specs._torchx``); without it, its own ``import torchx...``
  statements get stand-ins (``_torchx_shim``), for that file only.

Components are linted too (from their source, when it is available): ``get_component`` raises
``ComponentValidationException`` for errors, and keeps warnings in ``Component.validation_errors``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from asynctorchx.components._torchx_shim import (
    describe_missing,
    mentions_torchx,
    scoped_builtins,
    torchx_installed,
)
from asynctorchx.specs._torchx import TorchXUnsupportedError
from asynctorchx.specs.api import AppDef
from asynctorchx.specs.errors import ComponentNotFoundException, ComponentValidationException
from asynctorchx.specs.file_linter import (
    LinterMessage,
    errors_only,
    get_fn_docstring,
    validate,
    validate_source,
)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asynctorchx.components"
TORCHX_ENTRY_POINT_GROUP = "torchx.components"
_BUILTIN_PACKAGE = "asynctorchx.components"


@dataclass(frozen=True)
class Component:
    """A component function and what is known about it.

    Args:
        name: how it is asked for: ``module.fn``, ``plugin.fn`` or ``path/to/file.py:fn``.
        fn: the function returning an ``AppDef``.
        description: the first line of its docstring.
        validation_errors: the linter's messages (warnings only, once ``get_component`` returned it).
        origin: where it comes from: ``builtin``, ``entry point NAME = VALUE`` or ``file PATH``.
    """

    name: str
    fn: Callable[..., AppDef]
    description: str
    validation_errors: tuple[LinterMessage, ...] = ()
    origin: str = "builtin"


def builtin_module_names() -> list[str]:
    """The modules of the builtin components (``utils``, ``dist``...), found without importing them."""
    package = sys.modules[_BUILTIN_PACKAGE]
    return sorted(
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_") and not info.ispkg
    )


def _returns_appdef(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` is annotated to return an AppDef (ours, or TorchX's for TorchX plugins)."""
    annotation = inspect.signature(fn).return_annotation
    if isinstance(annotation, str):
        return annotation.rpartition(".")[2] == "AppDef"
    if annotation is AppDef:
        return True
    module = getattr(annotation, "__module__", "") or ""
    return getattr(annotation, "__name__", "") == "AppDef" and module.split(".")[0] == "torchx"


def _component_functions(module: ModuleType) -> dict[str, Callable[..., AppDef]]:
    """The public functions defined in ``module`` that are annotated to return ``AppDef``."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isfunction(obj)
        and not name.startswith("_")
        and obj.__module__ == module.__name__
        and _returns_appdef(obj)
    }


@lru_cache(maxsize=512)
def _lint_file(
    source_file: str, mtime_ns: int, size: int, fn_name: str
) -> tuple[LinterMessage, ...]:
    """The linter's messages for a function of a file version (the file's stat is in the key)."""
    del mtime_ns, size
    return tuple(validate(source_file, fn_name))


def _lint(fn: Callable[..., Any]) -> tuple[LinterMessage, ...]:
    try:
        source_file = inspect.getsourcefile(fn)
        st = os.stat(source_file) if source_file else None
    except (TypeError, OSError):
        return ()
    if source_file is None or st is None:
        return ()
    return _lint_file(source_file, st.st_mtime_ns, st.st_size, fn.__name__)


def _make(name: str, fn: Callable[..., AppDef], origin: str) -> Component:
    description = get_fn_docstring(fn)[0].strip().splitlines()
    return Component(name, fn, description[0] if description else "", _lint(fn), origin)


@cache
def _entry_points() -> dict[str, EntryPoint]:
    """The entry points of both groups by name: ours first, then TorchX's; the first name wins."""
    found: dict[str, EntryPoint] = {}
    for group in (ENTRY_POINT_GROUP, TORCHX_ENTRY_POINT_GROUP):
        for ep in entry_points(group=group):
            if ep.name in found:
                logger.warning(
                    "ignoring entry point %s = %s in group %r: %r is already registered as %s "
                    "(group %r)",
                    ep.name,
                    ep.value,
                    group,
                    ep.name,
                    found[ep.name].value,
                    found[ep.name].group,
                )
                continue
            found[ep.name] = ep
    return found


def clear_cache() -> None:
    """Forgets the entry points read so far, so that newly installed plugins are seen."""
    _entry_points.cache_clear()


def _builtin_components(module_name: str) -> dict[str, Component]:
    module = importlib.import_module(f"{_BUILTIN_PACKAGE}.{module_name}")
    return {
        f"{module_name}.{fn_name}": _make(f"{module_name}.{fn_name}", fn, "builtin")
        for fn_name, fn in _component_functions(module).items()
    }


def _prefix(ep: EntryPoint) -> str:
    """The name prefix of an entry point's components (TorchX's ``_N = module`` has none)."""
    if ep.group == TORCHX_ENTRY_POINT_GROUP and ep.name.startswith("_"):
        return ""
    return ep.name


def _module_candidates(module: ModuleType, prefix: str) -> dict[str, Callable[..., AppDef]]:
    """The components of a module and, for a package, of its submodules (``prefix.sub.fn``)."""
    candidates = {
        ".".join(p for p in (prefix, n) if p): fn for n, fn in _component_functions(module).items()
    }
    if hasattr(module, "__path__"):
        for info in pkgutil.walk_packages(module.__path__, prefix=f"{module.__name__}."):
            sub = importlib.import_module(info.name)
            rel = info.name[len(module.__name__) + 1 :]
            for n, fn in _component_functions(sub).items():
                candidates.setdefault(".".join(p for p in (prefix, rel, n) if p), fn)
    return candidates


def _plugin_components(ep: EntryPoint, reserved: set[str]) -> dict[str, Component]:
    """The components an entry point contributes, skipping names in ``reserved`` (the builtins)."""
    origin = f"entry point {ep.name} = {ep.value}"
    if ep.group != ENTRY_POINT_GROUP:
        origin += f" (group {ep.group!r})"
    try:
        obj = ep.load()
        if isinstance(obj, ModuleType):
            candidates = _module_candidates(obj, _prefix(ep))
        elif inspect.isfunction(obj):
            candidates = {ep.name: obj}
        else:
            logger.warning("skipping %s: it names %r, neither a module nor a function", origin, obj)
            return {}
    except Exception as e:
        logger.warning(
            "skipping components of %s: it failed to load: %s: %s",
            origin,
            type(e).__name__,
            e,
        )
        return {}
    out: dict[str, Component] = {}
    for name, fn in candidates.items():
        if name in reserved:
            logger.warning(
                "ignoring component %r of %s: a builtin component has that name", name, origin
            )
            continue
        out[name] = _make(name, fn, origin)
    return out


def get_components() -> dict[str, Component]:
    """Every builtin and plugin component by name (this imports every component module)."""
    components: dict[str, Component] = {}
    for module_name in builtin_module_names():
        components.update(_builtin_components(module_name))
    builtins = set(components)
    for ep in _entry_points().values():
        for name, component in _plugin_components(ep, builtins).items():
            components.setdefault(name, component)
    return components


def _is_file_component(name: str) -> bool:
    return ":" in name


def _load_file_component(name: str) -> Component:
    path_str, _, fn_name = name.rpartition(":")
    path = Path(path_str).expanduser()
    if not fn_name or not path_str:
        raise ComponentNotFoundException(
            name, "a file component is written 'path/to/file.py:function'"
        )
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise ComponentNotFoundException(name, f"file {str(path)!r} {what}")
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ComponentNotFoundException(name, f"cannot read {str(path)!r}: {e}") from None
    messages = validate_source(source, fn_name, str(path))
    missing = [m for m in messages if m.name == "ComponentFnFinder"]
    if missing:
        raise ComponentNotFoundException(name, f"{path_str}: {missing[0].description}")
    if errors_only(messages):
        raise ComponentValidationException(name, errors_only(messages))
    import hashlib

    resolved = path.resolve()
    module_name = f"_asynctorchx_component_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    # Python source whatever the file's suffix, as TorchX (which execs the file's text) loads it
    loader = importlib.machinery.SourceFileLoader(module_name, str(resolved))
    spec = importlib.util.spec_from_file_location(module_name, resolved, loader=loader)
    if spec is None or spec.loader is None:
        raise ComponentValidationException(name, reason=f"{str(path)!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    unsupported: list[str] = []
    if mentions_torchx(source) and not torchx_installed():
        # the file's own ``import torchx...`` get asynctorchx's stand-ins; nothing else does
        module.__dict__["__builtins__"], unsupported = scoped_builtins()
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        # e.g. a training script that parses sys.argv at import: the CLI would exit silently
        # with the script's code (0 reads as success, 3 as cancelled) having launched nothing
        sys.modules.pop(module_name, None)
        raise ComponentValidationException(
            name, reason=f"importing {str(path)!r} called sys.exit({e.code!r})"
        ) from None
    except Exception as e:
        sys.modules.pop(module_name, None)
        if isinstance(e, TorchXUnsupportedError):
            reason = str(e)
        elif isinstance(e, ImportError) and unsupported:
            reason = describe_missing(unsupported[-1])
        else:
            reason = f"importing {str(path)!r} failed: {type(e).__name__}: {e}"
            if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torchx":
                reason += (
                    " (only the component file's own imports of torchx are redirected to "
                    "asynctorchx when torchx is not installed)"
                )
        raise ComponentValidationException(name, reason=reason) from e
    fn = getattr(module, fn_name, None)
    if not inspect.isfunction(fn):
        raise ComponentNotFoundException(name, f"{fn_name!r} in {str(path)!r} is not a function")
    description = get_fn_docstring(fn)[0].strip().splitlines()
    return Component(
        name, fn, description[0] if description else "", tuple(messages), f"file {path}"
    )


def _suggest(name: str, names: list[str]) -> list[str]:
    """Up to three known names close to ``name``: whole-name typos first, then by function name."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.85)
    short = name.rpartition(".")[2]
    shorts = {n: n.rpartition(".")[2] for n in names}
    same_fn = [n for n, s in shorts.items() if s == short]
    close_fn = [n for n, s in shorts.items() if difflib.get_close_matches(short, [s], cutoff=0.75)]
    return list(dict.fromkeys([*close, *same_fn, *close_fn]))[:3]


def _checked(component: Component) -> Component:
    errors = errors_only(component.validation_errors)
    if errors:
        raise ComponentValidationException(component.name, errors)
    return component


def get_component(name: str) -> Component:
    """The component called ``name``: ``module.fn`` (builtin or plugin) or ``path/to/file.py:fn``.

    Only the module a builtin lives in is imported.

    Raises:
        ComponentNotFoundException: no such component (the message suggests close names).
        ComponentValidationException: the component fails the linter (the message lists the
            line-numbered errors) or its file cannot be imported.
    """
    if _is_file_component(name):
        return _load_file_component(name)
    module_name = name.rpartition(".")[0]
    if module_name in builtin_module_names():
        found = _builtin_components(module_name).get(name)
        if found is not None:
            return _checked(found)
    eps = _entry_points()
    for ep_name in (module_name, name):
        ep = eps.get(ep_name)
        if ep is None:
            continue
        reserved = (
            set(_builtin_components(module_name))
            if module_name in builtin_module_names()
            else set()
        )
        found = _plugin_components(ep, reserved).get(name)
        if found is not None:
            return _checked(found)
    every = get_components()
    if name in every:  # e.g. TorchX's ``_N = package``: its components have no entry-point prefix
        return _checked(every[name])
    raise ComponentNotFoundException(name, suggestions=_suggest(name, sorted(every)))
