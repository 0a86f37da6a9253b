"""Printing the log lines of many replicas: ``role/replica`` prefixes, colours, JSON lines.

Shared by ``asynctorchx log`` and ``asynctorchx run --log``. Each line is written whole, so lines of
concurrently followed replicas never mix inside a line.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TextIO

from asynctorchx.cli._common import run_all
from asynctorchx.cli._output import BOLD, RED, REPLICA_PALETTE, Styler

if TYPE_CHECKING:
    from asynctorchx.runner.api import AsyncRunner
    from asynctorchx.schedulers.api import Stream

#: Lines longer than this (in characters) are printed slice by slice rather than copied whole.
_WRITE_SLICE = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")

STDOUT_MARK = "|"
STDERR_MARK = "!"


@dataclass(frozen=True)
class Replica:
    """One replica of a role, and its place among all the replicas of its app (for its colour)."""

    role: str
    index: int
    position: int

    @property
    def label(self) -> str:
        """``role/index``."""
        return f"{self.role}/{self.index}"


def app_replicas(roles: Sequence[tuple[str, int]]) -> list[Replica]:
    """Every replica of an app, in role order then replica order, from ``(role, num_replicas)``."""
    out: list[Replica] = []
    for role, n in roles:
        for k in range(n):
            out.append(Replica(role, k, len(out)))
    return out


class LogPrinter:
    """Writes log lines of some replicas to one stream, prefixed and aligned, or as JSON objects.

    Args:
        handle: the app's handle (in JSON output).
        replicas: the replicas that will be printed (the prefix width fits the longest label).
        out: where to write.
        as_json: one JSON object per line instead of prefixed text.
        flush: flush after every line (when following).
    """

    def __init__(
        self,
        handle: str,
        replicas: Sequence[Replica],
        out: TextIO,
        *,
        as_json: bool = False,
        flush: bool = False,
    ) -> None:
        self.handle = handle
        self.out = out
        self.as_json = as_json
        self.flush = flush
        self.style = Styler(out)
        self.width = max((len(r.label) for r in replicas), default=0)
        self.lines = 0
        # JSON escapes what the output cannot encode as itself (an output that is not UTF-8)
        encoding = (getattr(out, "encoding", None) or "utf-8").lower().replace("_", "-")
        self.ascii_only = encoding not in ("utf-8", "utf8") or bool(_SURROGATE.search(handle))

    def prefix(self, replica: Replica, stream: str | None) -> str:
        """The text before a line of ``replica``: ``role/k`` padded, then the stream marker."""
        colour = REPLICA_PALETTE[replica.position % len(REPLICA_PALETTE)]
        pad = " " * (self.width - len(replica.label))
        if stream == "stderr":
            mark = self.style(STDERR_MARK, f"{BOLD};{RED}")
        else:
            mark = self.style(STDOUT_MARK, "2")
        return f"{self.style(replica.label, colour)}{pad} {mark} "

    def write(self, replica: Replica, stream: str | None, line: str) -> None:
        """Writes one log line (its trailing newline, if any, is replaced by exactly one).

        In text, the prefix is repeated after each carriage return inside the line. A line longer
        than ``_WRITE_SLICE`` characters is written in slices, so that printing it costs no copy
        of it (the line is never split in the output: nothing else is written between its slices).
        """
        end = len(line) - 1 if line.endswith("\n") else len(line)
        if self.as_json:
            record = {
                "handle": self.handle,
                "role": replica.role,
                "replica": replica.index,
                "stream": stream,
                "line": line[:end] if end <= _WRITE_SLICE else "",
            }
            # (a lone surrogate, which no encoding writes, is escaped too)
            escape = self.ascii_only or _SURROGATE.search(line) is not None
            if end <= _WRITE_SLICE:
                self.out.write(json.dumps(record, ensure_ascii=escape) + "\n")
            else:
                # the same text as json.dumps(record): "line" is the last key, its value is escaped
                # slice by slice (JSON escapes each character on its own)
                self.out.write(json.dumps(record, ensure_ascii=escape)[:-2])
                for i in range(0, end, _WRITE_SLICE):
                    piece = line[i : min(i + _WRITE_SLICE, end)]
                    self.out.write(json.dumps(piece, ensure_ascii=escape)[1:-1])
                self.out.write('"}\n')
        else:
            prefix = self.prefix(replica, stream)
            # a carriage return inside a line (a progress bar redrawing itself) goes back to the
            # start of the terminal's line: the prefix is repeated after it, as TorchX does, or
            # the redrawn text would overwrite it; a last one (CRLF) moves nothing that is shown
            last = end - 1 if end and line[end - 1] == "\r" else end
            if end <= _WRITE_SLICE:
                self.out.write(f"{prefix}{_after_cr(line, 0, end, last, prefix)}\n")
            else:
                self.out.write(prefix)
                for i in range(0, end, _WRITE_SLICE):
                    self.out.write(_after_cr(line, i, min(i + _WRITE_SLICE, end), last, prefix))
                self.out.write("\n")
        self.lines += 1
        if self.flush:
            self.out.flush()


def _after_cr(line: str, start: int, stop: int, last: int, prefix: str) -> str:
    """``line[start:stop]`` with ``prefix`` after each carriage return before index ``last``."""
    if "\r" not in line[start:stop]:
        return line[start:stop]
    cut = max(start, min(stop, last))
    return line[start:cut].replace("\r", "\r" + prefix) + line[cut:stop]


@dataclass(frozen=True)
class LogQuery:
    """What to read of each replica's log (see ``AsyncRunner.log_lines``)."""

    regex: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    follow: bool = False
    stream: Stream | None = None


async def print_replica(
    runner: AsyncRunner,
    handle: str,
    replica: Replica,
    printer: LogPrinter,
    query: LogQuery,
    *,
    separate_streams: bool = False,
) -> None:
    """Prints the log of one replica.

    Args:
        separate_streams: read stdout and stderr separately (concurrently) so that stderr lines are
            marked; a backend that cannot separate them is read combined instead.
    """
    if not separate_streams:
        await _print_stream(runner, handle, replica, printer, query, query.stream)
        return
    from asynctorchx.schedulers.api import Stream

    emitted = [0]

    async def one(stream: Stream) -> None:
        async for line in _lines(runner, handle, replica, query, stream):
            emitted[0] += 1
            printer.write(replica, stream.value, line)
            del line  # hold no line while the next one (maybe a huge one) is read

    try:
        await run_all([one(Stream.STDOUT), one(Stream.STDERR)])
    except ValueError:
        if emitted[0]:
            raise
        await _print_stream(runner, handle, replica, printer, query, Stream.COMBINED)


async def _print_stream(
    runner: AsyncRunner,
    handle: str,
    replica: Replica,
    printer: LogPrinter,
    query: LogQuery,
    stream: Stream | None,
) -> None:
    name = None if stream is None or stream.value == "combined" else stream.value
    async for line in _lines(runner, handle, replica, query, stream):
        printer.write(replica, name, line)
        del line  # hold no line while the next one (maybe a huge one) is read


def _lines(
    runner: AsyncRunner, handle: str, replica: Replica, query: LogQuery, stream: Stream | None
) -> AsyncIterator[str]:
    return runner.log_lines(
        handle,
        replica.role,
        replica.index,
        regex=query.regex,
        since=query.since,
        until=query.until,
        should_tail=query.follow,
        streams=stream,
    )


async def print_logs(
    runner: AsyncRunner,
    handle: str,
    replicas: Sequence[Replica],
    printer: LogPrinter,
    query: LogQuery,
    *,
    separate_streams: bool = False,
) -> None:
    """Prints the logs of ``replicas``: concurrently when following, else one replica after another."""
    if query.follow:
        await run_all(
            print_replica(runner, handle, r, printer, query, separate_streams=separate_streams)
            for r in replicas
        )
        return
    for r in replicas:
        await print_replica(runner, handle, r, printer, query, separate_streams=separate_streams)
