"""The timing index: records fed back per stream, and the byte window of a since/until interval."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from _logs_env import index_records
from hypothesis import example, given
from hypothesis import strategies as st

from asynctorchx.logs import Stream
from asynctorchx.logs._files import SampledIndex, TimingIndex, stat_time_ns

Chunk = tuple[int, int, int]
"""(time_ns, stream id, length)"""


def byte_times(chunks: list[Chunk], stream: Stream) -> list[int]:
    """The time of every byte of ``stream``'s file."""
    times: list[int] = []
    for t, sid, length in chunks:
        if stream is Stream.COMBINED or sid == {Stream.STDOUT: 0, Stream.STDERR: 1}[stream]:
            times.extend([t] * length)
    return times


def test_feed_keeps_the_records_of_its_stream() -> None:
    """A stream's index holds its own chunks' offsets in its file; combined holds all of them."""
    data = index_records([(10, 0, 5), (20, 1, 3), (30, 0, 2)])
    out, err, both = (TimingIndex(s) for s in (Stream.STDOUT, Stream.STDERR, Stream.COMBINED))
    for index in (out, err, both):
        assert index.feed(data) == len(data)
    assert (list(out.offsets), list(out.times), out.covered) == ([0, 5], [10, 30], 7)
    assert (list(err.offsets), list(err.times), err.covered) == ([0], [20], 3)
    assert (list(both.offsets), list(both.times), both.covered) == ([0, 5, 8], [10, 20, 30], 10)


def test_feed_leaves_a_partial_record_for_later() -> None:
    """Bytes of a record still being written are not consumed."""
    data = index_records([(10, 0, 5), (20, 0, 5)])
    index = TimingIndex(Stream.STDOUT)
    assert index.feed(data[:40]) == 32
    assert index.feed(data[32:]) == 32
    assert list(index.times) == [10, 20]


def test_window_of_an_indexed_file() -> None:
    """since/until map to the byte ranges of the chunks written inside them."""
    index = TimingIndex(Stream.COMBINED)
    index.feed(index_records([(10, 0, 5), (20, 0, 5), (30, 0, 5)]))
    assert index.window(None, None, 15, 0) == (0, 15)
    assert index.window(15, None, 15, 0) == (5, 15)
    assert index.window(None, 25, 15, 0) == (0, 10)
    assert index.window(15, 25, 15, 0) == (5, 10)
    assert index.window(20, 20, 15, 0) == (5, 10)
    assert index.window(21, 29, 15, 0)[0] == index.window(21, 29, 15, 0)[1]
    assert index.window(31, None, 15, 0) == (15, 15)


def test_window_of_bytes_past_the_index_uses_the_tail_time() -> None:
    """Bytes not covered by the index (a file without one) take the given tail time (its mtime)."""
    index = TimingIndex(Stream.STDOUT)
    assert index.window(100, None, 8, 150) == (0, 8)
    assert index.window(200, None, 8, 150) == (8, 8)
    assert index.window(None, 100, 8, 150) == (0, 0)
    assert index.window(None, 200, 8, 150) == (0, 8)


@given(
    chunks=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 1), st.integers(1, 4)), max_size=30
    ).map(lambda cs: [(t, sid, n) for (t, sid, n) in sorted(cs, key=lambda c: c[0])]),
    stream=st.sampled_from(list(Stream)),
    since=st.none() | st.integers(-1, 52),
    until=st.none() | st.integers(-1, 52),
)
def test_window_is_exactly_the_bytes_written_inside(
    chunks: list[Chunk], stream: Stream, since: int | None, until: int | None
) -> None:
    """For any chunks, [lo, hi) holds exactly the bytes whose time is within [since, until]."""
    index = TimingIndex(stream)
    index.feed(index_records(chunks))
    times = byte_times(chunks, stream)
    lo, hi = index.window(since, until, len(times), times[-1] if times else 0)
    inside = [
        i
        for i, t in enumerate(times)
        if (since is None or t >= since) and (until is None or t <= until)
    ]
    if inside:
        assert (lo, hi) == (inside[0], inside[-1] + 1)
    else:
        assert lo >= hi


# -- timing samples (index.txt, written by the Slurm wrapper's sampler) -----------------------


def stat_words(ns: int) -> str:
    """``ns`` printed as ``stat -c %y`` does, in a +0200 zone (three words)."""
    local = datetime.fromtimestamp(ns // 1_000_000_000, timezone(timedelta(hours=2)))
    return f"{local:%Y-%m-%d %H:%M:%S}.{ns % 1_000_000_000:09d} +0200"


def test_stat_time_ns_reads_what_stat_prints() -> None:
    """A ``stat -c %y`` time (any zone, with or without a fraction) is its POSIX time in ns."""
    ns = 1_700_000_000_123_456_789
    assert stat_time_ns(*stat_words(ns).split()) == ns
    assert stat_time_ns("2023-11-14", "22:13:20", "+0000") == 1_700_000_000 * 10**9
    assert (
        stat_time_ns("2023-11-14", "22:13:20.5", "-0130")
        == (1_700_000_000 + 5400) * 10**9 + 5 * 10**8
    )


def sampled(writes: list[tuple[int, int]], ticks: list[int], eps: int = 1) -> str:
    """The ``index.txt`` the wrapper's sampler writes when ``writes`` ((time, length) on stdout,
    also on combined) happen and it samples at ``ticks`` (as ``_slurm/script.py`` does: "a" at the
    tick, the stat ``eps`` later, "b" ``eps`` after the stat; a sample is written when the sizes
    changed, with the one before it and the one after it)."""
    return sampled_and_mtime(writes, ticks, eps)[0]


def sampled_and_mtime(
    writes: list[tuple[int, int]], ticks: list[int], eps: int = 1
) -> tuple[str, int]:
    """``sampled``, and when the sampler last appended to ``index.txt`` (the file's mtime)."""
    mtime = -(10**18)
    lines = []
    prev_line, last_sizes, after_change = "", "", False
    b = ticks[0] - 1 if ticks else 0
    for tick in ticks:
        size = sum(n for t, n in writes if t <= tick + eps)
        line = f"{stat_words(tick)} {stat_words(b)} {size} 0 {size}"
        b = tick + 2 * eps
        if str(size) != last_sizes:
            if prev_line:
                lines.append(prev_line)
            lines.append(line)
            prev_line, after_change, mtime = "", True, b
        elif after_change:
            lines.append(line)
            prev_line, after_change, mtime = "", False, b
        else:
            prev_line = line
        last_sizes = str(size)
    return "".join(f"{ln}\n" for ln in lines), mtime


def test_samples_give_each_chunk_the_interval_it_was_written_in() -> None:
    """A chunk a sample finds is dated from the sample before it to the sample after it."""
    index = SampledIndex(Stream.STDOUT)
    for line in sampled([(150, 4), (610, 2)], list(range(0, 1000, 100))).splitlines():
        index.feed_line(line)
    assert (index.starts, index.ends) == ([0, 4], [4, 6])
    assert (index.lows, index.highs) == ([100, 600], [202, 702])
    assert index.window(None, None, 6, 999) == (0, 6)
    assert index.window(300, 500, 6, 999)[0] == index.window(300, 500, 6, 999)[1]
    assert index.window(650, None, 6, 999) == (4, 6)
    assert index.window(None, 180, 6, 999) == (0, 4)


def test_what_the_first_sample_finds_is_dated_from_the_sampler_start() -> None:
    """Bytes written before the first sample (the replica starts with the sampler) are dated from
    the clock set before the replica started, so an until before that leaves them out."""
    index = SampledIndex(Stream.STDOUT)
    index.feed_line(f"{stat_words(100)} {stat_words(10)} 4 0 4")  # written at 50, "b" set at 10
    index.feed_line(f"{stat_words(200)} {stat_words(102)} 4 0 4")
    assert (index.lows, index.highs) == ([10], [102])
    assert index.window(None, 5, 4, 999) == (0, 0)
    assert index.window(None, -(10**15), 4, 999) == (0, 0)
    assert index.window(None, 60, 4, 999) == (0, 4)


def test_a_malformed_sample_is_skipped() -> None:
    """A line that is not a sample (a torn write, garbage) changes nothing."""
    index = SampledIndex(Stream.STDOUT)
    index.feed_line("garbage")
    index.feed_line("2023-11-14 22:13:20 +0000 2023-11-14 nope +0000 1 2 3")
    assert index.starts == [] and index.covered == 0


@given(
    writes=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 5)), max_size=25).map(sorted),
    since=st.none() | st.integers(-100, 5200),
    until=st.none() | st.integers(-100, 5200),
    cut=st.integers(0, 54),
)
@example(writes=[(152, 1), (353, 1)], since=353, until=None, cut=50)
@example(writes=[(152, 1), (5000, 1)], since=4000, until=None, cut=50)
@example(writes=[(352, 1), (553, 1)], since=553, until=None, cut=48)
def test_sampled_window_keeps_every_byte_written_inside_and_little_else(
    writes: list[tuple[int, int]], since: int | None, until: int | None, cut: int
) -> None:
    """Whatever the writes, [lo, hi) holds every byte written within [since, until], and no byte
    written more than two sampling intervals outside it (samples every 100, the last ``cut`` of
    them lost as when the job is killed: those bytes then take the file's mtime, and the chunk no
    sample closed ends at index.txt's mtime)."""
    ticks = list(range(-50, 5300, 100))
    ticks = ticks[: len(ticks) - cut]
    index = SampledIndex(Stream.COMBINED)
    text, index.index_ns = sampled_and_mtime(writes, ticks)
    for line in text.splitlines():
        index.feed_line(line)
    times = [t for t, n in writes for _ in range(n)]
    mtime = times[-1] if times else 0
    lo, hi = index.window(since, until, len(times), mtime)
    for i, t in enumerate(times):
        if (since is None or t >= since) and (until is None or t <= until):
            assert lo <= i < hi, (i, t)
        elif lo <= i < hi and i >= index.covered:  # past the samples: [last sample, mtime]
            assert since is None or mtime >= since, (i, t)
            assert until is None or index._last_a <= until, (i, t)
        elif lo <= i < hi:
            assert since is None or t >= since - 200, (i, t)
            assert until is None or t <= until + 200, (i, t)
