"""Stand-ins for ``torchx`` imports in a component file written for TorchX, scoped to that file.

When the ``torchx`` package is not installed, a component file such as::

    import torchx
    import torchx.specs as specs
    from torchx.components.dist import ddp

    def trainer(image: str = torchx.IMAGE) -> specs.AppDef: ...

loads with these statements resolved to asynctorchx: ``torchx.specs`` to ``asynctorchx.specs`` (plus
TorchX's extra names: ``get_named_resources``, ``named_resources``, ``GiB``...),
``torchx.specs.named_resources_aws``/``_generic``, ``torchx.components.{dist,utils,serve,metrics}``
to the builtins of the same names (``dist`` with TorchX's helpers that its ``dist.ddp`` source
imports: ``parse_nnodes``, ``get_role_name``, ``_args_join``, ``_noquote``), TorchX's
``torchx.components.structured_arg`` (``StructuredJArgument``, ``StructuredNameArgument``),
``torchx.IMAGE``/``torchx.version.TORCHX_IMAGE`` to
``asynctorchx.IMAGE`` (which is TorchX 0.7's default image).

How it stays scoped: the file is executed with a ``__builtins__`` of its own whose ``__import__``
answers ``torchx`` and ``torchx.*`` with stand-in module objects and passes every other import to the
real one. Nothing is put in ``sys.modules``: other modules, other threads importing at the same
time, and the rest of the process never see a ``torchx`` they did not install, and a later ``import
torchx`` anywhere else behaves as if this module did not exist. The stand-ins serve the file's own
code only (its top level and its functions, whenever they run); ``importlib.import_module("torchx")``
and modules the file imports are not redirected.

A TorchX name asynctorchx has no counterpart for raises ``TorchXMissingAttribute`` (an
``AttributeError``) or ``TorchXMissingModule`` (a ``ModuleNotFoundError``) naming it, and is recorded
so that the finder can say what is missing even when Python turns it into a bare ``ImportError``
(``from torchx.specs import Workspace``).
"""

from __future__ import annotations

import builtins
import importlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

from asynctorchx.specs._torchx import TorchXMissingAttribute, TorchXMissingModule
from asynctorchx.version import IMAGE

_MENTIONS_TORCHX = re.compile(r"\btorchx\b")

_SUPPORTED = (
    "torchx.IMAGE, torchx.specs (and its api, builders, named_resources_aws and "
    "named_resources_generic modules) and torchx.components.dist/utils/serve/metrics/"
    "structured_arg"
)

_SPECS_NAMES = (
    "ALL",
    "MISSING",
    "NONE",
    "NULL_RESOURCE",
    "AppDef",
    "AppDryRunInfo",
    "AppHandle",
    "AppState",
    "AppStatus",
    "AppStatusError",
    "BindMount",
    "CfgVal",
    "DeviceMount",
    "InvalidRunConfigException",
    "MalformedAppHandleException",
    "MountType",
    "ParsedAppHandle",
    "ReplicaState",
    "ReplicaStatus",
    "Resource",
    "RetryPolicy",
    "Role",
    "RoleStatus",
    "UnknownAppException",
    "UnknownSchedulerException",
    "VolumeMount",
    "get_named_resources",
    "is_started",
    "is_terminal",
    "macros",
    "make_app_handle",
    "materialize_appdef",
    "named_resources",
    "parse_app_handle",
    "parse_mounts",
    "resource",
    "runopt",
    "runopts",
)

_COMPONENT_MODULES = ("dist", "utils", "serve", "metrics")


# -- TorchX's helpers that its own component sources import ----------------------------------------
# ``torchx builtins --print dist.ddp`` shows a source that imports these: a component copied from
# it must load. They follow TorchX 0.7's behaviour (results, and the errors' kinds), which differs in
# places from asynctorchx's own dist helpers (``parse_nnodes`` returns a tuple here).


@dataclass
class StructuredNameArgument:
    """TorchX's ``--name`` of ``dist.ddp``: ``EXPERIMENT/RUN``, ``EXPERIMENT/``, ``/RUN`` or ``RUN``.

    Args:
        experiment_name: the experiment (``default-experiment`` when the name leaves it out).
        run_name: the run (the script's stem or the module's last part when left out).
    """

    experiment_name: str
    run_name: str

    def __str__(self) -> str:
        return f"{self.experiment_name or ''}/{self.run_name}"

    @staticmethod
    def parse_from(
        name: str,
        m: str | None = None,
        script: str | None = None,
        default_experiment_name: str = "default-experiment",
    ) -> StructuredNameArgument:
        """Splits ``name`` at its first ``/``; exactly one of ``m`` and ``script`` must be given.

        Raises:
            ValueError: neither or both of ``m`` and ``script`` are given.
        """
        if not m and not script:
            raise ValueError("no main module (-m) or script (--script) given: give exactly one")
        if m and script:
            raise ValueError("both a main module (-m) and a script (--script) given: give one")
        experiment, slash, run = name.partition("/")
        if not slash:
            experiment, run = "", name
        if not run:
            run = m.rpartition(".")[2] if m else Path(script or "").stem
        return StructuredNameArgument(experiment or default_experiment_name, run)


@dataclass
class StructuredJArgument:
    """TorchX's ``-j`` of ``dist.ddp``: ``NNODESxNPROC_PER_NODE``, or ``NNODES`` on a GPU host.

    Args:
        nnodes: the number of nodes.
        nproc_per_node: the processes per node.
    """

    nnodes: int
    nproc_per_node: int

    def __str__(self) -> str:
        return f"{self.nnodes}x{self.nproc_per_node}"

    @staticmethod
    def parse_from(h: str, j: str) -> StructuredJArgument:
        """``j`` with the GPUs of the named resource ``h``: ``-j N`` means one process per GPU.

        An explicit ``NxP`` whose ``P`` differs from the host's GPU count is kept, with a warning
        (as TorchX does).

        Raises:
            ValueError: ``j`` has more than one ``x``, a part is not a number, or ``-j N`` names a
                host without GPUs.
        """
        import warnings

        from asynctorchx.specs import get_named_resource

        parts = j.split("x")
        gpus = get_named_resource(h).gpu
        if len(parts) == 1:
            nnodes = int(parts[0])
            if gpus <= 0:
                raise ValueError(
                    f"nproc_per_node cannot be inferred from the GPU count: {h!r} has no GPU; "
                    f"give -j NNODESxNPROC_PER_NODE (e.g. -j {nnodes}x8)"
                )
            return StructuredJArgument(nnodes, gpus)
        if len(parts) == 2:
            nnodes, nproc = int(parts[0]), int(parts[1])
            if nproc != gpus:
                warnings.warn(
                    f"-j {j}: nproc_per_node={nproc} is not the number of GPUs of {h} ({gpus}); "
                    f"-j {nnodes} sets it to the GPU count",
                    stacklevel=2,
                )
            return StructuredJArgument(nnodes, nproc)
        raise ValueError(f"-j {j!r} is not of the form NNODESxNPROC_PER_NODE (e.g. -j 1x8)")


class _noquote(str):  # (lower case: TorchX's name)
    """A command-line word ``_args_join`` leaves unquoted (e.g. a ``${VAR:=default}``)."""


def _args_join(args: Iterable[str]) -> str:
    """``shlex.join`` of ``args``, except that ``_noquote`` words are joined as they are."""
    import shlex

    return " ".join(a if isinstance(a, _noquote) else shlex.quote(a) for a in args)


def get_role_name(script: str | None, m: str | None) -> str:
    """The role name of ``dist.ddp``: the script's stem, else the module's last part.

    Raises:
        ValueError: neither is given.
    """
    if script:
        return Path(script).stem
    if m:
        return m.rpartition(".")[2]
    raise ValueError("failed to compute role_name: neither a script nor a module (-m) is given")


_TORCHX_J = re.compile(r"^(?:(?:(?P<min>\d+):)?(?P<max>\d+)x)?(?P<nproc>\d+)$")


def parse_nnodes(j: str) -> tuple[int, int, int, str]:
    """TorchX's ``parse_nnodes``: ``[[MIN:]MAXx]NPROC`` as ``(min, max, nproc_per_node, nnodes)``,
    ``nnodes`` being the text of torchrun's ``--nnodes`` (``"2"`` or ``"1:2"``); no node count
    means 1.

    Raises:
        ValueError: ``j`` is not of that form.
    """
    match = _TORCHX_J.match(j)
    if match is None:
        raise ValueError(f"invalid format for -j, usage example: 1:2x4 or 1x4 or 4. Given: {j}")
    nnodes_text = match["max"] or "1"
    low = match["min"] or nnodes_text
    if match["min"]:
        nnodes_text = f"{match['min']}:{match['max']}"
    return int(low), int(match["max"] or 1), int(match["nproc"]), nnodes_text


#: What ``torchx.components.dist`` has beyond asynctorchx's ``dist`` module's public names.
_DIST_EXTRAS: dict[str, Any] = {
    "parse_nnodes": parse_nnodes,
    "get_role_name": get_role_name,
    "_args_join": _args_join,
    "_noquote": _noquote,
    "StructuredJArgument": StructuredJArgument,
    "StructuredNameArgument": StructuredNameArgument,
}


def describe_missing(qualname: str) -> str:
    """The message for a TorchX name (``torchx.specs.Workspace``) asynctorchx does not provide."""
    return f"uses {qualname}, which has no counterpart in asynctorchx (it provides {_SUPPORTED})"


def mentions_torchx(source: str) -> bool:
    """True when ``source`` has the word ``torchx`` (``asynctorchx`` does not count)."""
    return _MENTIONS_TORCHX.search(source) is not None


def torchx_installed() -> bool:
    """True when a real ``torchx`` package is importable (then no stand-in is ever used)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torchx") is not None
    except (ImportError, ValueError):
        return False


class _StandIns:
    """The stand-in modules of one component file, made on first use and kept for the file."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self._modules: dict[str, ModuleType] = {}
        self._factories: dict[str, Callable[[], Mapping[str, Any]]] = {
            "torchx": self._top,
            "torchx.version": lambda: {"TORCHX_IMAGE": IMAGE},
            "torchx.specs": self._specs,
            "torchx.specs.api": self._specs,
            "torchx.specs.builders": self._builders,
            "torchx.specs.named_resources_aws": self._aws,
            "torchx.specs.named_resources_generic": self._generic,
            "torchx.components": dict,
            **{f"torchx.components.{m}": self._component_module(m) for m in _COMPONENT_MODULES},
            "torchx.components.structured_arg": lambda: {
                "StructuredJArgument": StructuredJArgument,
                "StructuredNameArgument": StructuredNameArgument,
            },
        }

    # -- contents -----------------------------------------------------------------------------

    def _top(self) -> Mapping[str, Any]:
        return {"IMAGE": IMAGE}

    def _specs(self) -> Mapping[str, Any]:
        from asynctorchx import specs

        nr = importlib.import_module("asynctorchx.specs.named_resources")

        values: dict[str, Any] = {name: getattr(specs, name) for name in _SPECS_NAMES}
        values["RetryPolicy"] = self._enum(specs.RetryPolicy, "torchx.specs.RetryPolicy")
        values["GiB"] = nr.GiB
        values["named_resources"] = nr.NAMED_RESOURCES
        values["get_type_name"] = specs.get_type_name  # (TorchX's: typing.List[str])
        return values

    def _enum(self, enum_cls: type[Enum], qualname: str) -> type:
        """``enum_cls`` as seen by the file: a member it lacks (``HOT_SPARE``) is reported missing.

        Calls, ``isinstance``, iteration and ``[name]`` go to ``enum_cls`` itself, so the values the
        file gets are the real members.
        """
        record = self.missing

        class StandIn(type):
            def __getattr__(cls, name: str) -> Any:
                try:
                    return getattr(enum_cls, name)
                except AttributeError:
                    if name.startswith("__"):
                        raise
                    record.append(f"{qualname}.{name}")
                    raise TorchXMissingAttribute(
                        describe_missing(f"{qualname}.{name}"), name=name
                    ) from None

            def __instancecheck__(cls, obj: Any) -> bool:
                return isinstance(obj, enum_cls)

            def __call__(cls, *args: Any, **kwargs: Any) -> Any:
                return enum_cls(*args, **kwargs)

            def __iter__(cls) -> Iterator[Any]:
                return iter(enum_cls)

            def __getitem__(cls, name: str) -> Any:
                return enum_cls[name]

        return StandIn(enum_cls.__name__, (), {"__doc__": enum_cls.__doc__})

    def _builders(self) -> Mapping[str, Any]:
        from asynctorchx.specs import builders

        return {
            name: getattr(builders, name)
            for name in ("materialize_appdef", "component_args_from_str", "parse_args")
        } | {
            "parse_mounts": self._specs()["parse_mounts"],
            "make_app_handle": self._specs()["make_app_handle"],
        }

    def _aws(self) -> Mapping[str, Any]:
        from asynctorchx.specs import named_resources_aws as aws

        values = {name: value for name, value in vars(aws).items() if not name.startswith("_")}
        values.update({name: getattr(aws, name) for name in aws._FACTORY_NAMES})
        return values

    def _generic(self) -> Mapping[str, Any]:
        nr = importlib.import_module("asynctorchx.specs.named_resources")
        return {"NAMED_RESOURCES": nr.GENERIC_NAMED_RESOURCES, "GiB": nr.GiB}

    def _component_module(self, name: str) -> Callable[[], Mapping[str, Any]]:
        def contents() -> Mapping[str, Any]:
            module = importlib.import_module(f"asynctorchx.components.{name}")
            values = {k: v for k, v in vars(module).items() if not k.startswith("_")}
            if name == "dist":
                values.update(_DIST_EXTRAS, _TORCH_DEBUG_FLAGS=module.TORCH_DEBUG_FLAGS)
            return values

        return contents

    # -- modules --------------------------------------------------------------------------------

    def module(self, name: str) -> ModuleType:
        """The stand-in for module ``name`` (``torchx.specs``), with its parents made too.

        Raises:
            TorchXMissingModule: asynctorchx has no counterpart for ``name``.
        """
        found = self._modules.get(name)
        if found is not None:
            return found
        factory = self._factories.get(name)
        if factory is None:
            self.missing.append(name)
            raise TorchXMissingModule(describe_missing(name), name=name)
        module = ModuleType(name, f"asynctorchx's stand-in for TorchX's {name}")
        module.__dict__.update(factory())
        module.__dict__["__getattr__"] = self._attribute(name)
        self._modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(self.module(parent), child, module)
        return module

    def _attribute(self, module_name: str) -> Callable[[str], Any]:
        """The ``__getattr__`` of a stand-in: its submodules on first use, else an error."""

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            qualname = f"{module_name}.{attr}"
            if qualname in self._factories:
                return self.module(qualname)
            self.missing.append(qualname)
            raise TorchXMissingAttribute(describe_missing(qualname), name=attr)

        return __getattr__

    def import_(
        self,
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: tuple[str, ...] | list[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        """``__import__`` of the component file: stand-ins for ``torchx``, the real one else."""
        if level == 0 and (name == "torchx" or name.startswith("torchx.")):
            leaf = self.module(name)
            return leaf if fromlist else self.module("torchx")
        result: ModuleType = builtins.__import__(name, globals, locals, fromlist or (), level)
        return result


def scoped_builtins() -> tuple[dict[str, Any], list[str]]:
    """A ``__builtins__`` for one component file whose imports of ``torchx`` get stand-ins.

    Returns:
        The builtins to set as the module's ``__builtins__`` before executing it, and the list into
        which each TorchX name without a counterpart is recorded as the file uses it.
    """
    stand_ins = _StandIns()
    scoped = dict(vars(builtins))
    scoped["__import__"] = stand_ins.import_
    return scoped, stand_ins.missing
