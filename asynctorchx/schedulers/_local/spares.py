"""Spare files: empty files made ahead of need, so that writing a new app's first record costs a
hard link of an inode that exists, not the allocation of one. Stdlib-only; every method blocks.

Why: allocating an inode on a local file system is the slowest step of a launch that writes
nothing else. On ext4 without a journal (this machine kind's root) the allocator skips every inode
freed in the last minute, so creating a file costs 0.2-0.6 ms of kernel time for minutes after any
state was removed: 30 of the ~90 ms a burst of 50 instant apps took, all of it after the last spawn
(``run()`` returns once other processes can see the app). Linking an empty spare into place costs
~12 us, and the spares are made while nothing waits for them.

A record is made from a spare by writing its first version into the spare and then linking the
spare to the record's name (``protocol.write_record_file``): the record appears whole, never empty,
and an existing record is never replaced (the link fails; the writer then appends as before).

**Layout.** ``{records_dir}/.spare/{pid}.{start_ticks}.{token}.{n}``: the process that made or
adopted the spare (pid and start time), a token per pool (two schedulers of one state root in one
process keep apart) and a counter. A pool takes only its own spares, since a spare is written before
it is linked; the spares of a process that is gone are adopted, each renamed to the adopter's name
(one atomic rename: one adopter wins), by the next pool that fills, so a state root holds about one
pool's worth of spares however many launchers came and went. A pool whose scheduler closed gives its
spares to the next pool of the same directory in the same process (``release``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import threading
import time

from asynctorchx.schedulers._local.recordfile import pid_alive, proc_start_ticks

SPARE_DIR = ".spare"
#: The spares a pool keeps at first; then as many as it gave out between two fills (the largest
#: burst of new records seen), up to ``MAX_TARGET``.
MIN_TARGET = 64
MAX_TARGET = 1024
#: Spares made per call of ``fill_some`` (a call takes a few milliseconds: a pool that is closed
#: waits for one at most).
CHUNK = 16
#: Spares take at most this share of the free inodes of their file system, and none while fewer
#: than ``MIN_FREE_INODES`` are free: on a small file system the apps' own files come first.
INODE_SHARE = 10
MIN_FREE_INODES = 256

#: The spares of the closed pools of this process, by spare directory: the next pool of the
#: directory in this process takes them first (its owner lives on, so no other process adopts them).
_released: dict[str, list[str]] = {}
_released_lock = threading.Lock()


def _forget_released() -> None:
    """In a forked child: the released spares are the parent's to give (were both to take one, two
    apps' records would be written into one file)."""
    global _released_lock
    _released.clear()
    _released_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_released)


class SparePool:
    """The empty files of one records directory that this pool may use (``take``), and their making
    (``fill_some``, in a worker thread while nothing waits for it).

    Args:
        records_dir: the directory of the app records.
    """

    def __init__(self, records_dir: str) -> None:
        self.directory = os.path.join(records_dir, SPARE_DIR)
        self.target = MIN_TARGET
        self._free: list[str] = []
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._prefix: str | None = None
        self._given = 0  # spares given out (or asked for in vain) since the last fill
        self._scanned = False  # the directory was made and the spares of gone processes adopted

    @property
    def wanted(self) -> int:
        """How many spares the pool lacks."""
        return max(0, self.target - len(self._free))

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> str | None:
        """The path of one of this pool's spares, now the caller's; None when there is none."""
        with self._lock:
            self._given += 1
            return self._free.pop() if self._free else None

    def lost(self) -> None:
        """Forgets every spare: the directory was found removed (the next fill makes it again)."""
        with self._lock:
            self._free.clear()
            self._scanned = False

    def release(self) -> None:
        """Gives this pool's spares up (its scheduler closed) to the next pool of its directory in
        this process. Without it a process that makes and closes schedulers on one state root left
        a pool's worth of spares per scheduler, which nobody adopted while it lived."""
        with self._lock:
            free, self._free = self._free, []
        if free:
            with _released_lock:
                _released.setdefault(self.directory, []).extend(free)

    def fill_some(self, count: int = CHUNK, until: float | None = None) -> int:
        """Makes up to ``count`` of the spares the pool lacks (first taking those released by closed
        pools of this process; the first call makes the directory and adopts the spares of processes
        that are gone), stopping early once ``time.monotonic()`` reaches ``until``; returns how many
        it still lacks.

        Raises:
            OSError: a spare cannot be made (full disk, no permission, the records directory
                removed: ``RecordStore.ensure`` makes it again).
        """
        with self._lock:
            if self._given:
                self.target = max(self.target, min(MAX_TARGET, self._given))
                self._given = 0
        self._take_released()
        if not self._scanned:
            # (not makedirs: the records directory and the state root are the store's to make,
            # private and checked to be this user's; a fill that finds them gone fails)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.directory, 0o700)
            self._adopt()
            self._scanned = True
        prefix = self._own_prefix()
        for _ in range(min(count, self.wanted, _inode_room(self.directory))):
            if until is not None and time.monotonic() >= until:
                break
            path = f"{prefix}{next(self._counter)}"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                self._scanned = False  # the directory was removed: the next fill makes it again
                raise
            os.close(fd)
            with self._lock:
                self._free.append(path)
        return self.wanted

    def _take_released(self) -> None:
        with _released_lock:
            released = _released.get(self.directory)
            if not released:
                return
            with self._lock:
                while released and len(self._free) < self.target:
                    self._free.append(released.pop())
            if not released:
                del _released[self.directory]

    def _own_prefix(self) -> str:
        if self._prefix is None:
            pid = os.getpid()
            token = secrets.token_hex(4)
            self._prefix = os.path.join(self.directory, f"{pid}.{proc_start_ticks(pid)}.{token}.")
        return self._prefix

    def _adopt(self) -> None:
        """Renames the spares of processes that are gone to this pool's names (as many as it
        lacks); spares of unknown shape are left alone."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        prefix = self._own_prefix()
        alive: dict[tuple[int, int | None], bool] = {}
        for name in names:
            if self.wanted == 0:
                return
            owner = _owner(name)
            if owner is None:
                continue
            if owner not in alive:
                alive[owner] = pid_alive(*owner)
            if alive[owner]:
                continue
            path = f"{prefix}{next(self._counter)}"
            with contextlib.suppress(FileNotFoundError):  # adopted by another process meanwhile
                os.rename(os.path.join(self.directory, name), path)
                with self._lock:
                    self._free.append(path)


def _owner(name: str) -> tuple[int, int | None] | None:
    """The (pid, start ticks) a spare's name gives, or None when it is not a spare's name."""
    parts = name.split(".")
    if len(parts) != 4 or not _number(parts[0]) or not _number(parts[3]):
        return None
    ticks = int(parts[1]) if _number(parts[1]) else None
    return int(parts[0]), ticks


def _number(text: str) -> bool:
    """True for ASCII digits only (``str.isdigit`` is also true of superscripts, which int() does
    not take)."""
    return text.isascii() and text.isdigit()


def _inode_room(directory: str) -> int:
    """How many spares ``directory``'s file system has room for (``INODE_SHARE``); unbounded on
    one that counts no inodes (btrfs says 0 of 0)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return MAX_TARGET
    if st.f_files == 0:
        return MAX_TARGET
    return max(0, st.f_favail - MIN_FREE_INODES) // INODE_SHARE
