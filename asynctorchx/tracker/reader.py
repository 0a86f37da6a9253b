"""The async reader of tracked runs, for sweep drivers and services.

``AsyncTrackerReader`` wraps any ``TrackerBase``: every call of the (synchronous) tracker runs in a
worker thread, never on the event loop. ``watch_metadata`` follows the metadata of many runs at once:

- on a local file tracker (``asynctorchx.tracker.backend.fsspec`` with ``protocol=file``) through
  inotify: one watch on the root (new runs), and per run one on its directory and one on its
  ``metadata`` directory; an idle reader costs nothing, and an ``add_metadata`` wakes it at once.
  Only the runs that changed are read, in one worker-thread call per wake-up. A directory moved
  away or removed is watched again at its path. An entry that cannot be read (not JSON, a FIFO)
  is skipped until its file changes, a file whose name is not an entry name is skipped, and a
  run that cannot be scanned is scanned again, each with one warning: none ends the watch of the
  other runs. With ``parent_run_id``, a run not (yet) a child is looked at again when its
  ``sources`` change: a run may record its parent after its first metadata;
- where inotify is unavailable (another OS, the watch limit reached, ``ASYNCTORCHX_DISABLE_INOTIFY=1``,
  a remote fsspec file system): one scan of the watched runs every ``poll_interval`` seconds (on a
  local disk, a run whose ``metadata`` directory did not change is not listed);
- on any other tracker: its merged metadata, read every ``poll_interval`` seconds.

A file tracker's run whose directory is removed, or replaced (another inode, or entries already
yielded gone: a trial relaunched under its id), is followed anew: what it had is forgotten, and
its merged metadata is that of the directory now there, as ``metadata()`` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from asynctorchx.tracker.api import (
    TrackerArtifact,
    TrackerBase,
    TrackerError,
    TrackerSource,
    UnknownRunError,
    build_tracker,
)
from asynctorchx.tracker.backend.fsspec import (
    METADATA,
    SOURCES,
    FileSignature,
    FsspecTracker,
    Skipped,
    create,
    decode_run_id,
    encode_run_id,
    entry_sort_key,
    entry_timestamp,
    is_entry_name,
    is_storable_run_id,
)

logger = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class MetadataUpdate:
    """New metadata of a run, as ``AsyncTrackerReader.watch_metadata`` yields it.

    Args:
        run_id: the run.
        entry: what was recorded (one ``add_metadata`` call on a file tracker; the changed keys on
            other trackers).
        metadata: all of the run's metadata so far, merged (later values win).
        timestamp: when the entry was written (seconds since the epoch), when the tracker knows.
    """

    run_id: str
    entry: Mapping[str, object]
    metadata: Mapping[str, object]
    timestamp: float | None = None


class AsyncTrackerReader:
    """Reads runs of a tracker from async code: ``async with AsyncTrackerReader(tracker) as r:``.

    Args:
        tracker: the tracker to read (``FsspecTracker`` gets file-system notification).
        poll_interval: seconds between scans when changes cannot be pushed.
    """

    def __init__(self, tracker: TrackerBase, *, poll_interval: float = DEFAULT_POLL_INTERVAL):
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be a positive number, got {poll_interval!r}")
        self._tracker = tracker
        self._poll_interval = float(poll_interval)
        self._closed = False
        self._followers: set[Any] = set()

    @classmethod
    def from_root(
        cls, root: str | os.PathLike[str], *, poll_interval: float = DEFAULT_POLL_INTERVAL
    ) -> AsyncTrackerReader:
        """A reader of the file tracker whose runs are in the local directory ``root``.

        Checks that ``root`` exists (one ``stat``, on the calling thread).

        Raises:
            TrackerConfigError: ``root`` is not an existing directory.
        """
        return cls(FsspecTracker(None, root), poll_interval=poll_interval)

    @classmethod
    def from_config(
        cls,
        config: str,
        name: str = "fsspec",
        *,
        factory: str | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
    ) -> AsyncTrackerReader:
        """A reader of tracker ``name`` built with ``config`` as a job would build it.

        The factory runs on the calling thread (the fsspec tracker reads its small config file);
        build readers once, not per request.

        Raises:
            UnknownTrackerError, TrackerConfigError, TrackerError: see ``build_tracker``.
        """
        if name == "fsspec" and factory is None:
            return cls(create(config), poll_interval=poll_interval)
        return cls(build_tracker(name, config, factory), poll_interval=poll_interval)

    @property
    def tracker(self) -> TrackerBase:
        """The tracker read."""
        return self._tracker

    async def __aenter__(self) -> AsyncTrackerReader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the reader: active ``watch_metadata`` iterations end with RuntimeError, and so do
        later calls. Idempotent."""
        self._closed = True
        for follower in self._followers:
            follower.wake.set()

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("the tracker reader is closed")

    async def _call(self, fn: Any, *args: Any) -> Any:
        self._check()
        return await anyio.to_thread.run_sync(fn, *args)

    # -- one-shot queries -----------------------------------------------------------------------

    async def run_ids(self, **filters: str) -> list[str]:
        """The runs of the tracker; ``parent_run_id=ID`` keeps the children of run ``ID``.

        Raises:
            TypeError: a filter the tracker does not know.
        """
        return list(await self._call(lambda: list(self._tracker.run_ids(**filters))))

    def _exists(self, run_id: str) -> bool:
        if isinstance(self._tracker, FsspecTracker):
            return self._tracker.exists(run_id)
        return run_id in set(self._tracker.run_ids())

    async def exists(self, run_id: str) -> bool:
        """True when the tracker has run ``run_id``."""
        return bool(await self._call(self._exists, run_id))

    def _known(self, run_id: str) -> None:
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run id must be a non-empty string, got {run_id!r}")
        if not self._exists(run_id):
            raise UnknownRunError(run_id, repr(self._tracker))

    async def _read(self, run_id: str, read: Any) -> Any:
        def known_then_read() -> Any:
            self._known(run_id)
            return read()

        return await self._call(known_then_read)

    async def metadata(self, run_id: str) -> dict[str, object]:
        """The run's metadata, merged (later values win).

        Raises:
            UnknownRunError: the tracker has no such run.
        """
        return dict(await self._read(run_id, lambda: self._tracker.metadata(run_id)))

    async def artifacts(self, run_id: str) -> dict[str, TrackerArtifact]:
        """The run's artifacts by name.

        Raises:
            UnknownRunError: the tracker has no such run.
        """
        return dict(await self._read(run_id, lambda: self._tracker.artifacts(run_id)))

    async def sources(self, run_id: str, artifact_name: str | None = None) -> list[TrackerSource]:
        """The run's sources (its parent run among them), optionally of one artifact only.

        Raises:
            UnknownRunError: the tracker has no such run.
        """
        return list(
            await self._read(run_id, lambda: list(self._tracker.sources(run_id, artifact_name)))
        )

    # -- following ------------------------------------------------------------------------------

    async def watch_metadata(
        self,
        run_ids: Iterable[str] | None = None,
        *,
        parent_run_id: str | None = None,
    ) -> AsyncGenerator[MetadataUpdate, None]:
        """Yields the metadata of many runs as it is recorded, until the caller stops iterating.

        What the runs already have is yielded first; runs that do not exist yet are picked up when
        they appear (a trial just launched). Use ``contextlib.aclosing`` (or ``break``) to stop.

        Args:
            run_ids: the runs to follow.
            parent_run_id: follow the children of this run, including those that appear later.
                With neither argument, every run of the tracker is followed.

        Raises:
            ValueError: both arguments given, or an empty run id or ``parent_run_id``.
        """
        self._check()
        fixed = None if run_ids is None else list(dict.fromkeys(run_ids))
        if fixed is not None and parent_run_id is not None:
            raise ValueError("give run_ids or parent_run_id, not both")
        if parent_run_id is not None and (not isinstance(parent_run_id, str) or not parent_run_id):
            raise ValueError(f"parent_run_id must be a non-empty string, got {parent_run_id!r}")
        for r in fixed or ():
            if not isinstance(r, str) or not r:
                raise ValueError(f"run id must be a non-empty string, got {r!r}")
        if isinstance(self._tracker, FsspecTracker):
            follower: Any = _FileFollower(self, self._tracker, fixed, parent_run_id)
        else:
            follower = _PollingFollower(self, fixed, parent_run_id)
        self._followers.add(follower)
        try:
            async with contextlib.aclosing(follower.updates()) as updates:
                async for update in updates:
                    yield update
        finally:
            self._followers.discard(follower)


class _PollingFollower:
    """Follows a tracker that can only be asked for merged metadata."""

    def __init__(
        self, reader: AsyncTrackerReader, fixed: list[str] | None, parent: str | None
    ) -> None:
        self.reader = reader
        self.fixed = fixed
        self.parent = parent
        self.last: dict[str, dict[str, object]] = {}
        self.wake = asyncio.Event()

    def _round(self) -> list[MetadataUpdate]:
        tracker = self.reader.tracker
        if self.fixed is not None:
            runs = self.fixed
        elif self.parent is not None:
            runs = list(tracker.run_ids(parent_run_id=self.parent))
        else:
            runs = list(tracker.run_ids())
        out = []
        for run_id in runs:
            try:
                current = dict(tracker.metadata(run_id))
            except UnknownRunError:
                continue  # not created yet: picked up when it appears
            before = self.last.get(run_id, {})
            changed = {k: v for k, v in current.items() if k not in before or before[k] != v}
            if changed:
                self.last[run_id] = current
                out.append(MetadataUpdate(run_id, changed, dict(current), None))
        return out

    async def updates(self) -> AsyncGenerator[MetadataUpdate, None]:
        while True:
            for update in await self.reader._call(self._round):
                yield update
            with anyio.move_on_after(self.reader._poll_interval):
                await self.wake.wait()


@dataclass
class _Run:
    """What a file follower knows of one run directory."""

    name: str
    run_id: str
    confirmed: bool
    #: entries yielded, and files that are not entries (each logged once)
    seen: set[str] = field(default_factory=set)
    #: entries that could not be read, with their file's signature then (None: unknown): read
    #: again once the file changes (a copy landing piece by piece, a file restored)
    skipped: dict[str, FileSignature | None] = field(default_factory=dict)
    merged: dict[str, object] = field(default_factory=dict)
    #: the sort key of the entry each key of ``merged`` is from
    merged_from: dict[str, tuple[int, str]] = field(default_factory=dict)
    metadata_mtime: int | None = None
    #: the inode of the run's directory at the last scan (None: not seen, or a remote store)
    dir_inode: int | None = None
    watches: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def forget(self, confirmed: bool) -> None:
        """Forgets what was read of the run: its directory is gone or was replaced, and what is
        there now (a trial launched again under its id) is followed as a new run."""
        self.seen.clear()
        self.skipped.clear()
        self.merged.clear()
        self.merged_from.clear()
        self.metadata_mtime = None
        self.dir_inode = None
        self.confirmed = confirmed

    def merge(self, entry_name: str, values: Mapping[str, object]) -> None:
        """Merges an entry's values as ``FsspecTracker.metadata`` does: in the order of entry
        names, whatever the order they arrived in (two hosts' clocks differ; a writer can be
        pre-empted between taking its name and linking the file). A key keeps the value of the
        entry of greatest name that has it."""
        key = entry_sort_key(entry_name)
        for k, v in values.items():
            if self.merged_from.get(k, key) <= key:
                self.merged[k] = v
                self.merged_from[k] = key


@dataclass
class _Scan:
    name: str
    run_dir: bool
    metadata_dir: bool
    sources_dir: bool
    confirmed: bool
    metadata_mtime: int | None
    entries: list[tuple[str, Mapping[str, Any]]]
    #: entries that could not be read, with their file's signature before the read (logged once)
    skipped: dict[str, FileSignature | None] = field(default_factory=dict)
    #: files that are not entries (logged once), and skipped entries that are gone
    ignored: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    #: the names of the files of ``metadata`` (those seen before when it was not listed)
    listed: frozenset[str] = frozenset()
    #: why the run could not be scanned (it is scanned again at the next change or interval)
    error: str | None = None
    #: the inode of the run's directory (None: gone, or a remote store)
    dir_inode: int | None = None
    #: the directory was replaced, or lost entries already yielded, since the last scan: what
    #: the run had is forgotten, and the scan read it from its start
    replaced: bool = False


@dataclass(frozen=True)
class _Known:
    """What a scan of a run starts from (a copy: the scan runs in a worker thread)."""

    seen: frozenset[str]
    skipped: Mapping[str, FileSignature | None]
    confirmed: bool
    metadata_mtime: int | None
    dir_inode: int | None = None


#: A watched directory moved away or removed: its watch follows the old inode, not the path.
_SELF_MASK_NAMES = ("IN_MOVE_SELF", "IN_DELETE_SELF", "IN_IGNORED")
_DIR_MASK_NAMES = ("IN_CREATE", "IN_MOVED_TO", "IN_MOVE_SELF", "IN_DELETE_SELF", "IN_ONLYDIR")
_FILE_MASK_NAMES = (
    "IN_CREATE",
    "IN_MOVED_TO",
    "IN_CLOSE_WRITE",
    "IN_MOVE_SELF",
    "IN_DELETE_SELF",
    "IN_ONLYDIR",
)


class _FileFollower:
    """Follows the runs of a file tracker: inotify where it can, one scan per interval otherwise."""

    def __init__(
        self,
        reader: AsyncTrackerReader,
        tracker: FsspecTracker,
        fixed: list[str] | None,
        parent: str | None,
    ) -> None:
        self.reader = reader
        self.tracker = tracker
        # A run id too long to be stored is a run that never appears (and has no children: the
        # name looked for cannot exist).
        self.parent_name = None if parent is None else encode_run_id(parent, check_length=False)
        self.fixed = (
            None if fixed is None else {encode_run_id(r): r for r in fixed if is_storable_run_id(r)}
        )
        self.runs: dict[str, _Run] = {}
        self.dirty: set[str] = set()
        self.root_dirty = True
        self.overflow = False
        self.wake = asyncio.Event()
        self.root_watch: Any = None
        self.inotify: Any = None
        self.unwatched = True  # something is not covered by a watch: scan it every interval

    # -- inotify ------------------------------------------------------------------------------

    def _mask(self, names: tuple[str, ...]) -> int:
        mask = 0
        for n in names:
            mask |= getattr(self.inotify, n)
        return int(mask)

    def _watch(self, path: str, names: tuple[str, ...], on_event: Any) -> Any:
        """A watch of ``path``; None when inotify refused it (the limit of watches...).

        Raises:
            FileNotFoundError: ``path`` went away.
        """
        if self.inotify is None:
            return None
        return self.inotify.watch(path, on_event, self._mask(names))

    def _on_overflow(self) -> None:
        self.overflow = True
        self.root_dirty = True
        self.dirty.update(self.runs)
        self.wake.set()

    def _on_root(self, name: str, mask: int) -> None:
        if mask & self.inotify.IN_Q_OVERFLOW:
            self._on_overflow()
            return
        if not name:  # the root itself went away (or moved): watch the path again, or scan it
            if mask & self._mask(_SELF_MASK_NAMES) and self.root_watch is not None:
                self.root_watch.cancel()  # (kept active, it would follow the moved directory)
                for run in self.runs.values():  # their directories moved or went with it
                    self._drop_watches(run)
            self.root_dirty = True
            self.wake.set()
            return
        if self.fixed is not None and name not in self.fixed:
            return
        self.dirty.add(name)
        self.wake.set()

    def _drop_watches(self, run: _Run) -> None:
        for w in run.watches.values():
            w.cancel()
        run.watches.clear()
        run.metadata_mtime = None

    def _on_run(self, name: str) -> Any:
        def on_event(child: str, mask: int) -> None:
            if mask & self.inotify.IN_Q_OVERFLOW:
                self._on_overflow()
                return
            run = self.runs.get(name)
            if not child and mask & self._mask(_SELF_MASK_NAMES) and run is not None:
                # The run's directory (or its metadata directory) moved away or was removed: the
                # next scan watches what is at its path now.
                self._drop_watches(run)
            self.dirty.add(name)
            self.wake.set()

        return on_event

    def _update_watches(self, run: _Run, scan: _Scan) -> bool:
        """Adds the watches a run's directories now allow; True when one was added."""
        if self.inotify is None:
            return False
        added = False
        run_dir = self.tracker.run_dir(run.run_id)
        wanted: dict[str, tuple[str, tuple[str, ...], bool]] = {
            "": (run_dir, _DIR_MASK_NAMES, scan.run_dir)
        }
        if run.confirmed:
            wanted[METADATA] = (
                self.tracker.category_dir(run.run_id, METADATA),
                _FILE_MASK_NAMES,
                scan.metadata_dir,
            )
        elif scan.sources_dir:
            wanted[SOURCES] = (
                self.tracker.category_dir(run.run_id, SOURCES),
                _FILE_MASK_NAMES,
                True,
            )
        for key in [k for k in run.watches if k not in wanted]:
            run.watches.pop(key).cancel()
        for key, (path, names, present) in wanted.items():
            current = run.watches.get(key)
            if current is not None and current.active:
                continue
            if not present:
                continue  # the watch of its parent directory reports its creation
            try:
                w = self._watch(path, names, self._on_run(run.name))
            except FileNotFoundError:
                added = True  # gone again: scan once more to see what happened
                continue
            if w is None:
                self.unwatched = True
                continue
            run.watches[key] = w
            added = True
        return added

    def _watch_root(self) -> None:
        """Watches the root unless a watch of it is active: at the start, and again after the
        root was removed (until it exists again, the root is scanned every interval)."""
        if self.inotify is None or (self.root_watch is not None and self.root_watch.active):
            return
        lost = self.root_watch is not None
        self.root_watch = None
        with contextlib.suppress(FileNotFoundError):
            self.root_watch = self._watch(self.tracker.root, _DIR_MASK_NAMES, self._on_root)
        if lost or self.root_watch is not None:
            self._on_overflow()  # what happened before the watch was not reported: look again

    # -- scanning (in a worker thread) --------------------------------------------------------

    def _scan_root(self) -> list[str]:
        names = [n for n, is_dir in self.tracker._fs.listdir(self.tracker.root) if is_dir]
        return [n for n in names if decode_run_id(n) is not None]

    def _is_child(self, run_id: str) -> bool:
        """True when the run has the watched parent among its sources (one ``exists``)."""
        assert self.parent_name is not None
        fs = self.tracker._fs
        return fs.exists(fs.join(self.tracker.category_dir(run_id, SOURCES), self.parent_name))

    def _run_dir_inode(self, run_dir: str) -> tuple[bool, int | None]:
        """Whether the run's directory exists, and its inode on a local path."""
        fs = self.tracker._fs
        if not fs.isdir(run_dir):
            return False, None
        signature = fs.signature(run_dir)  # (None on a remote store)
        return True, None if signature is None else signature[0]

    def _scan_run(self, name: str, run_id: str, known: _Known) -> _Scan:
        run_dir = self.tracker.run_dir(run_id)
        present, inode = self._run_dir_inode(run_dir)
        if not present:
            return _Scan(name, False, False, False, False, None, [])
        if known.dir_inode is not None and inode != known.dir_inode:
            # Removed and made again between two scans (a trial launched again under its id):
            # nothing of the old directory counts.
            scan = self._scan_run(name, run_id, self._fresh(inode))
            scan.replaced = True
            return scan
        scan = self._scan_present(name, run_id, known)
        scan.dir_inode = inode
        if scan.confirmed and not known.seen <= scan.listed:
            # Entries already yielded are gone (the directory replaced where its inode number
            # was reused, or on a remote store): read the run again from its start, as
            # ``metadata()`` would.
            scan = self._scan_run(name, run_id, self._fresh(inode))
            scan.replaced = True
        return scan

    def _fresh(self, inode: int | None) -> _Known:
        """What a scan of a run never seen starts from."""
        return _Known(frozenset(), {}, self.parent_name is None, None, inode)

    def _scan_present(self, name: str, run_id: str, known: _Known) -> _Scan:
        fs = self.tracker._fs
        sources_dir = fs.isdir(self.tracker.category_dir(run_id, SOURCES))
        if not known.confirmed and self.parent_name is not None and not self._is_child(run_id):
            # Not a child (yet): a run may record its parent after other sources or metadata.
            # Its sources directory is watched (or it is looked at every interval).
            return _Scan(name, True, False, sources_dir, False, None, [])
        metadata_dir = self.tracker.category_dir(run_id, METADATA)
        new_mtime: int | None = None
        if fs.local:
            try:
                st = os.stat(metadata_dir)
            except FileNotFoundError:
                return _Scan(name, True, False, sources_dir, True, None, [])
            mtime = known.metadata_mtime
            if mtime is not None and st.st_mtime_ns == mtime and not known.skipped:
                return _Scan(name, True, True, sources_dir, True, mtime, [], listed=known.seen)
            # Time stamps are coarse (a clock tick): an entry added in the same tick as the listing
            # below would leave the mtime as it is. Only an mtime a second old is trusted.
            recent = time.time_ns() - st.st_mtime_ns < 1_000_000_000
            new_mtime = None if recent else st.st_mtime_ns
        scan = _Scan(name, True, False, sources_dir, True, new_mtime, [])
        names = self.tracker.entry_names(run_id, METADATA)
        scan.listed = frozenset(names)
        for entry_name in names:
            if entry_name not in known.seen:
                self._scan_entry(scan, run_id, entry_name, known)
        scan.metadata_dir = fs.isdir(metadata_dir)
        return scan

    def _scan_entry(self, scan: _Scan, run_id: str, entry_name: str, known: _Known) -> None:
        """Reads one entry not yielded yet into ``scan`` (or notes why it is left out)."""
        if not is_entry_name(entry_name):
            logger.warning(
                "not following a file of run %r: %s is not an entry (entries are named by their "
                "write time, in digits)",
                run_id,
                self.tracker._fs.join(self.tracker.category_dir(run_id, METADATA), entry_name),
            )
            scan.ignored.append(entry_name)
            return
        signature = self.tracker.entry_signature(run_id, METADATA, entry_name)
        if signature is not None and known.skipped.get(entry_name) == signature:
            return  # unchanged since it could not be read
        try:
            entry = self.tracker.read_entry(run_id, METADATA, entry_name)
        except TrackerError as e:
            if entry_name not in known.skipped:
                logger.warning("not following an entry of run %r: %s", run_id, e)
            scan.skipped[entry_name] = signature
            return
        if entry is None:
            scan.metadata_mtime = None  # still being written: look again next time
        elif entry is Skipped.GONE:
            scan.gone.append(entry_name)
        elif isinstance(entry, Skipped):
            scan.skipped[entry_name] = signature  # (read_entry logged it)
        else:
            scan.entries.append((entry_name, entry))

    def _scan_or_error(self, name: str, run_id: str, known: _Known) -> _Scan:
        """``_scan_run``, or a scan holding the error that stopped it: one run's trouble (a
        directory it cannot read...) must not end the watch of the others."""
        try:
            return self._scan_run(name, run_id, known)
        except (TrackerError, OSError) as e:
            return _Scan(name, True, False, False, known.confirmed, None, [], error=str(e))

    def _scan(
        self, scan_root: bool, todo: list[tuple[str, str, _Known]]
    ) -> tuple[list[str] | None, list[_Scan]]:
        roots = self._scan_root() if scan_root else None
        return roots, [self._scan_or_error(*args) for args in todo]

    # -- the loop -----------------------------------------------------------------------------

    def _run_for(self, name: str) -> _Run | None:
        run = self.runs.get(name)
        if run is not None:
            return run
        run_id = self.fixed.get(name) if self.fixed is not None else decode_run_id(name)
        if run_id is None:
            return None
        run = _Run(name, run_id, confirmed=self.parent_name is None)
        self.runs[name] = run
        return run

    @staticmethod
    def _known(run: _Run) -> _Known:
        return _Known(
            frozenset(run.seen), dict(run.skipped), run.confirmed, run.metadata_mtime, run.dir_inode
        )

    def _apply(self, run: _Run, scan: _Scan) -> None:
        """Records what a scan of ``run`` found (but its entries, which the caller yields)."""
        if scan.replaced or not scan.run_dir:
            self._drop_watches(run)  # (those of a replaced directory follow the old one)
            run.forget(confirmed=self.parent_name is None)
        run.dir_inode = scan.dir_inode
        run.seen.update(scan.ignored)
        run.seen.update(name for name, _ in scan.entries)
        run.skipped.update(scan.skipped)
        for name in [*scan.gone, *(name for name, _ in scan.entries)]:
            run.skipped.pop(name, None)
        run.confirmed = run.confirmed or scan.confirmed
        run.metadata_mtime = scan.metadata_mtime
        if self._update_watches(run, scan):
            self.dirty.add(run.name)  # what arrived before the watch existed

    async def updates(self) -> AsyncGenerator[MetadataUpdate, None]:
        if self.tracker.is_local:
            from asynctorchx.logs import _inotify

            if _inotify.available():
                self.inotify = _inotify
        try:
            if self.fixed is not None:
                for name in self.fixed:
                    self._run_for(name)
                self.dirty.update(self.fixed)
                self.root_dirty = False
            while True:
                self._watch_root()
                polling = self.inotify is None or self.root_watch is None or self.unwatched
                if polling or self.overflow:
                    self.overflow = False
                    self.dirty.update(self.runs)
                    self.root_dirty = self.root_dirty or self.fixed is None
                if self.fixed is None and self.root_watch is None:
                    self.root_dirty = True
                self.unwatched = False
                todo = []
                for name in sorted(self.dirty):
                    run = self._run_for(name)
                    if run is not None:
                        todo.append((name, run.run_id, self._known(run)))
                self.dirty.clear()
                scan_root, self.root_dirty = self.root_dirty, False
                self.wake.clear()
                roots, scans = await self.reader._call(self._scan, scan_root, todo)
                for scan in scans:
                    run = self.runs[scan.name]
                    if scan.error is not None:
                        if scan.error != run.error:
                            logger.warning("cannot follow run %r: %s", run.run_id, scan.error)
                        run.error = scan.error
                        run.metadata_mtime = None
                        self.unwatched = True  # no change may be reported: scan it every interval
                        continue
                    run.error = None
                    self._apply(run, scan)
                    for entry_name, entry in scan.entries:
                        values = dict(entry["metadata"])
                        run.merge(entry_name, values)
                        stamp = entry_timestamp(entry_name)
                        yield MetadataUpdate(run.run_id, values, dict(run.merged), stamp)
                if roots is not None:
                    for name in roots:
                        if name not in self.runs and self._run_for(name) is not None:
                            self.dirty.add(name)
                if self.dirty or self.root_dirty:
                    continue
                if self.inotify is not None and self.root_watch is not None and not self.unwatched:
                    await self.wake.wait()
                else:
                    with anyio.move_on_after(self.reader._poll_interval):
                        await self.wake.wait()
        finally:
            if self.root_watch is not None:
                self.root_watch.cancel()
            for run in self.runs.values():
                for w in run.watches.values():
                    w.cancel()
