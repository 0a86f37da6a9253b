"""The on-disk layout of one replica's logs and the format of its timing index.

A replica's directory holds ``stdout.log``, ``stderr.log`` and ``combined.log`` (exactly the bytes the
replica wrote; combined has both streams in the order their chunks were read from the pipes) and
``index.bin``, the timing index: an 8-byte header followed by fixed-size little-endian records, one per
chunk, written *before* the chunk's bytes so that every byte a reader can see has its time::

    int64   time_ns          when the chunk was read from the pipe (POSIX ns, never decreasing)
    uint64  stream_offset    where the chunk starts in its stream's file
    uint64  combined_offset  where the chunk starts in combined.log
    uint32  length           the chunk's size in bytes
    uint8   stream           0 = stdout, 1 = stderr
    3 bytes padding
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from itertools import compress

from asynctorchx.logs._query import Stream

INDEX_FILE = "index.bin"
INDEX_MAGIC = b"ATXIDX1\n"
RECORD = struct.Struct("<qQQIB3x")
RECORD_SIZE = RECORD.size

LOG_FILES: dict[Stream, str] = {
    Stream.STDOUT: "stdout.log",
    Stream.STDERR: "stderr.log",
    Stream.COMBINED: "combined.log",
}
STREAM_IDS: dict[Stream, int] = {Stream.STDOUT: 0, Stream.STDERR: 1}

_STREAM_BYTE = 28
_KEEP = {sid: bytes(1 if i == sid else 0 for i in range(256)) for sid in STREAM_IDS.values()}


def log_file_name(stream: Stream) -> str:
    """The file name (in a replica's log directory) that holds ``stream``."""
    return LOG_FILES[Stream(stream)]


@dataclass
class TimingIndex:
    """The chunk start offsets and times of one stream, read incrementally from ``index.bin``.

    ``offsets`` are where chunks start in the stream's file, ``times`` their time in ns (both
    non-decreasing, as the writer keeps them); ``covered`` is the end of the last chunk. Bytes past
    ``covered`` (a file written without an index) take the file's mtime.
    """

    stream: Stream
    offsets: array[int] = field(default_factory=lambda: array("q"))
    times: array[int] = field(default_factory=lambda: array("q"))
    covered: int = 0
    read_pos: int = 0
    present: bool = False

    def feed(self, data: bytes) -> int:
        """Adds the complete records at the start of ``data``; returns how many bytes were used."""
        usable = len(data) - len(data) % RECORD_SIZE
        if not usable:
            return 0
        # A record is four int64 words: time, stream offset, combined offset, length | stream << 32.
        words = array("q")
        words.frombytes(memoryview(data)[:usable])
        if sys.byteorder != "little":
            words.byteswap()
        sid = STREAM_IDS.get(self.stream)
        if sid is None:
            self.offsets.extend(words[2::4])
            self.times.extend(words[0::4])
            last = len(words) - 4
        else:
            ids = bytes(memoryview(data)[_STREAM_BYTE:usable:RECORD_SIZE])
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

    def window(
        self, since_ns: int | None, until_ns: int | None, size: int, tail_ns: int
    ) -> tuple[int, int]:
        """The byte range ``[lo, hi)`` of the file written within ``[since, until]``.

        Args:
            since_ns: the window's start (None = unbounded).
            until_ns: the window's end (None = unbounded).
            size: the file's current size.
            tail_ns: the time given to bytes past the indexed ones (the file's mtime).
        """
        offsets, times = self.offsets, self.times
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
            j = bisect_right(times, until_ns)
            if j < len(times):
                hi = offsets[j]
            elif tail_ns <= until_ns:
                hi = size
            else:
                hi = covered
        return lo, max(lo, hi)


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
    while True:
        data = os.pread(fd, 1 << 20, index.read_pos)
        if not data:
            return
        used = index.feed(data)
        index.read_pos += used
        if len(data) < 1 << 20:
            return
