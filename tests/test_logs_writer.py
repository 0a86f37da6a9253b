"""ReplicaLogWriter: real child processes writing to real pipes pumped on the event loop."""

from __future__ import annotations

import asyncio
import os
import pathlib
import struct
import time

import pytest
from _logs_env import run_child, spawn

from asynctorchx.logs import INDEX_FILE, ReplicaLogWriter, Stream, iter_log_lines
from asynctorchx.logs._files import INDEX_MAGIC, RECORD, RECORD_SIZE


def index_records(directory: pathlib.Path) -> list[tuple[int, int, int, int, int]]:
    """The timing index of ``directory`` as (time_ns, stream offset, combined offset, length, stream)."""
    data = (directory / INDEX_FILE).read_bytes()
    assert data[: len(INDEX_MAGIC)] == INDEX_MAGIC
    body = data[len(INDEX_MAGIC) :]
    assert len(body) % RECORD_SIZE == 0
    return [tuple(r) for r in RECORD.iter_unpack(body)]


async def test_streams_go_to_their_files_and_to_combined(tmp_path: pathlib.Path) -> None:
    """stdout.log and stderr.log hold exactly each stream; combined.log holds both."""
    code = "import sys; print('to out'); sys.stdout.flush(); print('to err', file=sys.stderr)"
    await run_child(tmp_path / "r", code)
    assert (tmp_path / "r" / "stdout.log").read_bytes() == b"to out\n"
    assert (tmp_path / "r" / "stderr.log").read_bytes() == b"to err\n"
    assert sorted((tmp_path / "r" / "combined.log").read_bytes().splitlines()) == [
        b"to err",
        b"to out",
    ]


async def test_directory_is_created_with_parents(tmp_path: pathlib.Path) -> None:
    """The writer creates the replica directory and its parents and all four files at once."""
    directory = tmp_path / "session" / "app" / "role" / "0"
    writer = ReplicaLogWriter(directory)
    try:
        assert sorted(os.listdir(directory)) == [
            "combined.log",
            INDEX_FILE,
            "stderr.log",
            "stdout.log",
        ]
        assert writer.directory == directory
    finally:
        writer.close()


async def test_combined_keeps_the_order_in_which_output_arrived(tmp_path: pathlib.Path) -> None:
    """Lines written alternately to stdout and stderr (each after the previous was logged) alternate in combined."""
    directory = tmp_path / "r"
    code = (
        "import sys\n"
        "for i in range(20):\n"
        "    s = sys.stdout if i % 2 == 0 else sys.stderr\n"
        "    s.write(f'{s.name} {i}\\n'); s.flush()\n"
        "    sys.stdin.readline()\n"
    )
    writer = ReplicaLogWriter(directory)
    proc = await spawn(writer, code, stdin=asyncio.subprocess.PIPE)
    assert proc.stdin is not None
    done = False

    async def finished() -> bool:
        return done

    seen = []
    async for line in iter_log_lines(directory, follow=True, is_finished=finished):
        seen.append(line)
        proc.stdin.write(b"ack\n")
        await proc.stdin.drain()
        if len(seen) == 20:
            done = True
    await proc.wait()
    await writer.wait_drained()
    writer.close()
    expected = [f"{'<stdout>' if i % 2 == 0 else '<stderr>'} {i}\n" for i in range(20)]
    assert seen == expected
    assert (directory / "combined.log").read_text() == "".join(expected)


async def test_200k_lines_are_stored_byte_exact(tmp_path: pathlib.Path) -> None:
    """200 000 lines written as fast as possible reach every file byte for byte, nothing lost or reordered."""
    code = (
        "import sys\n"
        "w = sys.stdout.buffer.write\n"
        "for i in range(200000): w(b'line %07d \\xc3\\xa9 ' % i + b'x' * (i % 50) + b'\\n')\n"
    )
    expected = b"".join(b"line %07d \xc3\xa9 " % i + b"x" * (i % 50) + b"\n" for i in range(200000))
    await run_child(tmp_path / "r", code)
    assert (tmp_path / "r" / "stdout.log").read_bytes() == expected
    assert (tmp_path / "r" / "combined.log").read_bytes() == expected
    assert (tmp_path / "r" / "stderr.log").read_bytes() == b""


async def test_index_describes_every_chunk(tmp_path: pathlib.Path) -> None:
    """The index has one record per chunk: contiguous offsets in each file, times never decreasing."""
    code = (
        "import sys\n"
        "for i in range(300):\n"
        "    s = sys.stdout if i % 3 else sys.stderr\n"
        "    s.write('x' * i + '\\n'); s.flush()\n"
    )
    before = time.time_ns()
    await run_child(tmp_path / "r", code)
    after = time.time_ns()
    records = index_records(tmp_path / "r")
    ends = {0: 0, 1: 0}
    combined = 0
    last_t = 0
    for t, s_off, c_off, length, stream in records:
        assert before <= t <= after
        assert t >= last_t
        assert s_off == ends[stream]
        assert c_off == combined
        ends[stream] += length
        combined += length
        last_t = t
    assert ends[0] == (tmp_path / "r" / "stdout.log").stat().st_size
    assert ends[1] == (tmp_path / "r" / "stderr.log").stat().st_size
    assert combined == (tmp_path / "r" / "combined.log").stat().st_size


async def test_index_time_is_when_the_chunk_was_written(tmp_path: pathlib.Path) -> None:
    """A chunk's recorded time is not before the child wrote it and close after (well under a second)."""
    code = (
        "import sys, time\n"
        "for i in range(5):\n"
        "    sys.stdout.write(f'{time.time_ns()}\\n'); sys.stdout.flush(); time.sleep(0.05)\n"
    )
    await run_child(tmp_path / "r", code)
    records = index_records(tmp_path / "r")
    stamps = [int(x) for x in (tmp_path / "r" / "stdout.log").read_text().split()]
    assert len(records) == len(stamps) == 5
    for (t, *_), written in zip(records, stamps, strict=True):
        assert 0 <= t - written < 1_000_000_000


async def test_restarted_replica_appends_to_the_same_files(tmp_path: pathlib.Path) -> None:
    """A second attempt (new writer on the same directory) appends; offsets and index continue."""
    directory = tmp_path / "r"
    await run_child(directory, "print('attempt 1')")
    await run_child(directory, "import sys; print('attempt 2'); print('e2', file=sys.stderr)")
    assert (directory / "stdout.log").read_bytes() == b"attempt 1\nattempt 2\n"
    records = index_records(directory)
    offsets = [r[1] for r in records if r[4] == 0]
    assert offsets[0] == 0
    assert 10 in offsets
    assert offsets == sorted(set(offsets))
    lines = [line async for line in iter_log_lines(directory)]
    assert lines[0] == "attempt 1\n"
    assert sorted(lines[1:]) == ["attempt 2\n", "e2\n"]


async def test_writer_can_be_reused_for_a_restart(tmp_path: pathlib.Path) -> None:
    """Attaching the pipes of a restarted process to the same writer appends after the first attempt."""
    writer = ReplicaLogWriter(tmp_path / "r")
    for attempt in (1, 2):
        proc = await spawn(writer, f"print('attempt {attempt}')")
        await proc.wait()
        await writer.wait_drained()
    writer.close()
    assert (tmp_path / "r" / "stdout.log").read_bytes() == b"attempt 1\nattempt 2\n"


async def test_wait_drained_returns_once_the_pipes_reach_eof(tmp_path: pathlib.Path) -> None:
    """wait_drained returns after the child exits and every byte it wrote is in the files."""
    writer = ReplicaLogWriter(tmp_path / "r")
    proc = await spawn(writer, "import sys; sys.stdout.write('a' * 1000000)")
    await proc.wait()
    await writer.wait_drained()
    assert writer.attached == 0
    assert (tmp_path / "r" / "stdout.log").stat().st_size == 1_000_000
    writer.close()


async def test_wait_drained_without_pipes_returns_at_once(tmp_path: pathlib.Path) -> None:
    """A writer with nothing attached is drained."""
    writer = ReplicaLogWriter(tmp_path / "r")
    await writer.wait_drained()
    writer.close()


async def test_close_reads_what_is_left_and_is_idempotent(tmp_path: pathlib.Path) -> None:
    """close() keeps what is already in a pipe held open by a grandchild, detaches it, and can be repeated."""
    directory = tmp_path / "r"
    writer = ReplicaLogWriter(directory)
    code = (
        "import subprocess, sys\n"
        "print('parent says hi', flush=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
    )
    proc = await spawn(writer, code)
    await proc.wait()
    assert writer.attached == 2
    writer.close()
    writer.close()
    assert writer.attached == 0
    assert writer.closed
    assert (directory / "stdout.log").read_bytes() == b"parent says hi\n"


async def test_attach_takes_stdout_or_stderr_only(tmp_path: pathlib.Path) -> None:
    """Attaching a pipe as the combined stream is refused with a ValueError naming it."""
    writer = ReplicaLogWriter(tmp_path / "r")
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="combined"):
            writer.attach(r, Stream.COMBINED)
    finally:
        os.close(r)
        os.close(w)
        writer.close()


async def test_attach_after_close_is_refused(tmp_path: pathlib.Path) -> None:
    """A closed writer does not take new pipes."""
    writer = ReplicaLogWriter(tmp_path / "r")
    writer.close()
    r, w = os.pipe()
    try:
        with pytest.raises(RuntimeError, match="closed"):
            writer.attach(r, Stream.STDOUT)
    finally:
        os.close(r)
        os.close(w)


def test_directory_under_a_file_raises_oserror(tmp_path: pathlib.Path) -> None:
    """A log directory whose parent is a regular file raises OSError (as root too)."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        ReplicaLogWriter(tmp_path / "file" / "r")


def test_writer_opens_no_file_descriptor_it_does_not_close(tmp_path: pathlib.Path) -> None:
    """A failed or closed writer leaves no file descriptor open."""
    before = len(os.listdir("/proc/self/fd"))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / INDEX_FILE).mkdir()
    with pytest.raises(OSError):
        ReplicaLogWriter(tmp_path / "r")
    ReplicaLogWriter(tmp_path / "ok").close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_record_layout_is_fixed() -> None:
    """The index record is 32 little-endian bytes (time, stream offset, combined offset, length, stream)."""
    assert RECORD_SIZE == 32
    assert RECORD.pack(1, 2, 3, 4, 1) == struct.pack("<qQQIB3x", 1, 2, 3, 4, 1)


async def test_a_torn_index_record_is_dropped_on_reopen(tmp_path: pathlib.Path) -> None:
    """A partly written index record (e.g. a full disk) is cut off so later records stay aligned."""
    directory = tmp_path / "r"
    await run_child(directory, "print('first')")
    with open(directory / INDEX_FILE, "ab") as f:
        f.write(b"\x01" * 7)
    await run_child(directory, "print('second')")
    end = 0
    for _t, s_off, _c, length, stream in index_records(directory):
        assert stream == 0
        assert s_off == end
        end += length
    assert end == len("first\nsecond\n")
    assert [line async for line in iter_log_lines(directory, since=0.0)] == ["first\n", "second\n"]


async def test_both_streams_at_full_speed_lose_nothing(tmp_path: pathlib.Path) -> None:
    """Two streams flooded at once: each file is exact and combined is their chunk-wise interleaving."""
    code = (
        "import sys, threading\n"
        "def flood(stream, tag):\n"
        "    for i in range(100000): stream.write(f'{tag} {i:06d}\\n')\n"
        "    stream.flush()\n"
        "t = threading.Thread(target=flood, args=(sys.stderr, 'err'))\n"
        "t.start(); flood(sys.stdout, 'out'); t.join()\n"
    )
    directory = tmp_path / "r"
    await run_child(directory, code)
    out = "".join(f"out {i:06d}\n" for i in range(100000)).encode()
    err = "".join(f"err {i:06d}\n" for i in range(100000)).encode()
    assert (directory / "stdout.log").read_bytes() == out
    assert (directory / "stderr.log").read_bytes() == err
    combined = (directory / "combined.log").read_bytes()
    assert len(combined) == len(out) + len(err)
    parts: dict[int, list[bytes]] = {0: [], 1: []}
    for _t, _s, c_off, length, stream in index_records(directory):
        parts[stream].append(combined[c_off : c_off + length])
    assert b"".join(parts[0]) == out
    assert b"".join(parts[1]) == err
    # and no line of combined.log holds bytes of both streams, or half a line
    assert sorted(combined.splitlines(keepends=True)) == sorted(
        out.splitlines(keepends=True) + err.splitlines(keepends=True)
    )
