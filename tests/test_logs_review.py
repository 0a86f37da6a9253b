"""Defects found reviewing the log reader: ``until`` on the combined stream where a line was held
back from it (dropped by a read, and a follower stopped before it came), a risky regex filter's
``\\N{...}`` read as a repeat, and a compiled pattern refused as a filter."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _local_env import poll_until, wait_for
from _logs_env import index_records
from hypothesis import given
from hypothesis import strategies as st

from asynctorchx.logs import ReplicaLogWriter, Stream, compile_log_regex, iter_log_lines
from asynctorchx.logs._files import RECORD, TimingIndex
from asynctorchx.logs._match import LineFilter
from asynctorchx.logs._query import LogQuery
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

# -- until on combined.log, around a line held back from it ------------------------------------


async def _held_line_with_other_stream_between(d: Path) -> float:
    """stdout writes 'progress ' (no newline); time passes (``mid`` is taken); stderr writes a
    whole line; stdout ends its line. All within the writer's 0.2 s hold, so combined.log gets
    'warn' before 'progress done'. Returns ``mid``."""
    w = ReplicaLogWriter(d)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    w.attach(out_r, Stream.STDOUT)
    w.attach(err_r, Stream.STDERR)
    try:
        os.write(out_w, b"progress ")
        await poll_until(lambda: _size(d / "stdout.log") == 9, "stdout read")
        await asyncio.sleep(0.02)  # (time passing, not synchronisation)
        mid = time.time()
        await asyncio.sleep(0.02)
        os.write(err_w, b"warn\n")
        await poll_until(lambda: _size(d / "stderr.log") == 5, "stderr read")
        os.write(out_w, b"done\n")
        await poll_until(lambda: b"progress done" in (d / "combined.log").read_bytes(), "combined")
    finally:
        os.close(out_w)
        os.close(err_w)
    await w.wait_drained()
    w.close()
    return mid


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else -1


async def test_until_keeps_on_combined_a_line_begun_before_until(tmp_path: Path) -> None:
    """A line of which some part was written at or before ``until`` is kept, in the default
    COMBINED stream as in its own: 'progress ' was written 20 ms before ``until``. It was dropped
    from COMBINED (kept in STDOUT) when the other stream wrote a line while it was held back from
    combined.log: combined's index dated each chunk by the running maximum of the times, so the
    held line took the later time of the stderr line before it."""
    d = tmp_path / "rep"
    mid = await _held_line_with_other_stream_between(d)
    own = [line async for line in iter_log_lines(d, Stream.STDOUT, until=mid)]
    assert own == ["progress done\n"]
    combined = [line async for line in iter_log_lines(d, Stream.COMBINED, until=mid)]
    assert "progress done\n" in combined
    # (the stderr line before it, written 20 ms after until, comes with it: README, "since/until")
    assert set(combined) <= {"warn\n", "progress done\n"}


async def test_a_follower_with_until_waits_for_a_line_held_back_across_until(
    tmp_path: Path,
) -> None:
    """A follower of COMBINED with ``until`` gives the line begun before ``until`` though the
    other stream's line, written after ``until``, reached combined.log first. It stopped at that
    line, as if nothing written before ``until`` could still come."""
    d = tmp_path / "rep"
    w = ReplicaLogWriter(d)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    w.attach(out_r, Stream.STDOUT)
    w.attach(err_r, Stream.STDERR)
    follower: asyncio.Task[list[str]] | None = None
    try:
        os.write(out_w, b"progress ")
        await poll_until(lambda: _size(d / "stdout.log") == 9, "stdout read")
        until = time.time() + 0.02
        lines = iter_log_lines(d, Stream.COMBINED, until=until, follow=True, poll_interval=0.05)
        follower = asyncio.create_task(_collect(lines))
        await asyncio.sleep(0.04)  # (time passing: until is over)
        os.write(err_w, b"warn\n")
        await poll_until(lambda: b"warn" in (d / "combined.log").read_bytes(), "combined")
        # (a follower that stops wrongly does so on this line: it is given the time to)
        await asyncio.wait({follower}, timeout=0.1)
        os.write(out_w, b"done\n")
        await poll_until(lambda: b"progress done" in (d / "combined.log").read_bytes(), "combined")
        got = await asyncio.wait_for(follower, 10)
    finally:
        if follower is not None and not follower.done():
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        os.close(out_w)
        os.close(err_w)
        await w.wait_drained()
        w.close()
    assert got == ["progress done\n"]


async def _collect(lines: AsyncIterator[str]) -> list[str]:
    return [line async for line in lines]


def test_combined_until_ends_after_the_last_chunk_written_before_it() -> None:
    """combined.log's index ends an ``until`` window after the last chunk written at or before
    it, also when that chunk (a held line's) comes after a later one of the other stream: 'warn'
    (t=20, stderr), then 'progress ' (t=10) and 'done' (t=30) of stdout. It ended before the held
    chunk, dated by the running maximum (20)."""
    index = TimingIndex(Stream.COMBINED)
    index.feed(index_records([(20, 1, 5), (10, 0, 9), (30, 0, 5)]))
    assert index.window(None, 5, 19, 30) == (0, 0)
    assert index.window(None, 15, 19, 30) == (0, 14)
    assert index.window(None, 25, 19, 30) == (0, 14)
    assert index.window(None, 30, 19, 30) == (0, 19)
    assert index.window(15, None, 19, 30) == (0, 19)
    assert index.window(25, None, 19, 30) == (14, 19)


@given(
    chunks=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 1), st.integers(1, 4)), max_size=30
    ),
    cut=st.integers(0, 30),
    since=st.none() | st.integers(-1, 52),
    until=st.none() | st.integers(-1, 52),
)
def test_combined_window_holds_every_byte_written_inside_and_ends_on_them(
    chunks: list[tuple[int, int, int]], cut: int, since: int | None, until: int | None
) -> None:
    """For chunks whose times go back in combined.log's order (never within a stream) and
    records read in two parts: ``[lo, hi)`` holds every byte written within ``[since, until]``,
    starts at the first byte written at or after ``since`` and ends after the last written at or
    before ``until``."""
    for sid in (0, 1):  # (a stream's own times never go back)
        mine = sorted(t for t, s, _ in chunks if s == sid)
        positions = [i for i, c in enumerate(chunks) if c[1] == sid]
        for i, t in zip(positions, mine, strict=True):
            chunks[i] = (t, sid, chunks[i][2])
    data = index_records(chunks)
    cut = min(cut, len(chunks)) * RECORD.size
    index = TimingIndex(Stream.COMBINED)
    index.feed(data[:cut])
    index.feed(data[cut:])
    times = [t for t, _, n in chunks for _ in range(n)]
    lo, hi = index.window(since, until, len(times), max(times, default=0))
    inside = [
        i
        for i, t in enumerate(times)
        if (since is None or t >= since) and (until is None or t <= until)
    ]
    if not inside:
        return
    assert lo <= inside[0] and inside[-1] < hi
    assert since is None or times[lo] >= since
    assert since is not None or lo == 0
    assert until is None or times[hi - 1] <= until
    assert until is not None or hi == len(times)


# -- risky regex filters: re's syntax ------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "line"),
    [
        (r"(a+)+\N{LATIN SMALL LETTER X}", "aax"),
        (r"(a+)+\N{LATIN SMALL LETTER X}", "aa"),
        (r"(?x) (a+)+ \# [x] # a comment with [ and (", "aa# x"),
        (r"(a+)+(?#a comment: [ {)x", "aax"),
        (r"([a^]+)+!", "^^!"),
    ],
)
async def test_a_risky_filter_keeps_re_s_reading_of_its_syntax(pattern: str, line: str) -> None:
    """A risky pattern (a repeat inside a repeat, matched by the ``regex`` module) means what
    ``re`` means: ``\\N{...}`` names a character (its ``{`` was escaped as a literal, so the
    pattern did not compile for ``regex``), comments are left as they are, a ``^`` that is not
    first in its set is one of its characters."""
    rx = re.compile(pattern)
    flt = LineFilter(rx)
    assert flt._risky and flt._bounded is not None
    assert await flt.keep([line]) == ([line] if rx.search(line) else [])


# -- a compiled pattern as the filter ------------------------------------------------------------


async def test_a_compiled_regex_is_taken_as_torchx_takes_it(tmp_path: Path) -> None:
    """TorchX's ``log_iter`` passes ``regex`` to ``re.compile``, so a compiled pattern (with its
    flags, e.g. ``re.IGNORECASE``) works there; it filters here too. ``log_iter`` raised
    TypeError 'regex must be a string'."""
    s = LocalScheduler("logs", local_root=tmp_path / "root")
    try:
        role = Role(
            "main", image="x", entrypoint=sys.executable, args=["-c", "print('Loss=1'); print('x')"]
        )
        app_id = await s.submit(AppDef("logs", [role]), {})
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
        pattern = re.compile("loss", re.IGNORECASE)
        got = [line async for line in s.log_iter(app_id, "main", regex=pattern)]  # type: ignore[arg-type]
        assert got == ["Loss=1\n"]
    finally:
        await s.close()


def test_a_compiled_pattern_goes_through_the_risky_pattern_check() -> None:
    """A compiled pattern is the filter as it is (its flags kept), and a risky one is matched by
    ``regex`` with a time limit, or refused when too large, as the same pattern given as a
    string is."""
    pattern = re.compile(r"(a|aa)+$", re.IGNORECASE)
    assert compile_log_regex(pattern) is pattern
    query = LogQuery.build("local", set(Stream), "app", "main", 0, pattern, None, None, False, None)
    assert query.regex is pattern
    flt = LineFilter(pattern)
    assert flt._risky and flt._bounded is not None
    assert flt._bounded.search("AaA") is not None
    too_big = compile_log_regex(re.compile("(a{99999999}|b)+"))
    assert too_big is not None
    with pytest.raises(ValueError, match="repeats too much"):
        LineFilter(too_big)


def test_a_compiled_bytes_pattern_is_refused_clearly() -> None:
    """A bytes pattern cannot match the lines, which are str: TypeError at the call, naming it
    and saying why (not a TypeError from ``search`` at the first line)."""
    with pytest.raises(TypeError, match=r"bytes pattern b'loss'.*log lines are str"):
        compile_log_regex(re.compile(b"loss"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="regex must be a string or a compiled str pattern"):
        compile_log_regex(42)  # type: ignore[arg-type]
