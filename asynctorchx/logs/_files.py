"""The on-disk layout of one replica's logs and the format of its timing index.

A replica's directory holds ``stdout.log`` and ``stderr.log`` (exactly the bytes the replica wrote),
``combined.log`` (both streams in the order they were read from the pipes, line by line: a stream's
unterminated line is held back from it for a while, and a line given out unterminated is ended
with a newline of its own before another stream's bytes; see ``ReplicaLogWriter``) and
``index.bin``, the timing index: an 8-byte header followed by fixed-size little-endian records, one per
chunk, written *before* the chunk's bytes reach ``combined.log`` (and, but for a held line's, its
stream's file) so that a byte a reader sees has its time, or is past the last record::

    int64   time_ns          when the chunk was read from the pipe (POSIX ns, never decreasing
                             within a stream; going back in combined's order where a held line
                             came late, see ``TimingIndex``)
    uint64  stream_offset    where the chunk starts in its stream's file
    uint64  combined_offset  where the chunk starts in combined.log
    uint32  length           the chunk's size in bytes
    uint8   stream           0 = stdout, 1 = stderr
    3 bytes padding

A reader trusts the records up to the first one that makes no sense (its time or stream offset
going back within its stream, its combined offset going back, an offset past any real file, a stream byte other than 0/1, non-zero padding: the file
was cut or overwritten by someone else, and what follows is misaligned) and treats the bytes after
the last trusted record as unindexed: they take the file's mtime, like the bytes of a log written
without an index. A bad index makes timing rougher; it never hides bytes.

Logs written by other programs (the ``tee``s of a Slurm job) have no such records; their writer
samples the files instead and appends to ``index.txt`` a line per sample that matters (see
``SampledIndex``): when each byte was written is then known to within a sampling interval.
"""

from __future__ import annotations

import calendar
import operator
import os
import struct
import sys
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import accumulate, compress

from asynctorchx.logs._query import Stream

INDEX_FILE = "index.bin"
#: The timing samples of logs written by another program (``SampledIndex``).
SAMPLED_INDEX_FILE = "index.txt"
INDEX_MAGIC = b"ATXIDX1\n"
RECORD = struct.Struct("<qQQIB3x")
RECORD_SIZE = RECORD.size

LOG_FILES: dict[Stream, str] = {
    Stream.STDOUT: "stdout.log",
    Stream.STDERR: "stderr.log",
    Stream.COMBINED: "combined.log",
}
STREAM_IDS: dict[Stream, int] = {Stream.STDOUT: 0, Stream.STDERR: 1}
#: The longest a stream's unterminated line is held back from ``combined.log`` (seconds; the writer
#: holds it until its newline, 64 KiB, or this): a reader of ``combined.log`` with ``until`` may
#: still see a line begun before ``until`` come this long after it
HELD_LINE_WAIT = 0.2

_STREAM_BYTE = 28
_KEEP = {sid: bytes(1 if i == sid else 0 for i in range(256)) for sid in STREAM_IDS.values()}
#: 1 for a byte that is not a stream id (translate table).
_BAD_ID = bytes(0 if i in STREAM_IDS.values() else 1 for i in range(256))
#: 1 for a non-zero byte (translate table).
_NONZERO = bytes(1 if i else 0 for i in range(256))
#: No log file gets this big (8 PiB): an offset past it is a misread record.
_MAX_OFFSET = 1 << 53


def _first_decrease(before: int, values: array[int] | list[int]) -> int:
    """The index of the first of ``values`` smaller than the one before it (``before`` for the
    first); ``len(values)`` when they never decrease."""
    if not values:
        return 0
    if values[0] < before:
        return 0
    found = bytes(map(operator.gt, values[:-1], values[1:])).find(1)
    return len(values) if found < 0 else found + 1


def _first_true(flags: bytes) -> int:
    """The index of the first 1 of ``flags``; ``len(flags)`` when there is none."""
    found = flags.find(1)
    return len(flags) if found < 0 else found


def log_file_name(stream: Stream) -> str:
    """The file name (in a replica's log directory) that holds ``stream``."""
    return LOG_FILES[Stream(stream)]


@dataclass
class TimingIndex:
    """The chunk start offsets and times of one stream, read incrementally from ``index.bin``.

    ``offsets`` are where chunks start in the stream's file, ``times`` their time in ns (both
    non-decreasing, as the writer keeps them; combined's ``times`` are the running maximum, and
    ``min_after`` the suffix minimum, of its records' times); ``covered`` is the end of the last
    chunk. Bytes past ``covered`` (a file written without an index, or past the last record trusted:
    see ``feed``) take the file's mtime.
    """

    stream: Stream
    offsets: array[int] = field(default_factory=lambda: array("q"))
    times: array[int] = field(default_factory=lambda: array("q"))
    #: combined's only: the least time of each chunk and of every chunk after it (``until``'s
    #: bisect); None while it is ``times`` (no time has gone back: a stream's never do)
    min_after: array[int] | None = None
    covered: int = 0
    read_pos: int = 0
    present: bool = False
    #: a record made no sense: the records from there on are not trusted (nor read)
    broken: bool = False
    _last_time: int = -(1 << 63)  # of combined's view: the running maximum
    _last_combined: int = 0
    _last_offsets: dict[int, int] = field(default_factory=lambda: dict.fromkeys(_KEEP, 0))
    _last_times: dict[int, int] = field(default_factory=lambda: dict.fromkeys(_KEEP, -(1 << 63)))

    def feed(self, data: bytes) -> int:
        """Adds the complete records at the start of ``data``; returns how many bytes were used.

        Records are trusted up to the first that makes no sense (see the module docstring); from
        there on ``broken`` is set and no record is added any more: the bytes past ``covered``
        are then dated by the file's mtime.
        """
        usable = len(data) - len(data) % RECORD_SIZE
        if not usable or self.broken:
            return usable
        # A record is four int64 words: time, stream offset, combined offset, length | stream << 32.
        words = array("q")
        words.frombytes(memoryview(data)[:usable])
        if sys.byteorder != "little":
            words.byteswap()
        view = memoryview(data)
        ids = bytes(view[_STREAM_BYTE:usable:RECORD_SIZE])
        trusted = self._trusted(words, ids, view, usable)
        if trusted < len(ids):
            self.broken = True
            del words[trusted * 4 :]
            ids = ids[:trusted]
            if not trusted:
                return usable
        self._last_combined = words[-2]
        for s in _KEEP:
            found = ids.rfind(s)
            if found >= 0:
                self._last_offsets[s] = words[found * 4 + 1]
                self._last_times[s] = words[found * 4]
        sid = STREAM_IDS.get(self.stream)
        if sid is None:
            # A stream's held line comes to combined.log after lines of the other stream read
            # later, so combined's times go back there. Each bound bisects an array that never
            # decreases: ``since`` the running maximum (the first chunk at or after ``since``),
            # ``until`` the suffix minimum (the first chunk from which every time is past
            # ``until``). With the running maximum alone, the held line took the time of the
            # other stream's line before it, and ``until`` between the two dropped it.
            real = words[0::4]
            times = list(accumulate(real, max, initial=self._last_time))[1:]
            self._last_time = times[-1]
            self.offsets.extend(words[2::4])
            if self.min_after is None and real.tolist() != times:  # the first time going back
                self.min_after = array("q", self.times)
            self.times.extend(times)
            if self.min_after is not None:
                mins = list(accumulate(reversed(real), min))
                mins.reverse()
                self._lower_min_after(self.min_after, mins[0])
                self.min_after.extend(mins)
            last = len(words) - 4
        else:
            keep = ids.translate(_KEEP[sid])
            self.offsets.extend(compress(words[1::4], keep))
            self.times.extend(compress(words[0::4], keep))
            found = ids.rfind(sid)
            if found < 0:
                return usable
            last = found * 4
        end = words[last + (2 if sid is None else 1)] + (words[last + 3] & 0xFFFFFFFF)
        if end > self.covered:
            self.covered = end
        return usable

    @staticmethod
    def _lower_min_after(mins: array[int], least: int) -> None:
        """Lowers the ``min_after`` (``mins``) of the chunks before new ones whose least time is
        ``least``. Only the chunks later than ``least`` change: those read while a line was held
        back (0.2 s at most, see ``ReplicaLogWriter``), so a feed stays about as cheap as the
        records it adds."""
        k = bisect_right(mins, least)
        if k < len(mins):
            mins[k:] = array("q", [least]) * (len(mins) - k)

    def _trusted(self, words: array[int], ids: bytes, view: memoryview, usable: int) -> int:
        """How many of the records (``words``, their stream bytes ``ids``) make sense, each
        after the trusted ones before it."""
        n = len(ids)
        cut = _first_true(ids.translate(_BAD_ID))
        for pad in range(_STREAM_BYTE + 1, RECORD_SIZE):
            cut = min(cut, _first_true(bytes(view[pad:usable:RECORD_SIZE]).translate(_NONZERO)))
        # offsets never decrease (below: the first decrease ends the trusted ones) and start at
        # 0 or more, so those past _MAX_OFFSET (a length adds less than 2**32) are all at the end
        combined = words[2 : cut * 4 : 4]
        cut = min(cut, _first_decrease(self._last_combined, combined))
        cut = min(cut, bisect_right(combined, _MAX_OFFSET, 0, cut))
        stream_offsets = words[1 : cut * 4 : 4]
        times = words[0 : cut * 4 : 4]
        for s, keep in _KEEP.items():  # within a stream, times and offsets never go back
            mask = ids[:cut].translate(keep)
            mine = list(compress(stream_offsets, mask))
            j = _first_decrease(self._last_offsets[s], mine)
            j = bisect_right(mine, _MAX_OFFSET, 0, j)
            j = min(j, _first_decrease(self._last_times[s], list(compress(times, mask))))
            if j < len(mine):
                cut = min(cut, list(compress(range(n), mask))[j])
        return cut

    def window(
        self, since_ns: int | None, until_ns: int | None, size: int, tail_ns: int
    ) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of the file written within ``[since, until]``: from the
        first chunk written at or after ``since`` to the last written at or before ``until``.

        In combined.log a line held back across a bound comes after the other stream's lines
        written meanwhile (up to 0.2 s, see ``ReplicaLogWriter``), which the range then holds too:
        one range cannot leave them out and keep the held line.

        Args:
            since_ns: the window's start (None = unbounded).
            until_ns: the window's end (None = unbounded).
            size: the file's current size.
            tail_ns: the time given to bytes past the indexed ones (the file's mtime).
        """
        offsets, times = self.offsets, self.times
        # (combined's times go back where a held line came late; a stream's never do)
        mins = times if self.min_after is None else self.min_after
        covered = min(self.covered, size)
        if times and tail_ns < times[-1]:
            tail_ns = times[-1]
        lo = 0
        if since_ns is not None:
            i = bisect_left(times, since_ns)
            if i < len(times):
                lo = offsets[i]
            elif tail_ns >= since_ns:
                lo = covered
            else:
                lo = size
        hi = size
        if until_ns is not None:
            j = bisect_right(mins, until_ns)
            if j < len(times):
                hi = offsets[j]
            elif tail_ns <= until_ns:
                hi = size
            else:
                hi = covered
        return lo, max(lo, hi)

    def read_blocking(self, fd: int) -> None:
        """Reads the records appended to the index file ``fd`` since the last call (blocking)."""
        read_index_blocking(fd, self)


def read_index_blocking(fd: int, index: TimingIndex) -> None:
    """Reads the records appended to the index file ``fd`` since the last call (blocking)."""
    if index.read_pos == 0:
        head = os.pread(fd, len(INDEX_MAGIC), 0)
        if len(head) < len(INDEX_MAGIC):
            return
        if head != INDEX_MAGIC:
            return
        index.read_pos = len(INDEX_MAGIC)
        index.present = True
    if index.broken:
        return
    if os.fstat(fd).st_size < index.read_pos:  # cut by someone: what follows is misaligned
        index.broken = True
        return
    while True:
        data = os.pread(fd, 1 << 20, index.read_pos)
        if not data:
            return
        used = index.feed(data)
        index.read_pos += used
        if len(data) < 1 << 20:
            return


_SAMPLED_STREAMS = {Stream.STDOUT: 6, Stream.STDERR: 7, Stream.COMBINED: 8}
_NS = 1_000_000_000
_MIN_NS = -(1 << 62)
_MAX_NS = 1 << 62


def stat_time_ns(date: str, clock: str, zone: str) -> int:
    """The POSIX ns of a time as ``stat -c %y`` prints it (``2024-05-01 12:00:00.123456789 +0200``).

    Raises:
        ValueError: it is not such a time.
    """
    year, month, day = (int(x) for x in date.split("-"))
    hms, _, fraction = clock.partition(".")
    hour, minute, second = (int(x) for x in hms.split(":"))
    if len(zone) != 5 or zone[0] not in "+-" or not zone[1:].isdigit():
        raise ValueError(f"not a time zone offset: {zone!r}")
    offset = (int(zone[1:3]) * 3600 + int(zone[3:5]) * 60) * (1 if zone[0] == "+" else -1)
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)) - offset
    ns = int(fraction.ljust(9, "0")[:9]) if fraction else 0
    return seconds * _NS + ns


@dataclass
class SampledIndex:
    """When the bytes of one stream's file were written, from the samples in ``index.txt``.

    Each line of ``index.txt`` is one sample: ``A B OUT ERR COMBINED``, where A and B are times
    printed by ``stat -c %y`` (three words each) and the rest the three files' sizes. A sample that
    finds a file grown says those bytes were written after the ``A`` of the sample written before it
    and before the ``B`` of the sample written after it (its writer takes that sample right after).
    So each chunk has an interval ``[low, high]`` instead of one time; ``window`` keeps a chunk when
    its interval meets ``[since, until]``: no byte written in the window is left out, and bytes
    written up to one interval outside it may be kept. The bytes the first sample finds are dated
    from its B (the wrapper's clock set before the replica started). Bytes past the last sample get
    ``[the last A, the file's mtime]``. The last chunk, until a sample closes it (never, when the job was
    killed), ends at ``index.txt``'s own mtime: its sample was appended after its "b" time.

    Args:
        stream: the stream whose file this indexes.
    """

    stream: Stream
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    lows: list[int] = field(default_factory=list)
    highs: list[int] = field(default_factory=list)  # the last may be _MAX_NS: not closed yet
    covered: int = 0
    read_pos: int = 0
    present: bool = False
    index_ns: int = _MAX_NS  # index.txt's mtime when last read: bounds the open chunk's high
    _last_a: int = _MIN_NS
    _open: bool = False

    def feed_line(self, line: str) -> None:
        """Adds one sample (a malformed line is skipped)."""
        words = line.split()
        if len(words) != 9:
            return
        try:
            a = stat_time_ns(*words[0:3])
            b = stat_time_ns(*words[3:6])
            size = int(words[_SAMPLED_STREAMS[self.stream]])
        except ValueError:
            return
        if not self.lows and self._last_a == _MIN_NS:
            # the first sample's B is the sampler's clock set before the replica started: what
            # that sample finds was written after it (not at any time since the epoch)
            self._last_a = b
        if self._open:  # this sample is the one right after the last chunk's: it closes it
            before = self.highs[-2] if len(self.highs) > 1 else _MIN_NS
            self.highs[-1] = max(b, self.lows[-1], before)
            self._open = False
        if size > self.covered:
            self.starts.append(self.covered)
            self.ends.append(size)
            low = self._last_a if not self.lows else max(self._last_a, self.lows[-1])
            self.lows.append(low)
            self.highs.append(_MAX_NS)
            self._open = True
            self.covered = size
        self._last_a = max(a, self._last_a)

    def read_blocking(self, fd: int) -> None:
        """Reads the complete lines appended to ``index.txt`` (``fd``) since the last call."""
        self.present = True
        while True:
            data = os.pread(fd, 1 << 20, self.read_pos)
            end = data.rfind(b"\n") + 1
            if end == 0:
                break
            for line in data[:end].decode("ascii", "replace").splitlines():
                self.feed_line(line)
            self.read_pos += end
            if len(data) < 1 << 20:
                break
        self.index_ns = os.fstat(fd).st_mtime_ns  # after the reads: not older than what they saw

    def window(
        self, since_ns: int | None, until_ns: int | None, size: int, tail_ns: int
    ) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of the file that may have been written within
        ``[since, until]`` (see the class docstring); ``tail_ns`` is the file's mtime."""
        starts, ends, lows, highs = self.starts, self.ends, self.lows, self.highs
        covered = min(self.covered, size)
        tail_low = max(self._last_a, lows[-1]) if lows else self._last_a
        lo = 0
        if since_ns is not None:
            i = bisect_left(highs, since_ns)  # the open chunk's high (_MAX_NS) is the file's mtime
            if i == len(starts) - 1 and self._open and min(tail_ns, self.index_ns) < since_ns:
                i += 1
            if i < len(starts):
                lo = starts[i]
            elif covered < size and tail_ns >= since_ns:
                lo = covered
            else:
                lo = size
        hi = size
        if until_ns is not None:
            j = bisect_right(lows, until_ns)
            if j < len(starts):
                hi = ends[j - 1] if j else 0
            elif covered < size and tail_low > until_ns:
                hi = covered
        return lo, max(lo, min(hi, size))
