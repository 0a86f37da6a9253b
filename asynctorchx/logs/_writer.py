"""ReplicaLogWriter: pumps a replica's stdout/stderr pipes into its log files on the event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

from asynctorchx.logs import _notify
from asynctorchx.logs._files import (
    HELD_LINE_WAIT,
    INDEX_FILE,
    INDEX_MAGIC,
    LOG_FILES,
    RECORD,
    RECORD_SIZE,
    STREAM_IDS,
)
from asynctorchx.logs._notify import Wake
from asynctorchx.logs._query import Stream

logger = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
_MAX_BATCH = 1 << 20
_MAX_FINAL = 1 << 26
_FILE_FLAGS = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC  # (read: the last byte)
#: An unterminated line is held back from ``combined.log`` (see ``_Tail``) until it is this long,
_TAIL_MAX = 1 << 16
#: or this old (seconds).
_TAIL_WAIT = HELD_LINE_WAIT


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_counted(fd: int, data: bytes) -> tuple[int, OSError | None]:
    """Writes as much of ``data`` as possible: ``(bytes written, the error that stopped it)``."""
    view = memoryview(data)
    done = 0
    while done < len(data):
        try:
            done += os.write(fd, view[done:])
        except InterruptedError:
            continue
        except OSError as e:
            return done, e
    return done, None


def _close_quietly(fds: list[int]) -> None:
    """Closes the open ones of ``fds`` (-1: not open), ignoring errors."""
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _align_index(fd: int) -> int:
    """Truncates a partly written record (a full disk) of the timing index ``fd`` so later
    records stay aligned; returns its size."""
    size = os.fstat(fd).st_size
    if size < len(INDEX_MAGIC):
        if size:
            os.ftruncate(fd, 0)
        return 0
    aligned = size - (size - len(INDEX_MAGIC)) % RECORD_SIZE
    if aligned != size:
        os.ftruncate(fd, aligned)
    return aligned


def loss_marker(lost: int, reason: str, newline_first: bool) -> bytes:
    """The line that marks where (and how many) bytes of a log file could not be written."""
    line = f"[asynctorchx: {lost} bytes of output could not be written here: {reason}]\n"
    return (b"\n" if newline_first else b"") + line.encode()


class LogFiles:
    """A replica's log directory and files, opened for appending: what a ``ReplicaLogWriter`` takes
    over. Opening them only makes system calls, so it can run in a worker thread (a launch makes
    many at once, off the event loop); ``close`` undoes it when no writer takes them.

    Use ``LogFiles.open``.
    """

    __slots__ = ("fds", "index_fd", "last_ns", "offsets", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: dict[Stream, int] = {}
        self.index_fd = -1
        self.offsets: dict[Stream, int] = {}
        self.last_ns = 0

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> LogFiles:
        """Creates ``directory`` (with its parents) and opens (creates) its log files and timing
        index; a partly written index record is dropped. Blocks; thread-safe.

        Raises:
            OSError: the directory or a file cannot be created or opened for writing.
        """
        self = cls(os.fspath(directory))
        path = self.path
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(path, exist_ok=True)
        try:
            for stream, name in LOG_FILES.items():
                self.fds[stream] = os.open(os.path.join(path, name), _FILE_FLAGS, 0o644)
            self.index_fd = os.open(os.path.join(path, INDEX_FILE), _FILE_FLAGS, 0o644)
            self.offsets = {s: os.fstat(fd).st_size for s, fd in self.fds.items()}
            self.last_ns = self._init_index()
        except BaseException:
            self.close()
            raise
        return self

    def _init_index(self) -> int:
        """Writes the index header, or drops a torn last record; returns the last record's time."""
        path = os.path.join(self.path, INDEX_FILE)
        size = _align_index(self.index_fd)
        if size == 0:
            _write_all(self.index_fd, INDEX_MAGIC)
            return 0
        if size < len(INDEX_MAGIC) + RECORD_SIZE:
            return 0
        with open(path, "rb") as f:
            f.seek(size - RECORD_SIZE)
            record = f.read(RECORD_SIZE)
        if len(record) != RECORD_SIZE:
            return 0
        return int(RECORD.unpack(record)[0])

    def close(self) -> None:
        """Closes the files (when no writer took them over)."""
        _close_quietly([*self.fds.values(), self.index_fd])
        self.fds = {}
        self.index_fd = -1


class _Tail:
    """A stream's unterminated last line, held back from ``combined.log`` (it is in the stream's
    own file already) until its newline comes, so that the other stream's lines never land inside
    it: where it starts in the stream's file, and its chunks with the time each was read (each
    gets its own index record, as if written at once)."""

    __slots__ = ("chunks", "size", "start", "timer")

    def __init__(self, start: int) -> None:
        self.start = start
        self.chunks: list[tuple[int, bytes]] = []
        self.size = 0
        self.timer: asyncio.TimerHandle | None = None

    def add(self, now: int, data: bytes) -> None:
        self.chunks.append((now, data))
        self.size += len(data)


class ReplicaLogWriter:
    """Owns one replica's log files; fed from pipes on the running event loop.

    Every chunk read from an attached pipe is appended to the stream's file at once, and to
    ``combined.log`` in whole lines: a chunk's unterminated last line (a pipe read ends anywhere) is
    held back from ``combined.log`` until its newline comes, its stream ends, it outgrows 64 KiB or
    it has waited 0.2 s (a prompt, a progress bar), so that no line of ``combined.log`` holds bytes
    of both streams; a line given out unterminated is ended by a newline in ``combined.log`` before
    another stream's bytes. Each chunk's record (time read, offsets, length) is appended to the
    timing index before its bytes go to ``combined.log``. ``combined.log`` thus holds both streams
    in arrival order, line by line. (Two pipes carry no timestamps: output written to both streams
    while the loop is busy elsewhere is ordered as it is read, the same for any reader of two
    pipes.) Nothing is dropped: the pipes are read until EOF however much arrives. A writer can be reused for a restarted replica:
    attach the new pipes, output is appended.

    Lazy files (``opener`` given): nothing is created until the first chunk is read, so a replica
    that never writes leaves no directory and no file (readers take a missing directory as no
    output). The first chunk is kept with the time it was read, reading the pipes pauses (the pipe
    buffers hold the output meanwhile, nothing is lost) and ``opener(writer)`` is asked to call
    ``make_files`` (blocking: in a worker thread) and then ``files_made`` on the event loop; the
    kept chunks are then written, timed and ordered as read, and reading resumes. ``close`` while
    the files are being made takes them (or makes them itself, on the calling thread) so that what
    was read is written before it returns. If the files cannot be made (a full disk, a directory
    that cannot be written or was removed), the replica keeps running: the failure is logged once,
    reported to ``on_loss``, and its output is read on and counted in ``lost_bytes`` (never left
    to fill the pipe and block the replica).

    Readers in this process (``iter_log_lines``) are woken after every write; readers in other
    processes through inotify.

    Bytes that cannot be written (a full disk) are counted per file (``lost_bytes``), and the file
    gets a marker line saying how many were lost and why, where they are missing, as soon as it
    can be written again (at the latest when the writer closes). Each file has its own count and
    marker, so ``stdout.log`` and ``combined.log`` never disagree silently.

    Args:
        directory: the replica's log directory (created with its parents).
        on_loss: called (with the reason) the first time bytes are lost.
        files: the directory's files opened already (``LogFiles.open``, e.g. in a worker thread);
            the writer owns them from now on. Opened here when neither they nor ``opener`` are
            given.
        opener: makes the files lazily, on the first output (see above); called on the event loop,
            it must not block.
        on_files: called once, on the event loop, when a lazy writer no longer needs what was set
            aside for its files (file descriptors promised to it): they were made, could not be
            made, or the writer closed without them.
        space_reserve: a file of disk space set aside on the log's file system, removed at close
            when the disk is still full and a file's loss marker cannot be written otherwise (the
            log would end where the disk filled up, with no sign of what was lost).

    Raises:
        OSError: the directory or a file cannot be created or opened for writing.
        ValueError: ``files`` are those of another directory, or both ``files`` and ``opener``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        on_loss: Callable[[str], None] | None = None,
        *,
        files: LogFiles | None = None,
        opener: Callable[[ReplicaLogWriter], None] | None = None,
        on_files: Callable[[], None] | None = None,
        space_reserve: str | None = None,
    ) -> None:
        # a plain string: pathlib's parsing and joins cost more than the system calls here, and a
        # burst of launches creates thousands of writers
        path = self._path = os.fspath(directory)
        if files is not None and opener is not None:
            raise ValueError("a log writer is given its files or an opener, not both")
        if files is None and opener is None:
            files = LogFiles.open(path)
        elif files is not None and files.path != path:
            raise ValueError(f"the log files of {files.path!r} given for {path!r}")
        self._key = _notify.directory_key(path)
        self._files: dict[Stream, int] = {}
        self._index_fd = -1
        self._offsets: dict[Stream, int] = {}
        #: per stream: the latest time recorded, and the end of its last record in its file
        self._stream_ns: dict[Stream, int] = {}
        self._recorded_to: dict[Stream, int] = {}
        self._opener = opener
        #: chunks read before the files exist: (time read, stream, data), in the order read
        # chunks read before the files exist (None: its stream ended there)
        self._held: list[tuple[int, Stream, bytes | None]] = []
        self._opening = False  # the opener was asked; reading is paused until ``files_made``
        self._open_failed = False
        self._open_lock = threading.Lock()  # guards _made and _taken (held briefly)
        self._make_lock = threading.Lock()  # held while a worker thread makes the files
        self._made: LogFiles | BaseException | None = None
        self._taken = False  # what ``make_files`` made (or would make) was taken on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fds: dict[int, Stream] = {}
        self._drained: asyncio.Event | None = None
        self._closed = False
        self._on_loss = on_loss
        self._space_reserve = space_reserve
        self._on_files = on_files if opener is not None else None
        self._lost: dict[Stream, int] = {}
        self._unmarked: dict[Stream, int] = {}
        #: each stream's unterminated last line, not in combined.log yet (see ``_Tail``)
        self._tails: dict[Stream, _Tail] = {}
        #: the stream whose unterminated line ends combined.log (given out by ``_flush_tail``),
        #: and whether that stream has ended
        self._open_line: Stream | None = None
        self._line_ended = False
        self._loss_reason = ""
        #: the error line of a loss is held back (``hold_loss_report``); the loss held, if any
        self._holding_report = False
        self._held_report: OSError | None = None
        _notify.add_writer(self._key, self)
        if files is not None:
            self._taken = True
            self._install(files)
            _notify.wake_key(self._key, Wake.CREATED)

    def _install(self, files: LogFiles) -> None:
        self._files = files.fds
        self._index_fd = files.index_fd
        self._offsets = files.offsets
        for stream in STREAM_IDS:  # (the records already there: this writer's come after them)
            self._stream_ns[stream] = max(self._stream_ns.get(stream, 0), files.last_ns)
        size = self._offsets.get(Stream.COMBINED, 0)
        if size and self._open_line is None:  # another writer's last line was left open
            try:
                last = os.pread(self._files[Stream.COMBINED], 1, size - 1)
            except OSError:
                last = b"\n"
            if last != b"\n":
                self._open_line, self._line_ended = Stream.COMBINED, True

    @property
    def has_files(self) -> bool:
        """True once the log files exist and are open (lazy files: after the first output)."""
        return bool(self._files)

    def make_files(self) -> None:
        """Creates and opens the log directory and files of a lazy writer. Blocks: call it in a
        worker thread (then ``files_made`` on the event loop). Does nothing once ``close`` took
        over; a failure is kept for ``files_made``."""
        with self._make_lock:
            with self._open_lock:
                if self._taken or self._made is not None:
                    return
            # made without ``_open_lock`` held: a ``close`` with nothing to write meanwhile does
            # not wait for the file system (it takes over; what is made here is closed below)
            made: LogFiles | BaseException
            try:
                made = LogFiles.open(self._path)
            except Exception as e:
                made = e
            with self._open_lock:
                if not self._taken:
                    self._made = made
                    return
            if isinstance(made, LogFiles):
                made.close()

    def files_made(self) -> None:
        """On the event loop, after ``make_files``: writes what was read meanwhile and resumes
        reading (or, if the files could not be made, reads on and counts the output lost)."""
        with self._open_lock:
            if self._taken:
                return
            self._taken = True
            made, self._made = self._made, None
        if made is None:  # ``make_files`` did not run (the opener gave up): make them here
            made = self._open_now()
        self._apply(made)
        if not self._closed:
            self._resume()

    def _take_files_now(self) -> None:
        """Makes the files on this thread (``close`` with output to write), or takes what a
        worker thread made (waiting for it if it is making them: never two makers at once)."""
        with self._make_lock, self._open_lock:
            if self._taken:
                return
            self._taken = True
            made, self._made = self._made, None
            if made is None:
                made = self._open_now()
        self._apply(made)

    def _open_now(self) -> LogFiles | BaseException:
        try:
            return LogFiles.open(self._path)
        except Exception as e:
            return e

    def _apply(self, made: LogFiles | BaseException) -> None:
        """Takes the made files (writing what was held) or the failure to make them."""
        self._opening = False
        self._files_settled()
        held, self._held = self._held, []
        if isinstance(made, LogFiles):
            if self._closed and not held:
                made.close()
                return
            self._install(made)
            for now, stream, data in held:
                if data is None:  # the stream ended there: so does its line
                    self._flush_tail(stream, True)
                else:
                    self._append(stream, data, now)
            _notify.wake_key(self._key, Wake.CREATED)
            if held:
                _notify.wake_key(self._key, Wake.DATA, held[-1][1])
        else:
            self._open_failed = True
            error = made if isinstance(made, OSError) else OSError(str(made))
            self._note_loss(error)
            for _, stream, data in held:
                if data is not None:
                    self._discard(stream, len(data))
        if not self._fds and self._drained is not None:
            self._drained.set()

    def _discard(self, stream: Stream, n: int) -> None:
        """Counts output read while the files could not be made (each file's marker says it)."""
        self._lose(stream, n)
        self._lose(Stream.COMBINED, n)

    def _reopen(self) -> None:
        """Makes the files that could not be made, again, as output comes (descriptors or inodes
        may have been freed since; a failing try is a few system calls, on the loop); the output
        lost meanwhile gets its marker line in each file before the next."""
        made = self._open_now()
        if isinstance(made, LogFiles):
            self._open_failed = False
            self._install(made)
            _notify.wake_key(self._key, Wake.CREATED)

    def make_files_soon(self) -> None:
        """Asks ``opener`` for the files now rather than at the first output (a lazy writer whose
        files do not exist and are not being made; otherwise a no-op). A replica that runs a while
        gets its files before it writes, so that its first output, maybe printed just before it
        exits, does not wait for their creation."""
        if self._opener is None or self._files or self._opening or self._closed or self._taken:
            return
        self._ask_opener()

    def _hold(self, stream: Stream, data: bytes) -> None:
        """Keeps a chunk read before the files exist; asks for them at the first one (pausing the
        pipes until they are made)."""
        self._held.append((time.time_ns(), stream, data))
        if self._opening or self._closed:
            return
        self._ask_opener()

    def _ask_opener(self) -> None:
        self._opening = True
        self._pause()
        assert self._opener is not None
        try:
            self._opener(self)
        except Exception:
            logger.exception("asking for the log files of %s failed; made here", self._path)
            self._take_files_now()
            self._resume()

    def _pause(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for fd in self._fds:
                self._loop.remove_reader(fd)

    def _resume(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for fd, stream in self._fds.items():
                self._loop.add_reader(fd, self._on_readable, fd, stream)

    @property
    def directory(self) -> pathlib.Path:
        """The replica's log directory."""
        return pathlib.Path(self._path)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that pumps the pipes (None before the first ``attach``)."""
        return self._loop

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    @property
    def lost_bytes(self) -> dict[str, int]:
        """Bytes that could not be written, per file name (only files that lost some)."""
        return {LOG_FILES[s]: n for s, n in self._lost.items() if n}

    @property
    def loss_reason(self) -> str:
        """Why bytes were lost (the first error), or an empty string."""
        return self._loss_reason

    @property
    def attached(self) -> int:
        """How many pipes are still attached (not at EOF)."""
        return len(self._fds)

    def path(self, stream: Stream) -> pathlib.Path:
        """The file that holds ``stream``."""
        return pathlib.Path(self._path, LOG_FILES[Stream(stream)])

    def attach(self, fd: int, stream: Stream) -> None:
        """Takes ownership of ``fd``, the read end of a pipe, and copies what it carries to ``stream``.

        Must be called from the event loop that will pump it. At EOF the fd is removed from the loop
        and closed.

        Raises:
            ValueError: ``stream`` is not STDOUT or STDERR.
            RuntimeError: the writer is closed, or no event loop is running.
        """
        stream = Stream(stream)
        if stream not in STREAM_IDS:
            raise ValueError(f"a pipe feeds stdout or stderr, not {stream.value!r}")
        if self._closed:
            raise RuntimeError(f"log writer for {self._path} is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("a ReplicaLogWriter is used from one event loop only")
        os.set_blocking(fd, False)
        if self._drained is None:
            self._drained = asyncio.Event()
        self._drained.clear()
        self._fds[fd] = stream
        if not self._opening:  # else reading resumes once the files are made
            loop.add_reader(fd, self._on_readable, fd, stream)

    def _on_readable(self, fd: int, stream: Stream) -> None:
        self._pump(fd, stream, final=False)

    def _pump(self, fd: int, stream: Stream, final: bool) -> None:
        chunks: list[bytes] = []
        size = 0
        eof = False
        limit = _MAX_FINAL if final else _MAX_BATCH
        while size < limit:
            try:
                data = os.read(fd, _READ_SIZE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                logger.warning("reading %s pipe of %s failed: %s", stream.value, self._path, e)
                eof = True
                break
            if not data:
                eof = True
                break
            chunks.append(data)
            size += len(data)
        if chunks:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._open_failed:
                self._reopen()
            if self._files:
                self._append(stream, data)
            elif self._open_failed:
                self._discard(stream, len(data))
            else:
                self._hold(stream, data)
        if eof:
            self._detach(fd)
            if stream not in self._fds.values():  # its line ends with its stream
                if self._held and not self._files:  # (after what is held: the files come later)
                    self._held.append((0, stream, None))
                else:
                    self._flush_tail(stream, True)
            _notify.wake_key(self._key, Wake.EOF)
        elif chunks:
            _notify.wake_key(self._key, Wake.DATA, stream)

    def _append(self, stream: Stream, data: bytes, now: int = 0) -> None:
        """Writes a chunk of ``stream`` read at ``now``: all of it to the stream's file at once,
        and to ``combined.log`` in whole lines (see ``_Tail``), each piece after its index
        record."""
        now = now or time.time_ns()
        tail = self._tails.get(stream)
        cut = data.rfind(b"\n") + 1
        if tail is None and cut == len(data):  # whole lines (the common case)
            self._records(stream, self._offsets[stream], [(now, data)])
            self._write_file(stream, data)
            self._write_file(Stream.COMBINED, data)
            return
        if not cut:  # no line ends here: the line goes on
            start = self._write_file(stream, data)
            self._hold_tail(stream, tail or _Tail(start), now, data)
            return
        if tail is None:
            tail = _Tail(self._offsets[stream])
        tail.add(now, data[:cut])
        self._records(stream, tail.start, tail.chunks)
        start = self._write_file(stream, data)
        self._write_file(Stream.COMBINED, b"".join(d for _, d in tail.chunks))
        self._drop_tail(stream)
        if cut < len(data):  # (where the rest went: never before what was recorded)
            rest = min(start + cut, self._offsets[stream])
            self._hold_tail(stream, _Tail(rest), now, data[cut:])

    def _hold_tail(self, stream: Stream, tail: _Tail, now: int, data: bytes) -> None:
        """Adds ``data`` (in the stream's file already) to ``stream``'s unterminated line; a line
        that outgrows ``_TAIL_MAX`` goes to ``combined.log`` as it comes, one held ``_TAIL_WAIT``
        seconds goes there then (a prompt, a progress bar: readers see it)."""
        tail.add(now, data)
        if self._tails.get(stream) is not tail:
            self._tails[stream] = tail
            if self._loop is not None and not self._loop.is_closed():
                tail.timer = self._loop.call_later(
                    _TAIL_WAIT, self._flush_tail, stream, False, tail
                )
        if tail.size >= _TAIL_MAX:
            self._flush_tail(stream, False)

    def _drop_tail(self, stream: Stream) -> _Tail | None:
        tail = self._tails.pop(stream, None)
        if tail is not None and tail.timer is not None:
            tail.timer.cancel()
        return tail

    def _records(self, stream: Stream, offset: int, chunks: list[tuple[int, bytes]]) -> None:
        """Appends the index records of ``chunks`` of ``stream`` (its file's bytes from ``offset``
        on, each chunk with the time it was read), going to ``combined.log`` next, after the
        newline ending a line ``combined.log`` holds unterminated if that line is another stream's
        or ended with its stream."""
        if self._open_line is not None and (self._open_line is not stream or self._line_ended):
            self._write_file(Stream.COMBINED, b"\n")  # (no line holds bytes of two streams)
        self._open_line = None
        sid = STREAM_IDS[stream]
        combined = self._offsets[Stream.COMBINED]
        # Times and offsets never go back within a stream (a held line's chunks keep the times
        # they were read at, earlier than the other stream's records written meanwhile: readers
        # of combined.log take the running maximum); offsets are kept past the stream's last
        # record and at 0 or more whatever bytes a full disk lost.
        last_ns = self._stream_ns.get(stream, 0)
        offset = max(offset, self._recorded_to.get(stream, 0), 0)
        packed = []
        for now, data in chunks:
            last_ns = max(now, last_ns)
            packed.append(RECORD.pack(last_ns, offset, combined, len(data), sid))
            offset += len(data)
            combined += len(data)
        self._stream_ns[stream] = last_ns
        self._recorded_to[stream] = offset
        try:
            _write_all(self._index_fd, packed[0] if len(packed) == 1 else b"".join(packed))
        except OSError as e:  # the timing of these bytes is lost, not the bytes
            self._note_loss(e)
            try:
                _align_index(self._index_fd)
            except OSError:
                pass

    def _flush_tail(self, stream: Stream, ended: bool, which: _Tail | None = None) -> None:
        """Gives ``combined.log`` the unterminated line ``stream`` has held back (``which``, for
        a timer: if it is still held): its stream ``ended`` (EOF, close), it outgrew
        ``_TAIL_MAX`` or waited ``_TAIL_WAIT``. ``combined.log`` gets a newline after it before
        the next bytes of another stream, or of any stream once its own has ended: the line is
        cut there rather than continued by another's bytes."""
        if which is not None and self._tails.get(stream) is not which:
            return
        tail = self._drop_tail(stream)
        if tail is None or not self._files:
            if ended and self._open_line is stream:  # (given out already: it ends here)
                self._line_ended = True
            return
        self._records(stream, tail.start, tail.chunks)
        self._write_file(Stream.COMBINED, b"".join(d for _, d in tail.chunks))
        self._open_line, self._line_ended = stream, ended
        if which is not None:
            _notify.wake_key(self._key, Wake.DATA, stream)

    def _write_file(self, target: Stream, data: bytes) -> int:
        """Appends ``data`` to ``target``'s file (after the marker of what it lost before, if
        any); returns the offset where it went (or would have)."""
        if self._unmarked.get(target) and not self._write_marker(target):
            self._lose(target, len(data))  # resumed output must follow its marker
            return self._offsets[target]
        start = self._offsets[target]
        written, error = _write_counted(self._files[target], data)
        self._offsets[target] += written
        if error is not None:
            self._note_loss(error)
            self._lose(target, len(data) - written)
        return start

    def _lose(self, target: Stream, n: int) -> None:
        self._lost[target] = self._lost.get(target, 0) + n
        self._unmarked[target] = self._unmarked.get(target, 0) + n

    def hold_loss_report(self) -> None:
        """Holds back the error line that says output was lost (``on_loss`` is called as usual)
        until ``release_loss_report``: for a replica whose launch may yet be undone. A launch
        refused because its disk is full loses its replicas' first output too, but its logs are
        removed with it and its error says what was full: the line would be noise then, and is
        dropped with the writer (never released)."""
        self._holding_report = True

    def release_loss_report(self) -> None:
        """Logs the error line held back since ``hold_loss_report`` (if output was lost
        meanwhile, even if the writer closed since), and any later one at once."""
        self._holding_report = False
        error, self._held_report = self._held_report, None
        if error is not None:
            self._report_loss(error)

    def _report_loss(self, error: OSError) -> None:
        logger.error("writing the logs of %s failed: %s", self._path, error)

    def _note_loss(self, error: OSError) -> None:
        if self._loss_reason:
            return
        self._loss_reason = error.strerror or str(error)
        if self._holding_report:
            self._held_report = error
        else:
            self._report_loss(error)
        if self._on_loss is not None:
            try:
                self._on_loss(self._loss_reason)
            except Exception:
                logger.exception("log loss callback of %s failed", self._path)

    def _write_marker(self, target: Stream) -> bool:
        """Appends the marker of the bytes lost since the last one; False if it cannot be written."""
        fd = self._files[target]
        offset = self._offsets[target]
        try:
            last = os.pread(fd, 1, offset - 1) if offset else b"\n"
        except OSError:
            last = b"\n"
        marker = loss_marker(self._unmarked[target], self._loss_reason, last != b"\n")
        written, error = _write_counted(fd, marker)
        if error is not None:
            if written:  # a partial marker: end its line so the next one starts cleanly
                self._offsets[target] += written
                try:
                    self._offsets[target] += os.write(fd, b"\n")
                except OSError:
                    pass
            return False
        self._offsets[target] += written
        self._unmarked[target] = 0
        return True

    def _free_space_reserve(self) -> bool:
        """Removes the file of space set aside for loss markers (``space_reserve``); True if it
        was there, or someone else removed it (the room may be there now)."""
        if self._space_reserve is None:
            return False
        try:
            os.unlink(self._space_reserve)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        logger.warning(
            "the disk of %s is full: its space reserve %s was freed for the loss markers",
            self._path,
            self._space_reserve,
        )
        return True

    def _detach(self, fd: int) -> None:
        if self._fds.pop(fd, None) is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        try:
            os.close(fd)
        except OSError:
            pass
        if not self._fds and not self._opening and self._drained is not None:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Returns when every attached pipe has reached EOF and all its data is written.

        Call it after the process exited so that no output is lost.
        """
        if (self._fds or self._opening) and self._drained is not None:
            await self._drained.wait()

    def close(self) -> None:
        """Reads what is left in the attached pipes, detaches them and closes the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd, stream in list(self._fds.items()):
            self._pump(fd, stream, final=True)
            self._detach(fd)
        if self._held:  # read before the files were made: written now, even if made here
            self._take_files_now()
        else:  # files a worker thread is making (or made) for nothing are not left open
            with self._open_lock:
                self._taken = True
                made, self._made = self._made, None
            if isinstance(made, LogFiles):
                made.close()
        self._opening = False
        if self._drained is not None:
            self._drained.set()
        if self._open_failed:  # a last try: the files then say what was lost
            self._reopen()
        for stream in list(self._tails):
            self._flush_tail(stream, True)
        for target, n in list(self._unmarked.items()):
            # (the disk still full: the space reserve is the last chance)
            if (
                n
                and target in self._files
                and not self._write_marker(target)
                and self._free_space_reserve()
            ):
                self._write_marker(target)
        self._close_files()
        self._files_settled()
        _notify.remove_writer(self._key, self)
        _notify.wake_key(self._key, Wake.CLOSED)

    def _files_settled(self) -> None:
        on_files, self._on_files = self._on_files, None
        if on_files is not None:
            on_files()

    def _close_files(self) -> None:
        _close_quietly([*self._files.values(), self._index_fd])
        self._files = {}
        self._index_fd = -1

    def __enter__(self) -> ReplicaLogWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ReplicaLogWriter {str(self._path)!r} attached={len(self._fds)}>"
