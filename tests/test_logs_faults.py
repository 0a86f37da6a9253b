"""Faults around reading logs: a timing index cut by someone else, and ``--since``/``--until``
around a change of the clocks (daylight saving time)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import wait_for
from _logs_env import index_records

from asynctorchx.cli._errors import CliError
from asynctorchx.logs import Stream, _match, iter_log_lines
from asynctorchx.logs._files import (
    INDEX_MAGIC,
    RECORD,
    RECORD_SIZE,
    TimingIndex,
    read_index_blocking,
)
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

# -- a timing index that stops making sense -------------------------------------------------------


T = 1_730_000_000 * 10**9  # a real time: the high bytes of its word are not zero
_CHUNKS = [(T + 100, 0, 4), (T + 110, 1, 3), (T + 120, 0, 5), (T + 130, 1, 2), (T + 140, 0, 6)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stream", list(Stream))
def test_records_misaligned_by_a_cut_index_are_not_trusted(stream: Stream) -> None:
    """8 bytes cut off the last record and the writer appending on: the records read from there
    on are misaligned. They are not trusted (nor any later), so the bytes past the last trusted
    record take the file's mtime: a read from before the start gets every byte."""
    good = index_records(_CHUNKS[:3])
    later = index_records(_CHUNKS)[len(good) :]
    index = TimingIndex(stream)
    index.feed(good[:-8] + later)
    size = {Stream.STDOUT: 15, Stream.STDERR: 5, Stream.COMBINED: 20}[stream]
    assert index.window(T + 50, None, size, T + 200) == (0, size)
    assert index.window(None, T + 1000, size, T + 200) == (0, size)
    trusted = {Stream.STDOUT: [T + 100], Stream.STDERR: [T + 110]}.get(stream, [T + 100, T + 110])
    assert list(index.times) == trusted
    assert index.window(T + 150, None, size, T + 200) == (index.covered, size)
    assert index.broken
    index.feed(index_records(_CHUNKS))  # aligned again by luck: still not trusted
    assert list(index.times) == trusted


def _with(record: bytes, **fields: int) -> bytes:
    t, so, co, length, sid = RECORD.unpack(record)
    values = {"t": t, "so": so, "co": co, "length": length, "sid": sid} | fields
    return RECORD.pack(values["t"], values["so"], values["co"], values["length"], values["sid"])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    [
        "time back",
        "stream offset back",
        "combined offset back",
        "offset past any file",
        "stream byte 2",
        "padding",
    ],
)
def test_the_first_record_that_makes_no_sense_ends_the_trusted_ones(bad: str) -> None:
    """A record whose time or offsets go back (its time and stream offset within its stream: a
    held line's chunks are recorded after the other stream's later ones), whose offset is past
    any real file, whose stream byte is not 0/1 or whose padding is not zero ends the records
    trusted, there and for good."""
    data = bytearray(index_records(_CHUNKS))
    n = 4 if bad == "stream offset back" else 2  # the 5th is the first whose stream has moved on
    at = slice(n * RECORD_SIZE, (n + 1) * RECORD_SIZE)
    record = bytes(data[at])
    data[at] = {
        "time back": lambda: _with(record, t=T + 95),  # (before its stream's last: T + 100)
        "stream offset back": lambda: _with(record, so=3),
        "combined offset back": lambda: _with(record, co=2),
        "offset past any file": lambda: _with(record, so=1 << 60),
        "stream byte 2": lambda: record[:28] + b"\x02" + record[29:],
        "padding": lambda: record[:30] + b"\x01" + record[31:],
    }[bad]()
    index = TimingIndex(Stream.COMBINED)
    assert index.feed(bytes(data)) == len(data)
    assert index.window(T + 50, None, 20, T + 200) == (0, 20)
    trusted = [t for t, _, _ in _CHUNKS[:n]]
    assert (list(index.times), index.covered) == (trusted, sum(size for _, _, size in _CHUNKS[:n]))
    assert index.broken


@pytest.mark.timeout(10)
def test_an_index_cut_below_what_was_read_is_not_trusted_any_more(tmp_path: Path) -> None:
    """An index that shrank under a reader who had read it further is not read on: what is
    appended to it now (by a writer that does not know) is misaligned for that reader."""
    path = tmp_path / "index.bin"
    data = index_records(_CHUNKS)
    path.write_bytes(INDEX_MAGIC + data[: 3 * RECORD_SIZE])
    fd = os.open(path, os.O_RDONLY)
    try:
        index = TimingIndex(Stream.COMBINED)
        read_index_blocking(fd, index)
        assert list(index.times) == [T + 100, T + 110, T + 120]
        os.truncate(path, path.stat().st_size - 8)
        read_index_blocking(fd, index)
        with path.open("ab") as f:
            f.write(data[3 * RECORD_SIZE :])
        read_index_blocking(fd, index)
        assert list(index.times) == [T + 100, T + 110, T + 120]
        assert index.window(T + 50, None, 20, T + 200) == (0, 20)
        assert index.broken
    finally:
        os.close(fd)


@pytest.fixture
async def sched(tmp_path: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("faults", local_root=tmp_path / "root")
    yield s
    await s.close()


def py_app(code: str, **env: str) -> AppDef:
    return AppDef(
        "faults", [Role("main", image="x", entrypoint=sys.executable, args=["-c", code], env=env)]
    )


async def read(s: LocalScheduler, app_id: str, **kw: Any) -> list[str]:
    return [line async for line in s.log_iter(app_id, "main", **kw)]


@pytest.mark.timeout(60)
async def test_since_read_survives_an_index_cut_while_the_replica_runs(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """Another process cuts 8 bytes (one word of the last record) off ``index.bin`` while the
    replica runs; the writer appends its records on, misaligned. A ``since`` read covering the
    whole run still returns every line (those past the cut dated by the file's mtime)."""
    go = tmp_path / "go"
    code = (
        "import os, time\n"
        "for i in range(40): print(i, flush=True); time.sleep(0.01)\n"
        "while not os.path.exists(os.environ['GO']): time.sleep(0.01)\n"
        "for i in range(40, 240): print(i, flush=True); time.sleep(0.002)\n"
    )
    start = datetime.now() - timedelta(seconds=1)
    app_id = await sched.submit(py_app(code, GO=str(go)), {})
    try:
        seen = 0
        with anyio.fail_after(20):
            async for _ in sched.log_iter(app_id, "main", should_tail=True):
                seen += 1
                if seen == 40:
                    break
        index = next((tmp_path / "root").rglob("index.bin"))
        os.truncate(index, index.stat().st_size - 8)
    finally:
        go.touch()
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    want = [f"{i}\n" for i in range(240)]
    assert await read(sched, app_id) == want
    for stream in (Stream.COMBINED, Stream.STDOUT):
        assert await read(sched, app_id, since=start, streams=stream) == want, stream
        assert (
            await read(sched, app_id, until=datetime.now() + timedelta(1), streams=stream) == want
        )


# -- --since/--until around a change of the clocks ------------------------------------------------


@pytest.fixture
def berlin_tz(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time is Europe/Berlin's (the clocks went back from 03:00 to 02:00 on 2024-10-27)."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text",
    [
        "2024-10-27T01:30:00Z",
        "2024-10-27T01:30:00+00:00",
        "2024-10-27T03:30:00+02:00",
    ],
)
def test_cli_absolute_time_with_an_offset_is_exact(berlin_tz: None, text: str) -> None:
    """A time with an offset names one instant, in the hour the clocks repeat too (the second
    02:30), not the local time an hour off."""
    from asynctorchx.cli._common import parse_time

    want = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    got = parse_time(text, "--since").timestamp()
    assert abs(got - want) < 0.001, f"{text} became {got - want:+.0f} s off"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("utc", ["01:10", "01:40"])
def test_cli_relative_time_is_exact_across_a_dst_change(berlin_tz: None, utc: str) -> None:
    """``--since 30m`` means 30 real minutes ago when the clocks went back meanwhile or are in
    the repeated hour (02:10 CET, the second 02:10 of 2024-10-27, is 01:10 UTC)."""
    from asynctorchx.cli._common import parse_time

    now = datetime.fromtimestamp(datetime.fromisoformat(f"2024-10-27T{utc}:00+00:00").timestamp())
    got = parse_time("30m", "--since", now=now).timestamp()
    assert abs(got - (now.timestamp() - 1800)) < 0.001, f"{got - now.timestamp():+.0f} s"
    assert abs(parse_time("30m", "--since").timestamp() - (time.time() - 1800)) < 5


@pytest.mark.timeout(10)
async def test_cli_log_orders_since_and_until_by_instant(berlin_tz: None) -> None:
    """--since the second 02:30 (01:30 UTC) is after --until the first 02:40 (00:40 UTC): the
    command says so, though 02:30 < 02:40 on the wall clock."""
    from asynctorchx.cli.cmd_log import execute

    args = argparse.Namespace(
        identifier="local_cwd://faults/app",
        since="2024-10-27T01:30:00Z",
        until="2024-10-27T00:40:00Z",
        regex=None,
    )
    with pytest.raises(CliError, match="is after --until"):
        await execute(args, None)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
async def test_a_filter_given_lines_one_at_a_time_does_not_hold_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-line path (the Docker and Kubernetes readers' lines come one by one): a line whose
    match takes exponential time is given the event loop for a few milliseconds only, then goes
    to a worker thread, bounded; later lines go there at once; ordinary lines match as before."""
    monkeypatch.setattr(_match, "LINE_TIMEOUT", 0.5)
    flt = _match.LineFilter(re.compile(r"(a|aa)+$"))
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            gaps.append(time.monotonic() - t)

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0.02)
        assert await flt.matches("aaaa")
        assert not await flt.matches("b")
        with pytest.raises(_match.SlowLogRegexError, match=r"more than 0\.5 s on one line"):
            await flt.matches("a" * 40 + "b")
        assert flt.slow
        assert await flt.keep(["aa", "x", "aaa"]) == ["aa", "aaa"]
        await asyncio.sleep(0.02)
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    assert max(gaps) < 0.2, max(gaps)


def test_the_bounded_filter_keeps_the_flags_of_the_pattern() -> None:
    """The pattern is matched by the ``regex`` module with ``re``'s flags and meaning."""
    flt = _match.LineFilter(re.compile(r"^err.*timeout", re.IGNORECASE | re.MULTILINE))
    lines = ["ERR: read Timeout\n", "ok\n", "x\nerr timeout\n", "\u00e9rr timeout\n"]
    assert asyncio.run(flt.keep(lines)) == [lines[0], lines[2]]
    ascii_only = _match.LineFilter(re.compile(r"^\w+$", re.ASCII))
    assert asyncio.run(ascii_only.keep(["abc", "\u00e9t\u00e9"])) == ["abc"]


# -- the filter keeps re's meaning and its bounds (found by a review of the bounded filter) ------

_MEANING = [
    ("[[:digit:]]", "1" * 5000),  # re: the set '[:digt' then ']'; regex: a POSIX class
    ("x{e<=1}", "y" * 5000),  # re: the literal 'x{e<=1}'; regex: a fuzzy match of 'x'
    (r"sep\s", "sep\x1c" + "y" * 5000),  # re's \s matches U+001C; regex's does not
    (r"ca\w", "ca\u0301 " + "y" * 5000),  # a combining mark: re's \w no, regex's yes
]


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("pattern", "line"), _MEANING, ids=[c[0] for c in _MEANING])
async def test_a_filter_on_a_long_line_means_what_re_means(pattern: str, line: str) -> None:
    """A pattern that cannot backtrack badly is ``re``'s on any line (long lines went to the
    ``regex`` module, which reads some syntax and classes otherwise)."""
    rx = re.compile(pattern)
    assert await _match.LineFilter(rx).keep([line]) == ([line] if rx.search(line) else [])
    assert await _match.LineFilter(rx).matches(line) is (rx.search(line) is not None)


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    ("pattern", "line"),
    [
        (r"(?:ERROR|WARN)+ code [[:digit:]]", "ERROR code 7\n"),
        (r"(?:ERROR|WARN)+ code [[:digit:]]", "WARN code :]\n"),
        (r"(?:ab|b)+x{e<=1}", "ab x{e<=1}\n"),
        (r"(?:ab|b)+x{e<=1}", "abz\n"),
        (r"(?:ab|b)+[]x[=y]", "ab=\n"),
    ],
)
async def test_a_risky_filter_means_what_re_means(pattern: str, line: str) -> None:
    """A risky pattern (matched by the ``regex`` module) keeps ``re``'s reading of a ``[:`` in a
    set and of a ``{`` that starts no repeat (a POSIX class and a fuzzy match there)."""
    rx = re.compile(pattern)
    flt = _match.LineFilter(rx)
    assert flt._risky
    assert await flt.keep([line]) == ([line] if rx.search(line) else [])
    assert await flt.matches(line) is (rx.search(line) is not None)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pattern", "line"),
    [(r"\d+\d+\d+x", "1" * 240 + "\n"), (r".*.*.*=", "a" * 320 + "\n")],
    ids=["digits", "dotstars"],
)
async def test_a_polynomial_filter_does_not_freeze_the_loop(
    tmp_path: Path, pattern: str, line: str
) -> None:
    """Two unbounded repeats of the same characters in a row backtrack polynomially (\\d+\\d+\\d+x
    on 240 digits: seconds; 800: minutes): such a filter is bounded too (it froze the loop)."""
    (tmp_path / "combined.log").write_text("ok\n" + line)
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - t)

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0.05)
        got = [x async for x in iter_log_lines(tmp_path, regex=pattern)]
        await asyncio.sleep(0.05)
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    assert got == []
    assert max(gaps) < 0.5, f"the event loop was held {max(gaps):.2f} s"


@pytest.mark.timeout(60)
async def test_slow_filters_leave_worker_threads_to_the_rest_of_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """42 reads with a filter that takes its whole time bound on a line: they share their own few
    threads (``MAX_THREADS``), and a worker-thread call of the rest of the process (a log file
    read, a record) is served at once (they took anyio's 40 default threads)."""
    monkeypatch.setattr(_match, "LINE_TIMEOUT", 0.5)
    pattern = re.compile(r"(a|aa)+$")

    async def reader() -> None:
        flt = _match.LineFilter(pattern)
        flt.slow = True  # (known slow: straight to a worker thread)
        with pytest.raises(_match.SlowLogRegexError):
            await flt.keep(["a" * 40 + "b\n"])

    readers = [asyncio.create_task(reader()) for _ in range(42)]
    await asyncio.sleep(0.1)  # (they are in their threads, or waiting for one)
    t = time.monotonic()
    await anyio.to_thread.run_sync(lambda: None)
    waited = time.monotonic() - t
    await asyncio.gather(*readers)
    assert waited < 0.1, f"a worker-thread call waited {waited:.2f} s behind the log filters"
