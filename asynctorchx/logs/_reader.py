"""iter_log_lines: read or follow one replica's log file, line by line."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import pathlib
import re
import stat
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from asynctorchx.logs import _inotify, _notify
from asynctorchx.logs._files import (
    HELD_LINE_WAIT,
    INDEX_FILE,
    LOG_FILES,
    SAMPLED_INDEX_FILE,
    SampledIndex,
    TimingIndex,
)
from asynctorchx.logs._match import LineFilter
from asynctorchx.logs._notify import Wake
from asynctorchx.logs._query import (
    ALL_STREAMS,
    LogQuery,
    Stream,
    check_window_order,
    compile_log_regex,
    parse_stream,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_READ_BLOCK = 1 << 21
_SPLIT_BLOCK = 1 << 18
# A partial line longer than this is not held while its end is searched for: only its offset is
# kept, and the line is read back in one piece once its end is found (see _LongLine).
_LONG_LINE = _READ_BLOCK
_FINISH_CHECK_MAX = 1.0
_FINISH_CHECK_MIN = 0.025
_FALLBACK_POLL = 0.25
_DRAIN_TIMEOUT = 5.0
_UNTIL_SLACK_NS = 1_000_000_000
#: How long after its start a line held back from ``combined.log`` may still reach it: the writer's
#: hold and a margin for its timer
_HELD_NS = int((HELD_LINE_WAIT + 0.1) * 1e9)

# str.splitlines also splits on these; when none occurs it splits like str.split("\n") keeping ends.
_OTHER_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")
_OTHER_BREAKS_NON_ASCII = ("\x85", "\u2028", "\u2029")

Segment = tuple[bytes, int, int, int]
"""``(buffer, start, end, file offset of buffer[start])``: complete lines held in ``buffer[start:end]``."""


@dataclass(frozen=True, slots=True)
class _LongLine:
    """One line of the file, ``[start, end)``, too long to have been held while its end was sought.

    It is read back from the file in one piece (``_LogFile.read_long_blocking``), so a line of N bytes
    costs N bytes of buffer plus its decoded ``str`` while it is decoded, then the ``str`` alone:
    never the chunks it was read in plus their concatenation.
    """

    start: int
    end: int


def decode_lines(data: bytes | bytearray | memoryview) -> list[str]:
    """Decodes ``data`` (invalid UTF-8 replaced) and splits it on ``\\n`` only, keeping the ``\\n``.

    ``\\r`` stays inside lines; a final unterminated line is kept as is.
    """
    text = str(data, "utf-8", "replace")
    if not any(c in text for c in _OTHER_BREAKS) and (
        text.isascii() or not any(c in text for c in _OTHER_BREAKS_NON_ASCII)
    ):
        return text.splitlines(True)  # a text of one line is returned as is, not copied
    if len(text) <= _SPLIT_BLOCK:
        parts = text.split("\n")
        last = parts.pop()
        lines = [p + "\n" for p in parts]
        if last:
            lines.append(last)
        return lines
    # a long line (e.g. a progress line full of \r): slices, so that a text of one line is not
    # copied twice (split, then + "\n")
    lines = []
    start = 0
    while (end := text.find("\n", start) + 1) > 0:
        lines.append(text[start:end])
        start = end
    if start < len(text):
        lines.append(text[start:])
    return lines


def _narrow(segment: Segment, lo: int, hi: int) -> Segment:
    """The lines of ``segment`` that hold at least one byte of the file range ``[lo, hi)``."""
    buf, a, z, base = segment
    first = max(lo - base + a, a)
    last = min(hi - base + a, z)
    if first >= last:
        return buf, a, a, base
    start = buf.rfind(b"\n", a, first) + 1 if first > a else a
    start = max(start, a)
    end = buf.find(b"\n", last - 1, z)
    end = z if end < 0 else end + 1
    return buf, start, end, base + (start - a)


def _pieces(segment: Segment) -> Iterator[tuple[int, int]]:
    """``segment`` cut at line ends into pieces of about ``_SPLIT_BLOCK`` bytes: their bounds."""
    buf, a, z, _ = segment
    while a < z:
        cut = z
        if z - a > _SPLIT_BLOCK:
            cut = buf.rfind(b"\n", a, a + _SPLIT_BLOCK) + 1
            if cut <= a:
                cut = buf.find(b"\n", a + _SPLIT_BLOCK, z) + 1 or z
        yield a, cut
        a = cut


def _batches(segment: Segment) -> Iterator[list[str]]:
    """The lines of ``segment``, decoded in pieces of about ``_SPLIT_BLOCK`` bytes (cache-friendly)."""
    buf = segment[0]
    if segment[1] >= segment[2]:
        return
    view = memoryview(buf)
    for a, cut in _pieces(segment):
        yield decode_lines(view[a:cut])


def _entries(
    segment: Segment, search: Callable[[str], re.Match[str] | None] | None
) -> Iterator[tuple[int, str]]:
    """``(file offset just past the line, line)`` for the lines of ``segment`` that match.

    ``decode_lines`` splits on ``\\n`` only and replacement never makes or removes one, so the
    n-th decoded line of a piece ends at the n-th ``\\n`` of its bytes (or at the piece's end).
    """
    buf, first, _, base = segment
    view = memoryview(buf)
    for a, cut in _pieces(segment):
        p = a
        for line in decode_lines(view[a:cut]):
            q = buf.find(b"\n", p, cut)
            p = cut if q < 0 else q + 1
            if search is None or search(line):
                yield base + (p - first), line


class _LogFile:
    """One log file (and its timing index) read incrementally: the reader's position in it, the
    partial last line, and the index read so far.

    Methods named ``*_blocking`` do file I/O and run in a worker thread (``run``); the others are cheap
    and run on the event loop. ``close`` waits for an in-flight worker call before closing the files.
    """

    def __init__(self, path: str, index_dir: str | None, stream: Stream) -> None:
        self.path = path
        self.index_dir = index_dir
        self.fd = -1
        self.index_fd = -1
        self.index: TimingIndex | SampledIndex = TimingIndex(stream)
        self.pos = 0
        self.pending: list[bytes] = []
        self.pending_len = 0
        # the partial line outgrew _LONG_LINE: its bytes are no longer held in ``pending``
        self.spilled = False
        self.size = 0
        self.mtime_ns = 0
        # a cursor's offset: where reading starts, once the file is open (checked against its size)
        self.resume_at: int | None = None
        # a cursor's offset inside an unterminated line: that line, read again, is skipped when it
        # still ends there unterminated (it was given out whole already)
        self.skip_partial_at: int | None = None
        self._lock = threading.Lock()
        self._busy = 0
        self._closing = False

    @property
    def pending_start(self) -> int:
        """The file offset where the buffered partial line starts."""
        return self.pos - self.pending_len

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Runs ``fn(*args)`` in the loop's default executor, keeping the files open meanwhile.

        The call is shielded: cancelling the future returned (a reader closed or cancelled) lets
        it run anyway, since a call cancelled while queued would never run ``_guarded``, which
        alone closes the files once ``close`` has been called.
        """
        with self._lock:
            self._busy += 1
        call = asyncio.get_running_loop().run_in_executor(None, self._guarded, fn, *args)
        return asyncio.shield(call)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy -= 1
                if self._closing and not self._busy:
                    self._close_files()

    def close(self) -> None:
        """Closes the files now, or when the worker call in flight returns."""
        with self._lock:
            self._closing = True
            if not self._busy:
                self._close_files()

    def _close_files(self) -> None:
        for fd in (self.fd, self.index_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.index_fd = -1

    def open_blocking(self) -> bool:
        """Opens the file (and index) when they exist; True once the log file is open."""
        if self._closing:
            return False
        if self.fd < 0:
            try:
                self.fd = open_regular(self.path)
            except (FileNotFoundError, NotADirectoryError):
                return False
        if self.index_dir is not None and self.index_fd < 0:
            self._open_index_blocking(self.index_dir)
        return True

    def _open_index_blocking(self, directory: str) -> None:
        """Opens the timing index: ``index.bin`` (our writer's), else ``index.txt`` (samples)."""
        for name in (INDEX_FILE, SAMPLED_INDEX_FILE):
            try:
                self.index_fd = open_regular(os.path.join(directory, name))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if name == SAMPLED_INDEX_FILE:
                self.index = SampledIndex(self.index.stream)
            return

    def refresh_blocking(self) -> bool:
        """Reads new index records (first: they are written before the data), then the file's size."""
        if not self.open_blocking():
            return False
        if self.index_fd >= 0:
            self.index.read_blocking(self.index_fd)
        st = os.fstat(self.fd)
        if self.resume_at is not None:
            self.pos = self._resume_blocking(self.resume_at, st.st_size)
            self.resume_at = None
        if st.st_size < self.pos:
            logger.warning(
                "%s shrank to %d bytes; reading it from the start", self.path, st.st_size
            )
            self.pos = 0
            self.skip_partial_at = None
            self._forget_pending()
        self.size = st.st_size
        self.mtime_ns = st.st_mtime_ns
        return True

    def _resume_blocking(self, offset: int, size: int) -> int:
        """Where a read resuming after a cursor's ``offset`` starts.

        An offset that ends a line is where the next line starts. One that does not was given out
        with an unterminated last line (read while the app was still writing it): reading starts
        at that line's start, so the line is given again whole once it has grown, and is skipped
        (``skip_partial_at``) if it still ends at ``offset`` unterminated.

        Raises:
            ValueError: ``offset`` is past the end of the file.
        """
        if size < offset:
            raise ValueError(
                f"log cursor offset {offset} is past the end of {self.path} ({size} bytes): "
                "the cursor was not taken on this log"
            )
        if offset == 0 or os.pread(self.fd, 1, offset - 1) == b"\n":
            return offset
        self.skip_partial_at = offset
        return self.line_start_blocking(offset)

    def line_start_blocking(self, offset: int) -> int:
        """The offset where the line holding byte ``offset`` starts."""
        pos = offset
        while pos > 0:
            start = max(0, pos - (1 << 16))
            data = os.pread(self.fd, pos - start, start)
            i = data.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            pos = start
        return 0

    def pread_blocking(self, size: int, offset: int) -> bytes:
        """Up to ``size`` bytes at ``offset``."""
        return os.pread(self.fd, size, offset) if size > 0 else b""

    def read_long_blocking(self, line: _LongLine) -> list[str]:
        """The decoded line(s) of ``line``: its bytes are read into one buffer, decoded, released."""
        buf = bytearray(line.end - line.start)
        view = memoryview(buf)
        got = 0
        while got < len(buf):  # one read returns at most ~2 GiB on Linux
            n = os.preadv(self.fd, [view[got:]], line.start + got)
            if n == 0:  # the file shrank meanwhile
                break
            got += n
        view.release()
        del buf[got:]
        return decode_lines(buf)

    def poll_blocking(self, limit: int) -> bytes:
        """Refreshes, then reads up to ``limit`` bytes past ``pos`` (b"" when none or no file yet)."""
        if not self.refresh_blocking():
            return b""
        return (
            os.pread(self.fd, min(self.size - self.pos, limit), self.pos)
            if self.size > self.pos
            else b""
        )

    def take(self, data: bytes) -> list[Segment | _LongLine]:
        """Accounts for ``data`` read at ``pos``; returns the complete lines it finishes."""
        base = self.pos
        self.pos += len(data)
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if data:
                self._hold(data)
            return []
        segments: list[Segment | _LongLine] = []
        start = 0
        if self.pending_len:
            first = data.find(b"\n") + 1
            line_start = base - self.pending_len
            if self.spilled:
                segments.append(_LongLine(line_start, base + first))
            else:
                line = b"".join([*self.pending, data[:first]])
                segments.append((line, 0, len(line), line_start))
            start = first
        if start < cut:
            segments.append((data, start, cut, base + start))
        self._forget_pending()
        if cut < len(data):
            self._hold(data[cut:])
        return segments

    def _hold(self, data: bytes) -> None:
        """Adds ``data`` to the partial line (only its length, once the line is too long to hold)."""
        self.pending_len += len(data)
        if self.spilled:
            return
        if self.pending_len > _LONG_LINE:
            self.pending = []
            self.spilled = True
        else:
            self.pending.append(data)

    def _forget_pending(self) -> None:
        self.pending = []
        self.pending_len = 0
        self.spilled = False

    def flush(self) -> list[Segment | _LongLine]:
        """The buffered unterminated last line (then forgets it): none when it is the line a
        cursor was taken at and it has not grown since (``skip_partial_at``)."""
        base = self.pending_start
        item: Segment | _LongLine
        if self.pos == self.skip_partial_at:
            self._forget_pending()
            return []
        if self.spilled:
            item = _LongLine(base, self.pos)
        else:
            line = b"".join(self.pending)
            item = (line, 0, len(line), base)
        self._forget_pending()
        return [item]


def _to_ns(value: float | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a POSIX timestamp (float), got {value!r}")
    try:
        return int(value * 1_000_000_000)
    except (OverflowError, ValueError):  # inf, nan, or an int too large for a float
        raise ValueError(f"{name} must be a finite POSIX timestamp, got {value!r}") from None


#: A replica's log directory, or an async function that finds it (a backend's lookup, whose errors
#: are then raised at the first iteration without a generator layer of its own).
LogLocation = pathlib.Path | Callable[[], Awaitable[pathlib.Path]]


def iter_log_lines(
    directory: pathlib.Path | str | Callable[[], Awaitable[pathlib.Path]],
    stream: Stream = Stream.COMBINED,
    *,
    regex: re.Pattern[str] | str | None = None,
    since: float | None = None,
    until: float | None = None,
    follow: bool = False,
    is_finished: Callable[[], Awaitable[bool]] | None = None,
    poll_interval: float | None = None,
) -> AsyncGenerator[str, None]:
    """The lines of one replica's log, each ending with its ``\\n``.

    Invalid UTF-8 is replaced (never raised), ``\\r`` stays inside lines, a final unterminated line is
    yielded (when not following, or once finished), and a line is never split however long it is.

    ``since``/``until`` keep the lines of which some part was written within ``[since, until]``, using
    the timing index ``index.bin`` (each chunk's time is when it was read from the pipe, within a few
    ms of when the replica wrote it), else the timing samples ``index.txt`` of a file written by
    another program (a Slurm job: each chunk is dated to an interval between two samples, and kept
    when that interval meets the window). A file with neither has nothing finer than its mtime: all
    of it is inside the window when the mtime is, none of it otherwise.

    With ``follow=True`` the lines that exist are yielded, then new ones as they arrive: a writer in
    this process wakes the reader directly, writes by other processes wake it through inotify (or a
    poll every 0.25 s where inotify is unavailable). ``is_finished()`` is awaited once the existing
    lines are read, then only when a wake-up brought no new data or said a writer reached EOF or
    closed (or ``wake_readers`` was called), and otherwise on a timer backing off from 25 ms to 1 s:
    never on every empty read, and a few times per second at most while idle. Once it returns True
    what is left is read (after waiting, up to 5 s, for a writer of this process to drain its pipes),
    the unterminated last line included, and the iteration stops. Without ``is_finished`` a follower
    runs until it is closed or cancelled. A missing file (or directory) is waited for when following,
    and yields nothing otherwise. With ``until`` a follower also stops once everything up to
    ``until`` has been read.

    Args:
        directory: the replica's log directory, or an async function that returns it: it is
            awaited at the first iteration, and what it raises is raised there.
        stream: which file to read: stdout, stderr or combined.
        regex: only lines where ``regex.search`` matches (a string is compiled).
        since: POSIX timestamp; only lines written at or after it.
        until: POSIX timestamp; only lines written at or before it.
        follow: keep reading as the file grows.
        is_finished: tells whether the replica is done (nothing more will be written).
        poll_interval: when following, also re-read the file this often (seconds) even when no
            wake-up came: for files written by other hosts on a network file system, where inotify
            sees nothing. By default the file is polled only when inotify is unavailable.

    Raises:
        ValueError: ``stream`` is not a known stream, ``regex`` is not a valid pattern, or
            ``since`` is after ``until``.
        TypeError: ``since``/``until`` are not numbers.
    """
    return _open_reader(
        directory, stream, regex, since, until, follow, is_finished, poll_interval, None
    )


def iter_log_entries(
    directory: pathlib.Path | str | Callable[[], Awaitable[pathlib.Path]],
    stream: Stream = Stream.COMBINED,
    *,
    start: int = 0,
    regex: re.Pattern[str] | str | None = None,
    since: float | None = None,
    until: float | None = None,
    follow: bool = False,
    is_finished: Callable[[], Awaitable[bool]] | None = None,
    poll_interval: float | None = None,
) -> AsyncGenerator[tuple[int, str], None]:
    """``iter_log_lines`` from byte ``start`` of the file, each line with the offset just past it.

    Passing a line's offset back as ``start`` resumes exactly after that line (lines the regex or
    the window drop still advance the offset: it is a position in the file). ``start`` must be an
    offset this reader gave out for the same file.

    A read that is not following gives out an unterminated last line too (the writer may still be
    writing it); its offset is then inside that line. Resuming from such an offset gives that line
    again, whole, once it has grown (the one repeat: of a line that was unfinished when read), and
    skips it while it still ends at that offset unterminated (nothing is repeated).

    Raises:
        ValueError: as ``iter_log_lines``, or ``start`` is negative; (when iterated) ``start`` is
            past the end of the file.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a byte offset >= 0, got {start!r}")
    return _open_reader(
        directory, stream, regex, since, until, follow, is_finished, poll_interval, start
    )


def _open_reader(
    directory: pathlib.Path | str | Callable[[], Awaitable[pathlib.Path]],
    stream: Stream,
    regex: re.Pattern[str] | str | None,
    since: float | None,
    until: float | None,
    follow: bool,
    is_finished: Callable[[], Awaitable[bool]] | None,
    poll_interval: float | None,
    start: int | None,
) -> AsyncGenerator[Any, None]:
    """Checks the arguments; the reader of lines (``start`` None) or of ``(offset, line)``."""
    stream = parse_stream(stream, ALL_STREAMS, "iter_log_lines")
    if regex is not None:  # (a bytes pattern, or anything but a str one, is refused there)
        regex = compile_log_regex(regex)
    since_ns, until_ns = _to_ns(since, "since"), _to_ns(until, "until")
    check_window_order(since_ns, until_ns, since, until)
    if poll_interval is not None and not poll_interval > 0:
        raise ValueError(
            f"poll_interval must be a positive number of seconds, got {poll_interval!r}"
        )
    where = directory if callable(directory) else pathlib.Path(directory)
    if follow:
        return _follow(where, stream, regex, since_ns, until_ns, is_finished, poll_interval, start)
    return _read_now(where, stream, regex, since_ns, until_ns, start)


async def _located(where: LogLocation) -> pathlib.Path:
    return pathlib.Path(await where()) if callable(where) else where


def iter_query_lines(
    directory: pathlib.Path | str | Callable[[], Awaitable[pathlib.Path]],
    query: LogQuery,
    is_finished: Callable[[], Awaitable[bool]] | None,
    stream: Stream | None = None,
) -> AsyncGenerator[str, None]:
    """``iter_log_lines`` of what a backend's ``LogQuery`` asks for (its stream, unless ``stream``
    names another: a backend that reads one file after another)."""
    return iter_log_lines(
        directory,
        query.stream if stream is None else stream,
        regex=query.regex,
        since=query.since,
        until=query.until,
        follow=query.follow,
        is_finished=is_finished,
    )


def iter_query_entries(
    directory: pathlib.Path | str | Callable[[], Awaitable[pathlib.Path]],
    query: LogQuery,
    is_finished: Callable[[], Awaitable[bool]] | None,
    stream: Stream | None = None,
    start: int = 0,
) -> AsyncGenerator[tuple[int, str], None]:
    """``iter_log_entries`` of what a backend's ``LogQuery`` asks for, from byte ``start``."""
    return iter_log_entries(
        directory,
        query.stream if stream is None else stream,
        start=start,
        regex=query.regex,
        since=query.since,
        until=query.until,
        follow=query.follow,
        is_finished=is_finished,
    )


def _open_log(directory: pathlib.Path, stream: Stream, windowed: bool) -> _LogFile:
    return _LogFile(
        os.path.join(directory, LOG_FILES[stream]), str(directory) if windowed else None, stream
    )


def _plan_blocking(
    log: _LogFile, since_ns: int | None, until_ns: int | None
) -> tuple[int, int] | None:
    """Opens the file and finds the byte range written within the window (None: nothing to read).

    The file's position is left at the start of the range's first line.
    """
    if not log.refresh_blocking():
        return None
    if since_ns is None and until_ns is None:
        return 0, log.size
    lo, hi = log.index.window(since_ns, until_ns, log.size, log.mtime_ns)
    if lo >= hi:
        return None
    log.pos = max(log.pos, log.line_start_blocking(lo))  # a cursor's offset may be further on
    return lo, hi


async def _read_long(
    log: _LogFile,
    line: _LongLine,
    lo: int,
    hi: int,
    flt: LineFilter | None,
) -> list[str]:
    """The long line (read in a worker thread) if it touches ``[lo, hi)`` and passes ``flt``."""
    if not (line.start < hi and line.end > lo):
        return []
    lines = await log.run(log.read_long_blocking, line)
    return lines if flt is None else await flt.keep(lines)


def _text(entry: tuple[int, str]) -> str:
    return entry[1]


def _forget(future: asyncio.Future[Any] | None) -> None:
    """Drops a worker call whose result is no longer wanted."""
    if future is not None and not future.cancel() and not future.cancelled():
        future.exception()


async def _read_now(
    where: LogLocation,
    stream: Stream,
    regex: re.Pattern[str] | None,
    since_ns: int | None,
    until_ns: int | None,
    start: int | None,
) -> AsyncGenerator[Any, None]:
    directory = await _located(where)
    windowed = since_ns is not None or until_ns is not None
    log = _open_log(directory, stream, windowed)
    log.resume_at = start or None
    offsets = start is not None
    flt = LineFilter(regex) if regex is not None else None
    future: asyncio.Future[bytes] | None = None
    try:
        plan = await log.run(_plan_blocking, log, since_ns, until_ns)
        if plan is None:
            return
        lo, hi = plan
        size = log.size
        if log.pos < size:
            future = log.run(log.pread_blocking, min(_READ_BLOCK, size - log.pos), log.pos)
        while future is not None:
            data = await future
            future = None
            segments = log.take(data)
            if data and log.pos < size and log.pending_start < hi:
                future = log.run(log.pread_blocking, min(_READ_BLOCK, size - log.pos), log.pos)
            elif log.pending_len:
                segments += log.flush()  # the unterminated last line
            for segment in segments:
                if isinstance(segment, _LongLine):
                    long_lines = await _read_long(log, segment, lo, hi, flt)
                    while long_lines:  # popped: no long line is held while the next is read
                        # not bound to a name: the generator would hold it while reading the next
                        yield (segment.end, long_lines.pop(0)) if offsets else long_lines.pop(0)
                    continue
                part = _narrow(segment, lo, hi) if windowed else segment
                if offsets:
                    entries = _entries(part, None)
                    for entry in entries if flt is None else await flt.keep(list(entries), _text):
                        yield entry
                    continue
                for lines in _batches(part):
                    for line in lines if flt is None else await flt.keep(lines):
                        yield line
    finally:
        _forget(future)
        log.close()


class _DirectoryWatch:
    """Keeps an inotify watch on the log directory (or, while it is missing, on its nearest ancestor)."""

    def __init__(
        self, directory: str, key: str, names: frozenset[str], waker: _notify.Waker
    ) -> None:
        self._directory = directory
        self._key = key
        self._names = names
        self._waker = waker
        self._watch: _inotify.Watch | None = None
        self._unavailable = False

    @property
    def watching(self) -> bool:
        """True while inotify watches the log directory itself."""
        w = self._watch
        return w is not None and w.active and w.path == self._directory

    def ensure(self) -> None:
        """Watches the directory if that is not done yet (no-op where inotify is unavailable)."""
        if self._unavailable or self.watching:
            return
        path = self._directory
        while True:
            callback = self._on_event if path == self._directory else self._ancestor_callback(path)
            try:
                w = _inotify.watch(path, callback)
            except FileNotFoundError:
                parent = os.path.dirname(path)
                if parent == path:
                    return
                path = parent
                continue
            break
        if w is None:
            self._unavailable = True
        self.cancel()
        self._watch = w
        if w is not None and path != self._directory:
            # the missing child may have been made between its lookup and the watch (a log
            # directory made on a replica's first output): its event was then missed. Only a
            # directory counts: a file or a dangling link in its place cannot be watched, and
            # waking for it would only come back here, at once, for ever
            child = os.path.relpath(self._directory, path).split(os.sep, 1)[0]
            if os.path.isdir(os.path.join(path, child)):
                self._waker.set(Wake.INOTIFY)

    def _on_event(self, name: str, mask: int) -> None:
        if name and name not in self._names:
            return
        if mask & (_inotify.IN_IGNORED | _inotify.IN_Q_OVERFLOW) or not _notify.live_writers(
            self._key
        ):
            self._waker.set(Wake.CLOSED if mask & _inotify.IN_CLOSE_WRITE else Wake.INOTIFY)

    def _ancestor_callback(self, path: str) -> _inotify.WatchCallback:
        rel = os.path.relpath(self._directory, path)
        child = rel.split(os.sep, 1)[0]

        def on_event(name: str, mask: int) -> None:
            if name == child or mask & (_inotify.IN_IGNORED | _inotify.IN_Q_OVERFLOW):
                self._waker.set(Wake.INOTIFY)

        return on_event

    def cancel(self) -> None:
        """Removes the watch."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


async def _drain_writers(key: str, loop: asyncio.AbstractEventLoop) -> None:
    """Waits (bounded) until the writers of this process for the directory have drained their pipes."""
    for writer in _notify.live_writers(key):
        if writer.attached and writer.loop is loop:
            try:
                await asyncio.wait_for(writer.wait_drained(), _DRAIN_TIMEOUT)
            except asyncio.TimeoutError:
                logger.warning("%r did not drain within %.0f s", writer, _DRAIN_TIMEOUT)


class _FinishChecks:
    """When a follower asks whether the replica finished: once the existing lines are read, then
    only when a wake-up brought no new data or may say the writer is done, and otherwise on a timer
    backing off from ``_FINISH_CHECK_MIN`` to ``_FINISH_CHECK_MAX`` (never on every empty read)."""

    __slots__ = ("_delay", "_loop", "_next")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._delay = _FINISH_CHECK_MIN
        self._next = loop.time()

    def due(self, got: bool, reason: Wake) -> bool:
        """True when a read that ``got`` data (or not) after ``reason`` calls for a check."""
        quiet = not got and reason not in (Wake.TIMER, Wake.MORE)
        return quiet or reason.may_be_done or self._loop.time() >= self._next

    def not_finished(self, got: bool, reason: Wake) -> None:
        """A check said no: the next is soon after a state wake-up or a quiet read, later else."""
        if reason.may_be_done or not (got or reason in (Wake.TIMER, Wake.MORE)):
            self._delay = _FINISH_CHECK_MIN
        else:
            self._delay = min(self._delay * 2, _FINISH_CHECK_MAX)
        self._next = self._loop.time() + self._delay

    def timeout(self) -> float:
        """Seconds until the next check is due."""
        return self._next - self._loop.time()


async def _follow(
    where: LogLocation,
    stream: Stream,
    regex: re.Pattern[str] | None,
    since_ns: int | None,
    until_ns: int | None,
    is_finished: Callable[[], Awaitable[bool]] | None,
    poll_interval: float | None,
    start: int | None,
) -> AsyncGenerator[Any, None]:
    directory = await _located(where)
    loop = asyncio.get_running_loop()
    key = _notify.directory_key(directory)
    windowed = since_ns is not None or until_ns is not None
    log = _open_log(directory, stream, windowed)
    log.resume_at = start or None
    offsets = start is not None
    index_names = {INDEX_FILE, SAMPLED_INDEX_FILE} if windowed else set()
    names = frozenset({LOG_FILES[stream], *index_names})
    waker = _notify.Waker(loop, stream)
    watch = _DirectoryWatch(key, key, names, waker)
    flt = LineFilter(regex) if regex is not None else None
    _notify.add_waker(key, waker)
    checks = _FinishChecks(loop)
    reason = Wake.START
    finishing = False
    future: asyncio.Future[bytes] | None = None
    try:
        while True:
            waker.clear()
            watch.ensure()
            future = log.run(log.poll_blocking, _READ_BLOCK)
            data = await future
            future = None
            segments = log.take(data)
            more = log.pos < log.size
            if finishing and not more and log.pending_len:
                segments += log.flush()
            lo, hi = 0, log.size
            if windowed:
                lo, hi = log.index.window(since_ns, until_ns, log.size, log.mtime_ns)
            for segment in segments:
                if isinstance(segment, _LongLine):
                    long_lines = await _read_long(log, segment, lo, hi, flt)
                    while long_lines:  # popped: no long line is held while the next is read
                        # not bound to a name: the generator would hold it while reading the next
                        yield (segment.end, long_lines.pop(0)) if offsets else long_lines.pop(0)
                    continue
                part = _narrow(segment, lo, hi) if windowed else segment
                if offsets:
                    entries = _entries(part, None)
                    for entry in entries if flt is None else await flt.keep(list(entries), _text):
                        yield entry
                    continue
                for lines in _batches(part):
                    for line in lines if flt is None else await flt.keep(lines):
                        yield line
            if more:
                reason = Wake.MORE
                continue
            if finishing:
                return
            if until_ns is not None:
                if _past_until(log, hi, until_ns):
                    return
                if log.pending_len > 0 and time.time_ns() > until_ns + _UNTIL_SLACK_NS:
                    # the window is over and its last line still open (a progress bar's \r
                    # updates): taken as it is now, as a plain read takes it, then done
                    finishing = True
                    continue
            got = bool(data)
            if is_finished is not None and checks.due(got, reason):
                if await is_finished():
                    await _drain_writers(key, loop)
                    finishing = True
                    continue
                checks.not_finished(got, reason)
            timeout = checks.timeout() if is_finished is not None else 3600.0
            poll = poll_interval
            if poll is None and not watch.watching and not _notify.live_writers(key):
                poll = _FALLBACK_POLL
            reason = await waker.wait(_bounded(timeout, poll, until_ns))
            logger.debug("follower of %s woken by %s", log.path, reason.value)
    finally:
        _forget(future)
        _notify.remove_waker(key, waker)
        watch.cancel()
        log.close()


def _bounded(timeout: float, poll_interval: float | None, until_ns: int | None) -> float:
    """``timeout``, shortened to the poll interval and to just past ``until`` (with its slack)."""
    if poll_interval is not None:
        timeout = min(timeout, poll_interval)
    if until_ns is not None:
        left = (until_ns + _UNTIL_SLACK_NS) / 1e9 - time.time()
        timeout = min(timeout, max(0.0, left) + 0.01)
    return timeout


def _past_until(log: _LogFile, hi: int, until_ns: int) -> bool:
    """True when no line touching the window's end can still come (a follower with ``until`` stops).

    A byte past the window says so for a stream's own file. Not for ``combined.log``: a line begun
    at or before ``until`` and held back from it (unterminated, see ``ReplicaLogWriter``) comes
    after the other stream's lines written meanwhile, within the writer's hold of it.
    """
    if log.pending_len > 0 and log.pending_start < hi:
        return False
    now = time.time_ns()
    if hi < log.size and (log.index.stream is not Stream.COMBINED or now > until_ns + _HELD_NS):
        return True
    return now > until_ns + _UNTIL_SLACK_NS


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: a FIFO put in a log's
    place would block the open (then every read) for ever, and a directory cannot be read.

    Raises:
        OSError: it cannot be opened, or is not a regular file (names it).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise OSError(
                e.errno,
                f"{e.strerror} (each log read holds its files open: raise `ulimit -n`, the "
                "process's RLIMIT_NOFILE, or read fewer logs at once)",
                path,
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file: cannot read it as a log", path)
    except BaseException:
        os.close(fd)
        raise
    return fd
