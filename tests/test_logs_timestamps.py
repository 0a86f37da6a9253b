"""The RFC 3339 parser and the resume cursor that the Docker and Kubernetes log readers share."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from asynctorchx.logs._timestamps import (
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


def test_cursor_skips_what_was_already_read() -> None:
    """A resumed stream skips lines before the last timestamp and those already read at it."""
    cursor = ResumeCursor()
    first = cursor.begin_pass()
    assert [first.admit(t) for t in (10, 20, 20)] == [True, True, True]
    assert (cursor.last_ns, cursor.at_last) == (20, 2)
    again = cursor.begin_pass()
    assert [again.admit(t) for t in (5, 10, 20, 20, 20, 30)] == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]
    assert (cursor.last_ns, cursor.at_last) == (30, 1)


def test_cursor_admits_unstamped_lines_and_restarts_from_its_two_numbers() -> None:
    """A line without a time is always new; a cursor rebuilt from (last_ns, at_last) resumes the
    same way as the original."""
    cursor = ResumeCursor()
    p = cursor.begin_pass()
    assert [p.admit(t) for t in (None, 7, 7, None)] == [True, True, True, True]
    rebuilt = ResumeCursor(cursor.last_ns, cursor.at_last)
    again = rebuilt.begin_pass()
    assert [again.admit(t) for t in (7, 7, 7, 8)] == [False, False, True, True]
