"""The writer's held lines (``_Tail``: a stream's unterminated line kept out of combined.log until
it ends), found by review: their index times, a full disk in the middle of a chunk, and a replica
restarted after its last line was given out unterminated."""

from __future__ import annotations

import asyncio
import errno
import os
import pathlib
import time
from typing import Any

import anyio
import pytest

from asynctorchx.logs import ReplicaLogWriter, Stream, _writer, iter_log_lines
from asynctorchx.logs._files import INDEX_MAGIC, RECORD


async def _until_size(path: pathlib.Path, size: int) -> None:
    """Waits (bounded) until the writer has put ``size`` bytes in ``path``."""
    with anyio.fail_after(5):
        while not path.exists() or path.stat().st_size < size:
            await asyncio.sleep(0.005)


def _records(directory: pathlib.Path) -> list[tuple[int, int, int, int, int]]:
    body = (directory / "index.bin").read_bytes()[len(INDEX_MAGIC) :]
    return list(RECORD.iter_unpack(body))


@pytest.mark.timeout(30)
async def test_a_held_line_keeps_the_time_it_was_read_in_its_stream(tmp_path: pathlib.Path) -> None:
    """stdout writes 'partial' at t0, stderr a line 100 ms later, stdout ' rest' 50 ms after: in
    stdout.log the line is within ``until=t0+40ms`` (its record had the stderr line's time); in
    combined.log, where it comes after the stderr line, it takes the time of the line before it
    (combined's times never go back)."""
    writer = ReplicaLogWriter(tmp_path)
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    writer.attach(out_r, Stream.STDOUT)
    writer.attach(err_r, Stream.STDERR)
    try:
        t0 = time.time()
        os.write(out_w, b"partial")
        await _until_size(tmp_path / "stdout.log", 7)
        await asyncio.sleep(0.1)  # (the scenario's gap)
        os.write(err_w, b"err line\n")
        await _until_size(tmp_path / "stderr.log", 9)
        await asyncio.sleep(0.05)
        os.write(out_w, b" rest\n")
    finally:
        os.close(out_w)
        os.close(err_w)
    await asyncio.wait_for(writer.wait_drained(), 5)
    writer.close()
    until = t0 + 0.04
    assert [ln async for ln in iter_log_lines(tmp_path, Stream.STDOUT, until=until)] == [
        "partial rest\n"
    ]
    assert [ln async for ln in iter_log_lines(tmp_path, Stream.COMBINED, since=t0 + 0.08)] == [
        "err line\n",
        "partial rest\n",
    ]
    times = {sid: [r[0] for r in _records(tmp_path) if r[4] == sid] for sid in (0, 1)}
    assert times[0] == sorted(times[0]) and times[0][0] < times[1][0]


def _failing_once(monkeypatch: pytest.MonkeyPatch, fd: int, armed: bool) -> dict[str, bool]:
    """Makes the next write to ``fd`` fail with ENOSPC once ``state["armed"]``."""
    real = _writer._write_counted
    state = {"armed": armed}

    def write_counted(target: int, data: bytes) -> tuple[int, OSError | None]:
        if target == fd and state["armed"]:
            state["armed"] = False
            return 0, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(target, data)

    monkeypatch.setattr(_writer, "_write_counted", write_counted)
    return state


@pytest.mark.timeout(30)
async def test_a_chunk_lost_to_a_full_disk_keeps_the_index_in_order(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of 'x\\nyy' to stdout.log fails once (a full disk): the held line's record does
    not start before bytes already indexed (the index was cut there for every reader, and a
    'since' read of later output fell back to the file's mtime)."""
    writer = ReplicaLogWriter(tmp_path)
    state = _failing_once(monkeypatch, writer._files[Stream.STDOUT], armed=False)
    r, w = os.pipe()
    writer.attach(r, Stream.STDOUT)
    try:
        os.write(w, b"first line of many bytes\n")
        await _until_size(tmp_path / "stdout.log", 25)
        state["armed"] = True
        os.write(w, b"x\nyy")
        with anyio.fail_after(5):
            while state["armed"]:
                await asyncio.sleep(0.005)
        os.write(w, b"y\n")
        await asyncio.sleep(0.3)  # (the scenario's gap)
        t_late = time.time()
        os.write(w, b"late line\n")
    finally:
        os.close(w)
    await asyncio.wait_for(writer.wait_drained(), 5)
    writer.close()
    offsets = [r[1] for r in _records(tmp_path) if r[4] == 0]
    assert offsets == sorted(offsets), offsets
    since = [ln async for ln in iter_log_lines(tmp_path, Stream.STDOUT, since=t_late - 0.01)]
    assert since == ["late line\n"]


@pytest.mark.timeout(30)
async def test_a_first_chunk_lost_to_a_full_disk_loses_nothing_after_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The very first chunk 'x\\nyy' fails to reach stdout.log: every later line still reaches
    both files (the held line started at offset -2, its record could not be packed, and every
    later line of stdout was dropped with a struct.error in the pipe's callback)."""
    writer = ReplicaLogWriter(tmp_path)
    _failing_once(monkeypatch, writer._files[Stream.STDOUT], armed=True)
    loop = asyncio.get_running_loop()
    errors: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx.get("exception")))
    r, w = os.pipe()
    writer.attach(r, Stream.STDOUT)
    try:
        os.write(w, b"x\nyy")
        await _until_size(tmp_path / "combined.log", 2)  # (read: its write failed)
        for i in range(3):
            os.write(w, f"y\nline {i}\n".encode())
            await _until_size(tmp_path / "combined.log", 2 + (i + 1) * 9)
    finally:
        os.close(w)
    await asyncio.wait_for(writer.wait_drained(), 5)
    writer.close()
    loop.set_exception_handler(None)
    combined = (tmp_path / "combined.log").read_bytes()
    stdout = (tmp_path / "stdout.log").read_bytes()
    for i in range(3):
        line = f"line {i}\n".encode()
        assert line in combined and line in stdout, (combined, stdout, errors)
    assert errors == []


async def _attempt(writer: ReplicaLogWriter, data: bytes, linger: float) -> None:
    r, w = os.pipe()
    writer.attach(r, Stream.STDOUT)
    try:
        os.write(w, data)
        await asyncio.sleep(linger)  # (the scenario: how long the attempt lives on)
    finally:
        os.close(w)
    await asyncio.wait_for(writer.wait_drained(), 5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("linger", [0.05, 0.4], ids=["ended-while-held", "ended-after-timer"])
async def test_a_restarted_replica_starts_a_new_combined_line(
    tmp_path: pathlib.Path, linger: float
) -> None:
    """A replica dies in the middle of a progress line and is restarted (the writer reused): the
    restart's first line starts a line of its own in combined.log, also when the unterminated
    line had been given out by the timer before its stream ended (it was glued on)."""
    writer = ReplicaLogWriter(tmp_path)
    try:
        await _attempt(writer, b"epoch 1: 50%", linger)
        await _attempt(writer, b"restarted\n", 0.05)
    finally:
        writer.close()
    got = [line async for line in iter_log_lines(tmp_path, Stream.COMBINED)]
    assert got == ["epoch 1: 50%\n", "restarted\n"]


@pytest.mark.timeout(30)
async def test_a_line_whose_stream_ended_before_the_files_were_made_ends_there(
    tmp_path: pathlib.Path,
) -> None:
    """A lazy writer: the replica writes an unterminated line and exits before its files exist
    (the chunk and the end of its stream read together), then restarts. The end was forgotten
    once the files were made, so the restart's first line was glued to it in combined.log when it
    came within the held line's 0.2 s (the fourteenth session's review, timing-dependent); its own
    stream keeps the two parts together."""
    asked = asyncio.Event()
    writer = ReplicaLogWriter(tmp_path / "main" / "0", opener=lambda _: asked.set())
    try:
        r, w = os.pipe()
        os.write(w, b"partial")
        os.close(w)
        writer.attach(r, Stream.STDOUT)
        # the first chunk asks for the files (and the end of its stream is read with it)
        await asyncio.wait_for(asked.wait(), 5)
        await anyio.to_thread.run_sync(writer.make_files)
        writer.files_made()
        await _attempt(writer, b"second\n", 0.0)
    finally:
        writer.close()
    combined = [line async for line in iter_log_lines(tmp_path / "main" / "0", Stream.COMBINED)]
    stdout = [line async for line in iter_log_lines(tmp_path / "main" / "0", Stream.STDOUT)]
    assert combined == ["partial\n", "second\n"]
    assert stdout == ["partialsecond\n"]


@pytest.mark.timeout(30)
async def test_a_new_writer_on_the_directory_starts_a_new_combined_line(
    tmp_path: pathlib.Path,
) -> None:
    """A new writer on a log directory whose combined.log ends inside a line (a restart after
    the old writer was closed) starts a line of its own (its files were opened write-only, so
    their last byte could not be read: loss markers never started a line of their own either)."""
    for data in (b"epoch 1: 50%", b"restarted\n"):
        writer = ReplicaLogWriter(tmp_path)
        try:
            await _attempt(writer, data, 0.05)
        finally:
            writer.close()
    got = [line async for line in iter_log_lines(tmp_path, Stream.COMBINED)]
    assert got == ["epoch 1: 50%\n", "restarted\n"]
