"""The job side of tracking: ``AppRun``, the ``TrackerBase`` adapter ABC and the environment contract.

Names and behaviour follow TorchX's ``torchx.tracker.api`` so that a training script written for TorchX
runs unchanged once its import says ``asynctorchx``. The launcher (``AsyncRunner.dryrun``) puts into
every role's environment:

- ``TORCHX_JOB_ID``: the app handle, which is the run id (``{scheduler}://{session}/{app_id}``);
- ``TORCHX_PARENT_RUN_ID``: the run this one belongs to (``parent_run_id=``), when given;
- ``TORCHX_TRACKERS``: the comma-separated tracker names of ``[torchx:tracker]``;
- ``TORCHX_TRACKER_<NAME>_CONFIG``: the ``config`` of ``[tracker:NAME]``, when given;
- ``TORCHX_TRACKER_<NAME>_FACTORY``: the factory named as the value of ``NAME`` in
  ``[torchx:tracker]``, when it is not the name itself (TorchX documents the value but ignores it).

In the job, each tracker name (or its factory) is resolved, first match wins: a builtin (``fsspec``),
an entry point of group ``asynctorchx.tracker`` then ``torchx.tracker``, then ``module:factory``.
The factory is called with the config string (or None) and returns a ``TrackerBase``.

This module is synchronous and import-light: it imports neither asyncio nor anyio, so a training
script pays nothing for them. Exception tree::

    Exception
     └── TrackerError                         any tracking failure; the message names the tracker
          ├── UnknownTrackerError (LookupError)   a name resolves to no factory, or it cannot import
          ├── TrackerConfigError (ValueError)     a tracker's config cannot be read or is invalid
          ├── TrackerWriteError                   a tracker failed to record (names each failing one)
          ├── InvalidMetadataError (TypeError)    a value is not JSON-serialisable (names the key)
          └── UnknownRunError (LookupError)       a run id the tracker does not have

Error policy: a tracker that cannot be set up raises when the job calls ``app_run_from_env()``
(TorchX only logs a warning and drops it; losing a run's results silently is worse than failing
before training starts). A write that fails mid-run raises ``TrackerWriteError`` naming the tracker
and the run, after every other tracker has recorded the data (TorchX lets the first error escape and
skips the remaining trackers). Training code that prefers to go on catches ``TrackerError``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

logger = logging.getLogger(__name__)

ENV_TORCHX_TRACKERS = "TORCHX_TRACKERS"
ENV_TORCHX_PARENT_RUN_ID = "TORCHX_PARENT_RUN_ID"
ENV_TORCHX_JOB_ID = "TORCHX_JOB_ID"

#: The run id of a process that was not launched as a job (TorchX's constant).
UNDEFINED_JOB_ID = "<UNDEFINED>"

#: Entry-point groups searched for a tracker name, in order (ours, then TorchX's).
ENTRY_POINT_GROUPS = ("asynctorchx.tracker", "torchx.tracker")

_FSSPEC_FACTORY = "asynctorchx.tracker.backend.fsspec:create"
#: Tracker names (and factories) served by this package without an entry-point scan. TorchX's own
#: fsspec factory maps to ours: both write the same layout, and the job need not have TorchX.
BUILTIN_TRACKERS: Mapping[str, str] = {
    "fsspec": _FSSPEC_FACTORY,
    "torchx.tracker.backend.fsspec:create": _FSSPEC_FACTORY,
}


class TrackerError(Exception):
    """Raised when a tracker cannot be set up, read or written; the message names the tracker."""


class UnknownTrackerError(TrackerError, LookupError):
    """Raised when a tracker name resolves to no builtin, entry point or importable ``module:factory``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrackerConfigError(TrackerError, ValueError):
    """Raised when a tracker's config is missing, unreadable or invalid (the message names the file)."""


class InvalidMetadataError(TrackerError, TypeError):
    """Raised when a metadata value is not JSON-serialisable (the message names the key and type)."""


class UnknownRunError(TrackerError, LookupError):
    """Raised when a run id is not known to the tracker."""

    def __init__(self, run_id: str, where: str = "") -> None:
        self.run_id = run_id
        super().__init__(f"unknown run id {run_id!r}" + (f" in {where}" if where else ""))

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrackerWriteError(TrackerError):
    """Raised when one or more trackers failed to record data; the others recorded it.

    Attributes:
        run_id: the run written to.
        failures: ``(tracker name, exception)`` for each tracker that failed.
    """

    def __init__(self, what: str, run_id: str, failures: list[tuple[str, BaseException]]) -> None:
        self.run_id = run_id
        self.failures = failures
        detail = "; ".join(f"tracker {n!r}: {type(e).__name__}: {e}" for n, e in failures)
        super().__init__(f"{what} of run {run_id!r} failed: {detail}")


@dataclass
class TrackerSource:
    """A source of a run, as a backend stores it.

    Args:
        source_run_id: another run's id, or the id of an external entity (an experiment...).
        artifact_name: the kind of relation (which artifact of the source is used), or None.
    """

    source_run_id: str
    artifact_name: str | None


@dataclass
class TrackerArtifact:
    """An artifact of a run, as a backend stores it.

    Args:
        name: the artifact's name (unique within the run; a later one replaces an earlier one).
        path: where the artifact is.
        metadata: anything else recorded with it.
    """

    name: str
    path: str
    metadata: Mapping[str, object] | None


@dataclass
class AppRunTrackableSource:
    """A source of a run at the ``AppRun`` level.

    Args:
        parent: the source run.
        artifact_name: the kind of relation, or None.
    """

    parent: AppRun
    artifact_name: str | None


class Lineage:
    """Placeholder of TorchX's (not yet specified) lineage type."""


class TrackerBase(ABC):
    """The adapter every tracking backend implements (TorchX's ABC, same methods).

    Writers are called by ``AppRun`` in the job; readers by ``AsyncTrackerReader`` (in a worker
    thread) and by ``asynctorchx tracker list``.
    """

    @abstractmethod
    def add_artifact(
        self, run_id: str, name: str, path: str, metadata: Mapping[str, object] | None = None
    ) -> None:
        """Records an artifact ``name`` at ``path`` with optional metadata."""

    @abstractmethod
    def artifacts(self, run_id: str) -> Mapping[str, TrackerArtifact]:
        """The artifacts of the run, by name."""

    @abstractmethod
    def add_metadata(self, run_id: str, **kwargs: object) -> None:
        """Records metadata key/values (a later value of a key replaces an earlier one)."""

    @abstractmethod
    def metadata(self, run_id: str) -> Mapping[str, object]:
        """The metadata of the run, later values winning."""

    @abstractmethod
    def add_source(self, run_id: str, source_id: str, artifact_name: str | None = None) -> None:
        """Links the run to a source (its parent run, an experiment...) and the artifact it uses."""

    @abstractmethod
    def sources(self, run_id: str, artifact_name: str | None = None) -> Iterable[TrackerSource]:
        """The sources of the run, optionally only those of ``artifact_name``."""

    @abstractmethod
    def lineage(self, run_id: str) -> Lineage:
        """The run's lineage (not specified by TorchX yet; backends may raise NotImplementedError)."""

    @abstractmethod
    def run_ids(self, **kwargs: str) -> Iterable[str]:
        """The run ids the backend knows; ``parent_run_id=`` keeps the children of that run."""


TrackerFactory = Callable[[str | None], TrackerBase]


@dataclass(frozen=True)
class TrackerSetting:
    """A tracker as the launcher configures it (``[torchx:tracker]`` and ``[tracker:NAME]``).

    Args:
        name: the tracker's name (``TORCHX_TRACKERS`` lists it).
        config: its config string (``TORCHX_TRACKER_<NAME>_CONFIG``), or None.
        factory: what the job resolves instead of the name (``TORCHX_TRACKER_<NAME>_FACTORY``), or
            None to resolve the name itself.
    """

    name: str
    config: str | None = None
    factory: str | None = None


def tracker_config_env_var_name(entrypoint_key: str) -> str:
    """``TORCHX_TRACKER_<NAME>_CONFIG``: the variable holding tracker ``NAME``'s config."""
    return f"TORCHX_TRACKER_{entrypoint_key.upper()}_CONFIG"


def tracker_factory_env_var_name(entrypoint_key: str) -> str:
    """``TORCHX_TRACKER_<NAME>_FACTORY``: the variable naming tracker ``NAME``'s factory, if not NAME."""
    return f"TORCHX_TRACKER_{entrypoint_key.upper()}_FACTORY"


#: The deepest nesting of lists and dicts a metadata value may have. Deeper JSON is near what
#: Python's parser can read back (about 1000 levels, less in a thread), and no result needs it.
MAX_JSON_DEPTH = 100


def _nested_deeper(value: object, limit: int) -> bool:
    """True when ``value`` nests lists/tuples/dicts more than ``limit`` levels (it is acyclic)."""
    level: list[object] = [value]
    depth = 0
    while True:
        children: list[object] = []
        containers = 0
        for v in level:
            if isinstance(v, dict):
                children.extend(v.values())
            elif isinstance(v, (list, tuple)):
                children.extend(v)
            else:
                continue
            containers += 1
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        level = children


def _too_deep(what: str, key: str, value: object) -> InvalidMetadataError:
    return InvalidMetadataError(
        f"{what} {key!r} is nested more than {MAX_JSON_DEPTH} levels deep "
        f"(lists and dicts within each other): {_short_repr(value)}"
    )


def _json_key(key: object) -> str:
    """The string ``json.dumps`` writes for dict key ``key`` (1 -> "1", True -> "true"...)."""
    return key if isinstance(key, str) else json.dumps(key)


def _colliding_keys(value: object) -> tuple[str, object, object] | None:
    """The first dict within ``value`` (acyclic, JSON-serialisable) two of whose keys JSON writes
    as one string (``1`` and ``"1"``): ``(path of the dict, one key, the other)``, or None.

    ``json.dumps`` writes both, and a reader keeps the last: one value would be lost silently.
    """
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        current, path = stack.pop()
        children: Iterable[tuple[object, object]]
        if isinstance(current, dict):
            seen: dict[str, object] = {}
            for key in current:
                first = seen.setdefault(_json_key(key), key)
                if first is not key:
                    return path, first, key
            children = current.items()
        elif isinstance(current, (list, tuple)):
            children = enumerate(current)
        else:
            continue
        stack.extend(
            (child, f"{path}[{key!r}]")
            for key, child in children
            if isinstance(child, (dict, list, tuple))
        )
    return None


def _check_keys(what: str, values: Mapping[str, object]) -> None:
    """Raises ``InvalidMetadataError`` naming the key path of two dict keys that JSON would
    write as one string (see ``_colliding_keys``)."""
    for key, value in values.items():
        found = _colliding_keys(value)
        if found is not None:
            path, first, second = found
            raise InvalidMetadataError(
                f"{what} {key!r}: the dict at {key}{path} has keys {first!r} and {second!r}, "
                f"which JSON writes as the same string {_json_key(second)!r} (one value would be "
                "lost); use distinct string keys"
            )


def check_json(what: str, values: Mapping[str, object]) -> None:
    """Raises ``InvalidMetadataError`` naming the first key of ``values`` that JSON cannot hold,
    whose value is nested more than ``MAX_JSON_DEPTH`` levels deep, or holds a dict two of whose
    keys JSON writes as one string (``1`` and ``"1"``, ``True`` and ``"true"``).

    Args:
        what: what the values are, for the message (``"metadata"``...).
    """
    try:
        json.dumps(values)
    except (TypeError, ValueError, RecursionError):
        pass
    else:
        for key, value in values.items():
            if _nested_deeper(value, MAX_JSON_DEPTH):
                raise _too_deep(what, key, value)
        _check_keys(what, values)
        return
    for key, value in values.items():
        try:
            json.dumps(value)
        except RecursionError:
            raise _too_deep(what, key, value) from None
        except (TypeError, ValueError) as e:
            raise InvalidMetadataError(
                f"{what} {key!r} = {_short_repr(value)} is not JSON-serialisable "
                f"({type(value).__name__}: {e})"
            ) from None
        if _nested_deeper(value, MAX_JSON_DEPTH):
            raise _too_deep(what, key, value)
    raise InvalidMetadataError(f"{what} is not JSON-serialisable: {_short_repr(values)}")


def check_artifact_metadata(name: str, metadata: object) -> None:
    """Raises unless ``metadata`` of artifact ``name`` is a mapping JSON can hold.

    Raises:
        TypeError: ``metadata`` is not a mapping (names the artifact and the value).
        InvalidMetadataError: a value is not JSON-serialisable (names the artifact and the key).
    """
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"artifact {name!r}: metadata must be a mapping of names to values (or None), "
            f"got {type(metadata).__name__} {_short_repr(metadata)}"
        )
    check_json(f"metadata of artifact {name!r},", dict(metadata))


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as e:  # an int past the digit limit, a repr that raises: still name the key
        return f"<{type(value).__name__}: repr failed: {e}>"[:80]
    return text if len(text) <= 80 else text[:77] + "..."


def _entry_point_factory(name: str) -> tuple[str, Any] | None:
    """The ``(group, entry point)`` named ``name`` in the tracker groups, or None."""
    from importlib.metadata import entry_points

    for group in ENTRY_POINT_GROUPS:
        for ep in entry_points(group=group):
            if ep.name == name:
                return group, ep
    return None


def load_tracker_factory(name: str, factory: str | None = None) -> TrackerFactory:
    """The factory of tracker ``name``: a builtin, an entry point, or ``module:factory``.

    Args:
        name: the tracker's name (a key of ``[torchx:tracker]``).
        factory: what to resolve instead of ``name`` (the key's value), if any.

    Raises:
        UnknownTrackerError: nothing of that name, or its module does not import (names both).
    """
    target = factory or name
    spec = BUILTIN_TRACKERS.get(target)
    where = "builtin"
    loaded: Any = None
    if spec is None:
        found = _entry_point_factory(target)
        if found is not None:
            group, ep = found
            where = f"entry point {ep.value!r} of group {group!r}"
            try:
                loaded = ep.load()
            except Exception as e:
                raise UnknownTrackerError(
                    f"tracker {name!r}: its {where} does not load: {type(e).__name__}: {e}"
                ) from e
        elif ":" in target:
            spec, where = target, "module:factory"
        else:
            raise UnknownTrackerError(
                f"unknown tracker {target!r}"
                + (f" (of tracker {name!r})" if target != name else "")
                + ": not a builtin ("
                + ", ".join(sorted(k for k in BUILTIN_TRACKERS if ":" not in k))
                + "), not an entry point of "
                + " or ".join(repr(g) for g in ENTRY_POINT_GROUPS)
                + ", and not a 'module:factory'"
            )
    if loaded is None:
        assert spec is not None
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise UnknownTrackerError(
                f"tracker {name!r}: factory {spec!r} cannot be imported: {type(e).__name__}: {e}"
            ) from e
        loaded = module
        for part in attr.split(".") if attr else []:
            loaded = getattr(loaded, part, None)
            if loaded is None:
                raise UnknownTrackerError(
                    f"tracker {name!r}: module {module_name!r} has no attribute {attr!r}"
                )
    if not callable(loaded):
        raise UnknownTrackerError(
            f"tracker {name!r}: {where} {target!r} is a {type(loaded).__name__}, not a factory"
        )
    return loaded  # type: ignore[no-any-return]


def build_tracker(name: str, config: str | None, factory: str | None = None) -> TrackerBase:
    """Creates tracker ``name`` with ``config`` (see ``load_tracker_factory``).

    Raises:
        UnknownTrackerError: the factory cannot be found or imported.
        TrackerConfigError: the factory rejected its config (the message names the tracker).
        TrackerError: the factory failed otherwise.
    """
    fn = load_tracker_factory(name, factory)
    try:
        tracker = fn(config)
    except TrackerConfigError as e:
        raise TrackerConfigError(f"tracker {name!r}: {e}") from e
    except Exception as e:
        raise TrackerError(
            f"tracker {name!r}: creating it with config {config!r} failed: {type(e).__name__}: {e}"
        ) from e
    for method in ("add_metadata", "add_artifact", "add_source"):
        if not callable(getattr(tracker, method, None)):
            raise TrackerError(
                f"tracker {name!r}: its factory returned {type(tracker).__name__}, "
                f"which has no {method}() (a TrackerBase is expected)"
            )
    return tracker


def build_trackers(
    factory_and_config: Mapping[str, str | None],
    factories: Mapping[str, str] | None = None,
) -> list[TrackerBase]:
    """Creates each tracker of ``{name: config}`` (TorchX's function; errors are raised, not logged).

    Args:
        factory_and_config: tracker name -> config string or None.
        factories: tracker name -> factory to resolve instead of the name.
    """
    return [
        build_tracker(name, config, (factories or {}).get(name))
        for name, config in factory_and_config.items()
    ]


def tracker_names_from_environ(environ: Mapping[str, str] | None = None) -> list[str]:
    """The names in ``TORCHX_TRACKERS`` (empty when unset), each once, in first-seen order: a name
    given twice is one tracker (TorchX builds a dict of them), not two recording every call."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_TORCHX_TRACKERS, "")
    return list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))


def _named_trackers_from_environ(
    environ: Mapping[str, str] | None = None,
) -> list[tuple[str, TrackerBase]]:
    env = os.environ if environ is None else environ
    named = []
    for name in tracker_names_from_environ(env):
        config = env.get(tracker_config_env_var_name(name))
        factory = env.get(tracker_factory_env_var_name(name)) or None
        named.append((name, build_tracker(name, config, factory)))
    return named


def _check_storable(job_id: str, named: list[tuple[str, TrackerBase]]) -> None:
    """Raises ``TrackerError`` when a file tracker of ``named`` cannot store run ``job_id``: the
    job fails before training starts, not at its first ``add_metadata``."""
    if not named:
        return
    from asynctorchx.tracker.backend.fsspec import FsspecTracker, encode_run_id

    for name, tracker in named:
        if isinstance(tracker, FsspecTracker):
            try:
                encode_run_id(job_id)
            except TrackerError as e:
                raise TrackerError(
                    f"tracker {name!r} cannot record this job ({ENV_TORCHX_JOB_ID}): {e}"
                ) from None


def trackers_from_environ() -> list[TrackerBase]:
    """The trackers named by ``TORCHX_TRACKERS``, each built with its ``..._CONFIG`` (TorchX's)."""
    return [t for _, t in _named_trackers_from_environ()]


class AppRun:
    """The run of this job, as the job reports it: every call goes to every configured tracker.

    Args:
        id: the run id (the app handle, from ``TORCHX_JOB_ID``).
        backends: the trackers to write to.
        parent_run_id: the run this one belongs to, if any.
        names: a name per backend, for error messages (default: their class names).
    """

    def __init__(
        self,
        id: str,
        backends: Iterable[TrackerBase],
        parent_run_id: str | None = None,
        names: Iterable[str] | None = None,
    ) -> None:
        self.id = id
        self.backends = list(backends)
        self._parent_run_id = parent_run_id
        given = list(names) if names is not None else []
        self._names = [
            given[i] if i < len(given) else type(b).__name__ for i, b in enumerate(self.backends)
        ]

    @staticmethod
    @lru_cache(maxsize=1)
    def run_from_env() -> AppRun:
        """The run of this process, from the environment the launcher set (a singleton).

        Not launched as a job (no ``TORCHX_JOB_ID``): the run id is ``<UNDEFINED>``. No trackers
        configured: the ``add_*`` methods do nothing. With ``TORCHX_PARENT_RUN_ID``, every tracker
        records the parent as the run's source at once (so the run is listed under its parent).

        Raises:
            UnknownTrackerError: a configured tracker cannot be found or imported.
            TrackerConfigError: a tracker's config cannot be read.
            TrackerError: a tracker cannot store the job id (too long for the file tracker).
            TrackerWriteError: recording the parent failed.
        """
        job_id = os.environ.get(ENV_TORCHX_JOB_ID) or UNDEFINED_JOB_ID
        named = _named_trackers_from_environ()
        _check_storable(job_id, named)
        parent = os.environ.get(ENV_TORCHX_PARENT_RUN_ID) or None
        run = AppRun(job_id, [t for _, t in named], parent, [n for n, _ in named])
        if parent is not None:
            logger.info("tracker parent run id: %r", parent)
            run._each("recording the parent run", lambda b: b.add_source(job_id, parent, None))
        return run

    def _each(self, what: str, call: Callable[[TrackerBase], object]) -> None:
        failures: list[tuple[str, BaseException]] = []
        for name, backend in zip(self._names, self.backends, strict=True):
            try:
                call(backend)
            except Exception as e:
                logger.error("tracker %r: %s of run %r failed: %s", name, what, self.id, e)
                failures.append((name, e))
        if failures:
            raise TrackerWriteError(what, self.id, failures) from failures[0][1]

    def add_metadata(self, **kwargs: object) -> None:
        """Records metadata of this run (a later value of a key replaces an earlier one).

        Raises:
            InvalidMetadataError: a value is not JSON-serialisable (nothing is recorded).
            TrackerWriteError: a tracker failed (the others recorded the metadata).
        """
        check_json("metadata", kwargs)
        self._each("adding metadata", lambda b: b.add_metadata(self.id, **kwargs))

    def add_artifact(
        self, name: str, path: str, metadata: Mapping[str, object] | None = None
    ) -> None:
        """Records an artifact of this run.

        Args:
            name: the artifact's name.
            path: where it is (a path or URL, stored as given).
            metadata: anything to record with it (JSON-serialisable).

        Raises:
            TypeError: ``metadata`` is not a mapping.
            InvalidMetadataError: ``metadata`` is not JSON-serialisable.
            TrackerWriteError: a tracker failed (the others recorded the artifact).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"artifact name must be a non-empty string, got {name!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"artifact {name!r}: path must be a string, got {path!r}")
        path = os.fspath(path)
        if metadata is not None:
            check_artifact_metadata(name, metadata)
        self._each(
            f"adding artifact {name!r}", lambda b: b.add_artifact(self.id, name, path, metadata)
        )

    def job_id(self) -> str:
        """The id of this run."""
        return self.id

    def parent_run_id(self) -> str | None:
        """The run this one belongs to (``TORCHX_PARENT_RUN_ID``), or None."""
        return self._parent_run_id

    def add_source(self, source_id: str, artifact_name: str | None = None) -> None:
        """Links this run to a source: another run or an external entity (an experiment...).

        Raises:
            TrackerWriteError: a tracker failed (the others recorded the source).
        """
        if not isinstance(source_id, str) or not source_id:
            raise ValueError(f"source id must be a non-empty string, got {source_id!r}")
        self._each(
            f"adding source {source_id!r}",
            lambda b: b.add_source(self.id, source_id, artifact_name),
        )

    def sources(self) -> list[AppRunTrackableSource]:
        """The sources of this run, read from the first tracker (TorchX's behaviour)."""
        if not self.backends:
            return []
        return [
            AppRunTrackableSource(AppRun(s.source_run_id, self.backends), s.artifact_name)
            for s in self.backends[0].sources(self.id)
        ]

    def __repr__(self) -> str:
        return f"AppRun(id={self.id!r}, backends={self._names!r})"


def app_run_from_env() -> AppRun:
    """The run of this job (``AppRun.run_from_env()``): report metadata and artifacts through it."""
    return AppRun.run_from_env()
