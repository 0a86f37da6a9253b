"""The RFC 3339 parser and the resume cursor that the Docker and Kubernetes log readers share."""

from __future__ import annotations

import itertools
import random
from datetime import datetime, timezone

import pytest

from asynctorchx.logs._timestamps import (
    MARGIN_NS,
    ResumeCursor,
    format_rfc3339_seconds,
    parse_rfc3339_ns,
    seconds_to_ns,
    split_timestamp,
)

NOON = 1714564800  # 2024-05-01T12:00:00Z


def test_nanoseconds_are_exact() -> None:
    """Up to nine fraction digits become exact integer nanoseconds (no float on the way)."""
    assert parse_rfc3339_ns("2024-05-01T12:00:00.123456789Z") == NOON * 10**9 + 123456789
    assert parse_rfc3339_ns("2024-05-01T12:00:00.000000001Z") == NOON * 10**9 + 1
    assert parse_rfc3339_ns("2024-05-01T12:00:00.5Z") == NOON * 10**9 + 500_000_000
    assert parse_rfc3339_ns("2024-05-01T12:00:00Z") == NOON * 10**9
    assert parse_rfc3339_ns("2024-05-01T12:00:00.1234567891234Z") == NOON * 10**9 + 123456789


def test_z_and_offsets_name_the_same_instant() -> None:
    """``Z``, ``z``, ``+02:00`` and ``-05:30`` offsets are applied; bytes parse like text."""
    assert parse_rfc3339_ns("2024-05-01T14:00:00.5+02:00") == NOON * 10**9 + 500_000_000
    assert parse_rfc3339_ns("2024-05-01T06:30:00-05:30") == NOON * 10**9
    assert parse_rfc3339_ns("2024-05-01t12:00:00z") == NOON * 10**9
    assert parse_rfc3339_ns(b"2024-05-01T12:00:00+00:00") == NOON * 10**9
    assert parse_rfc3339_ns("1969-12-31T23:59:59.5Z") == -500_000_000
    assert parse_rfc3339_ns("2016-12-31T23:59:60Z") == parse_rfc3339_ns("2017-01-01T00:00:00Z")


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not a time",
        "2024-05-01 12:00:00Z",
        "2024-05-01T12:00:00",  # no zone
        "2024-05-01T12:00:00.Z",
        "2024-13-01T12:00:00Z",
        "2024-02-30T12:00:00Z",
        "2024-05-01T24:00:00Z",
        "2024-05-01T12:00:00+24:00",
        "2024-05-01T12:00:00Z trailing",
        "2024-05-01T12:00:00\x00Z",
    ],
)
def test_malformed_input_is_a_clear_error(bad: str) -> None:
    """Anything that is not an RFC 3339 time raises ValueError quoting the value."""
    with pytest.raises(ValueError, match=r"not an RFC 3339 time: "):
        parse_rfc3339_ns(bad)


def test_split_keeps_the_text_and_passes_unstamped_lines_whole() -> None:
    """The prefix and its space are split off; the text keeps its \\r and newline; a line without
    a valid prefix comes back whole with no time."""
    ts, text = split_timestamp(b"2026-01-01T00:00:00.000000005Z progress\r 50%\n")
    assert ts == int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 10**9 + 5
    assert text == b"progress\r 50%\n"
    assert split_timestamp(b"no timestamp\n") == (None, b"no timestamp\n")
    assert split_timestamp(b"2026-02-31T00:00:00Z impossible\n") == (
        None,
        b"2026-02-31T00:00:00Z impossible\n",
    )
    assert split_timestamp(b"2026-01-01T00:00:00Z ") == (ts - 5, b"")
    assert format_rfc3339_seconds(ts) == "2026-01-01T00:00:00Z"  # type: ignore[arg-type]


def test_query_times_convert_back_to_their_exact_microsecond() -> None:
    """A datetime's POSIX float converts to its exact nanoseconds (to the microsecond)."""
    moment = datetime(2026, 4, 26, 18, 35, 42, 123457, tzinfo=timezone.utc)
    assert seconds_to_ns(moment.timestamp()) == 1777228542 * 10**9 + 123457000
    for micros in range(0, 1_000_000, 99_991):
        t = datetime(2026, 1, 1, 0, 0, 0, micros, tzinfo=timezone.utc)
        assert seconds_to_ns(t.timestamp()) == 1767225600 * 10**9 + micros * 1000


SECOND = 10**9
T0 = NOON * SECOND + SECOND - 3_000_000  # 3 ms before a second's end: the stamps cross it


def engine(stamps: list[int | None], since: int | None, kubelet: bool) -> list[int]:
    """The indexes of the lines a log of ``stamps`` gives resumed from ``since``: every line stamped
    at or after it, in stored order (the kubelet takes ``sinceTime`` to the second only)."""
    if since is None:
        return list(range(len(stamps)))
    if kubelet:
        since = since // SECOND * SECOND
    return [i for i, ts in enumerate(stamps) if ts is None or ts >= since]


def read(
    stamps: list[int | None], cursor: ResumeCursor, kubelet: bool, limit: int | None = None
) -> list[int]:
    """The lines one pass returns, resumed from ``cursor`` (at most ``limit``), as a reader does."""
    opened = cursor.since_ns
    new = cursor.begin_pass(opened)
    out: list[int] = []
    for i in engine(stamps, opened, kubelet):
        if limit is not None and len(out) == limit:
            break
        if new.admit(stamps[i]):
            out.append(i)
    return out


def saved(cursor: ResumeCursor) -> ResumeCursor:
    """The cursor as a reader hands it out and takes it back (its three numbers)."""
    return ResumeCursor(cursor.since_ns, cursor.count, cursor.partial)


def shuffled_stamps(seed: int, n: int = 400, unstamped: bool = False) -> list[int | None]:
    """Stamps as two streams' lines get them when both write at once: rising by up to 1 ms a line,
    with pauses, over about 3 s (across second boundaries), often a little before the line stored
    ahead (up to 2 ms), sometimes much before (up to 900 ms), in bursts of equal stamps; with
    ``unstamped``, a few lines without one (which a resume cannot place: they come again)."""
    rng = random.Random(seed)
    clock, out = T0, []
    for _ in range(n):
        roll = rng.random()
        clock += rng.randrange(0, 1_000_000)
        if roll < 0.03:
            clock += rng.randrange(100_000_000, 400_000_000)
        if roll < 0.01 and unstamped:
            out.append(None)
        elif roll < 0.3:
            out.append(clock - rng.randrange(1, 2_000_000))
        elif roll < 0.33:
            out.append(clock - rng.randrange(1, 900_000_000))
        elif roll < 0.4 and out and out[-1] is not None:
            out.append(out[-1])
        else:
            out.append(clock)
    return out


@pytest.mark.parametrize("kubelet", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_read_of_stamps_that_go_back_returns_every_line(seed: int, kubelet: bool) -> None:
    """A line stamped before the line stored ahead of it (stdout and stderr written at once) is
    returned by a plain read, and so is every other line: a pass drops no line for its stamp."""
    stamps = shuffled_stamps(seed, unstamped=True)
    assert None in stamps
    assert any(b is not None and a is not None and b < a for a, b in itertools.pairwise(stamps))
    assert read(stamps, ResumeCursor(), kubelet) == list(range(len(stamps)))


@pytest.mark.parametrize("kubelet", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_cursor_at_any_line_of_stamps_that_go_back_resumes_exactly(
    seed: int, kubelet: bool
) -> None:
    """A cursor taken after any line, handed out as its three numbers and taken back, resumes
    with exactly the lines after it, though the stamps go back along the log (a line returned
    before may be stamped after the next one: it is not given again)."""
    stamps = shuffled_stamps(seed)
    for cut in range(len(stamps) + 1):
        cursor = ResumeCursor()
        assert read(stamps, cursor, kubelet, limit=cut) == list(range(cut))
        rest = read(stamps, saved(cursor), kubelet)
        assert rest == list(range(cut, len(stamps))), cut


@pytest.mark.parametrize("kubelet", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_log_resumed_after_every_line_gives_each_line_once(seed: int, kubelet: bool) -> None:
    """A log read one line per pass, each pass resumed from the previous one's handed-out cursor
    (a follow cut after every line), gives every line exactly once, in order; the cursor stays
    small (it counts at most the lines of the last two seconds)."""
    stamps = shuffled_stamps(seed)
    got: list[int] = []
    cursor = ResumeCursor()
    for _ in range(len(stamps) + 1):
        cursor = saved(cursor)
        got += read(stamps, cursor, kubelet, limit=1)
        assert cursor.count <= 400
    assert got == list(range(len(stamps)))
    assert read(stamps, saved(cursor), kubelet) == []


def test_the_cursor_resumes_a_second_before_the_newest_line_and_counts_from_there() -> None:
    """The resume time is the newest stamp read, rounded down to the second, less MARGIN_NS (one
    second); the count is of the lines read stamped at or after it; neither ever goes back."""
    assert MARGIN_NS == SECOND
    start = NOON * SECOND
    cursor = ResumeCursor()
    p = cursor.begin_pass()
    assert p.admit(start + 500)
    assert (cursor.since_ns, cursor.count) == (start - SECOND, 1)
    assert p.admit(start + SECOND + 7) and p.admit(start + 100)  # the second went back a little
    assert (cursor.since_ns, cursor.count) == (start, 3)
    assert p.admit(start + 2 * SECOND + 1)
    assert (cursor.since_ns, cursor.count) == (start + SECOND, 2)
    assert p.admit(start + 200)  # far back: returned, not counted (not before the resume time)
    assert (cursor.since_ns, cursor.count) == (start + SECOND, 2)


def test_cursor_skips_what_was_already_read() -> None:
    """A resumed stream skips the lines before the resume time and the cursor's count at or after
    it, also lines that share one timestamp."""
    start = NOON * SECOND
    stamps = [start + 10, start + 20, start + 20]
    cursor = ResumeCursor()
    first = cursor.begin_pass()
    assert [first.admit(t) for t in stamps] == [True, True, True]
    assert (cursor.since_ns, cursor.count) == (start - SECOND, 3)
    again = cursor.begin_pass(cursor.since_ns)
    later = [start - 2 * SECOND, *stamps, start + 20, start + 30]
    assert [again.admit(t) for t in later] == [False, False, False, False, True, True]
    assert (cursor.since_ns, cursor.count) == (start - SECOND, 5)


def test_cursor_admits_unstamped_lines_and_restarts_from_its_numbers() -> None:
    """A line without a time is always new (not counted); a cursor rebuilt from its numbers
    resumes the same way as the original."""
    start = NOON * SECOND
    cursor = ResumeCursor()
    p = cursor.begin_pass()
    assert [p.admit(t) for t in (None, start + 7, start + 7, None)] == [True] * 4
    rebuilt = saved(cursor)
    again = rebuilt.begin_pass(rebuilt.since_ns)
    assert [again.admit(t) for t in (start + 7, start + 7, start + 7, start + 8)] == [
        False,
        False,
        True,
        True,
    ]


def test_a_cursor_of_the_earlier_form_resumes_after_its_last_timestamp_and_count() -> None:
    """A cursor handed out before (the last timestamp returned, and how many lines carried it)
    resumes after those lines: exactly, where the stamps did not go back."""
    start = NOON * SECOND + 123
    stamps: list[int | None] = [start + (i // 3) * 1000 for i in range(30)]
    for cut in range(1, len(stamps) + 1):
        last = stamps[cut - 1]
        old = ResumeCursor(last, stamps[:cut].count(last))
        assert read(stamps, old, kubelet=True) == list(range(cut, len(stamps))), cut


def test_a_first_read_opened_at_a_time_counts_nothing_before_it() -> None:
    """A first read opened at a time (a query's ``since``; the kubelet also gives the rest of that
    second) returns what comes, but its cursor never resumes before that time, where it read
    nothing, so a resume skips only lines it has read."""
    start = NOON * SECOND + 700_000_000
    stamps: list[int | None] = [start - 400_000_000, start + 5, start + 6, start + 900_000_000]
    opened = start
    cursor = ResumeCursor()
    p = cursor.begin_pass(opened)
    assert [p.admit(t) for t in stamps[:2]] == [True, True]  # the reader drops the first
    assert (cursor.since_ns, cursor.count) == (opened, 1)
    assert read(stamps, saved(cursor), kubelet=True) == [2, 3]
