"""The timing index: records fed back per stream, and the byte window of a since/until interval."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from asynctorchx.logs import Stream
from asynctorchx.logs._files import RECORD, TimingIndex

Chunk = tuple[int, int, int]
"""(time_ns, stream id, length)"""


def encode(chunks: list[Chunk]) -> bytes:
    """The index records the writer would write for ``chunks``."""
    offsets = {0: 0, 1: 0}
    combined = 0
    out = []
    for t, sid, length in chunks:
        out.append(RECORD.pack(t, offsets[sid], combined, length, sid))
        offsets[sid] += length
        combined += length
    return b"".join(out)


def byte_times(chunks: list[Chunk], stream: Stream) -> list[int]:
    """The time of every byte of ``stream``'s file."""
    times: list[int] = []
    for t, sid, length in chunks:
        if stream is Stream.COMBINED or sid == {Stream.STDOUT: 0, Stream.STDERR: 1}[stream]:
            times.extend([t] * length)
    return times


def test_feed_keeps_the_records_of_its_stream() -> None:
    """A stream's index holds its own chunks' offsets in its file; combined holds all of them."""
    data = encode([(10, 0, 5), (20, 1, 3), (30, 0, 2)])
    out, err, both = (TimingIndex(s) for s in (Stream.STDOUT, Stream.STDERR, Stream.COMBINED))
    for index in (out, err, both):
        assert index.feed(data) == len(data)
    assert (list(out.offsets), list(out.times), out.covered) == ([0, 5], [10, 30], 7)
    assert (list(err.offsets), list(err.times), err.covered) == ([0], [20], 3)
    assert (list(both.offsets), list(both.times), both.covered) == ([0, 5, 8], [10, 20, 30], 10)


def test_feed_leaves_a_partial_record_for_later() -> None:
    """Bytes of a record still being written are not consumed."""
    data = encode([(10, 0, 5), (20, 0, 5)])
    index = TimingIndex(Stream.STDOUT)
    assert index.feed(data[:40]) == 32
    assert index.feed(data[32:]) == 32
    assert list(index.times) == [10, 20]


def test_window_of_an_indexed_file() -> None:
    """since/until map to the byte ranges of the chunks written inside them."""
    index = TimingIndex(Stream.COMBINED)
    index.feed(encode([(10, 0, 5), (20, 0, 5), (30, 0, 5)]))
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
    index.feed(encode(chunks))
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
