"""iter_log_lines: reading and following log files written by real child processes through real pipes."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio
import pytest
from _logs_env import run_child, spawn
from conftest import engine_missing

from asynctorchx.logs import (
    INDEX_FILE,
    ReplicaLogWriter,
    Stream,
    _inotify,
    _notify,
    iter_log_lines,
    wake_readers,
)
from asynctorchx.logs._files import INDEX_MAGIC, RECORD


async def read_all(directory: pathlib.Path, *args: object, **kwargs: object) -> list[str]:
    """Every line ``iter_log_lines(directory, ...)`` yields."""
    return [line async for line in iter_log_lines(directory, *args, **kwargs)]  # type: ignore[arg-type]


class Child:
    """A child process whose output a follower reads; ``finished`` is true once it exited and drained."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.writer = ReplicaLogWriter(directory)
        self.proc: asyncio.subprocess.Process | None = None
        self.done = False
        self.checks = 0

    async def start(self, code: str, *args: str, stdin: int | None = None) -> None:
        self.proc = await spawn(self.writer, code, *args, stdin=stdin)

    async def finished(self) -> bool:
        self.checks += 1
        return self.done

    async def wait(self) -> None:
        assert self.proc is not None
        await self.proc.wait()
        await self.writer.wait_drained()
        self.done = True
        wake_readers(self.writer.directory)

    async def aclose(self) -> None:
        if self.proc is not None:
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
        self.writer.close()


async def follow(child: Child, *args: object, **kwargs: object) -> list[str]:
    """Follows the child's log until it is finished, while it runs."""
    lines: list[str] = []

    async def reader() -> None:
        async for line in iter_log_lines(
            child.writer.directory,
            *args,  # type: ignore[arg-type]
            follow=True,
            is_finished=child.finished,
            **kwargs,  # type: ignore[arg-type]
        ):
            lines.append(line)

    task = asyncio.create_task(reader())
    try:
        await child.wait()
        await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
        await child.aclose()
    return lines


# -- reading what exists ---------------------------------------------------------------------------


async def test_lines_keep_their_newline_and_the_last_partial_line(tmp_path: pathlib.Path) -> None:
    """Lines end with \\n; an unterminated last line is yielded as is; empty lines are kept."""
    await run_child(tmp_path, "import sys; sys.stdout.write('a\\n\\nb\\nno newline')")
    assert await read_all(tmp_path) == ["a\n", "\n", "b\n", "no newline"]


async def test_each_stream_reads_its_own_file(tmp_path: pathlib.Path) -> None:
    """STDOUT, STDERR and COMBINED (the default) select what is read; names work as strings."""
    code = "import sys; print('o1', flush=True); print('e1', file=sys.stderr, flush=True)"
    await run_child(tmp_path, code)
    assert await read_all(tmp_path, Stream.STDOUT) == ["o1\n"]
    assert await read_all(tmp_path, Stream.STDERR) == ["e1\n"]
    assert await read_all(tmp_path, "stderr") == ["e1\n"]
    assert sorted(await read_all(tmp_path)) == ["e1\n", "o1\n"]


async def test_regex_keeps_matching_lines(tmp_path: pathlib.Path) -> None:
    """Only lines where regex.search matches are yielded, \\n still attached."""
    import re

    await run_child(tmp_path, "for i in range(10): print(f'step {i} loss {i * 0.5}')")
    lines = await read_all(tmp_path, regex=re.compile(r"step [37] "))
    assert lines == ["step 3 loss 1.5\n", "step 7 loss 3.5\n"]


async def test_a_1mb_line_comes_back_whole(tmp_path: pathlib.Path) -> None:
    """A single 1 MB line written in many pieces is one line, not split at any size."""
    code = (
        "import sys\n"
        "for i in range(256): sys.stdout.write('x' * 4096); sys.stdout.flush()\n"
        "sys.stdout.write('\\nafter\\n')\n"
    )
    await run_child(tmp_path, code)
    lines = await read_all(tmp_path)
    assert lines == ["x" * (1 << 20) + "\n", "after\n"]


async def test_carriage_return_progress_bar_passes_through(tmp_path: pathlib.Path) -> None:
    """\\r progress updates stay inside one line; \\r\\n endings are kept."""
    code = (
        "import sys\n"
        "for p in range(0, 101, 25): sys.stdout.write(f'\\rprogress {p}%'); sys.stdout.flush()\n"
        "sys.stdout.write('\\ndone\\r\\n')\n"
    )
    await run_child(tmp_path, code)
    assert await read_all(tmp_path) == [
        "\rprogress 0%\rprogress 25%\rprogress 50%\rprogress 75%\rprogress 100%\n",
        "done\r\n",
    ]


async def test_invalid_utf8_is_replaced_not_raised(tmp_path: pathlib.Path) -> None:
    """Bytes that are not UTF-8 become U+FFFD; valid multi-byte characters survive."""
    code = "import sys; sys.stdout.buffer.write(b'ok \\xff\\xfe bad\\n\\xe2\\x82\\nh\\xc3\\xa9\\xe2\\x82')"
    await run_child(tmp_path, code)
    assert await read_all(tmp_path) == ["ok \ufffd\ufffd bad\n", "\ufffd\n", "hé\ufffd"]


async def test_unicode_line_separators_do_not_split_lines(tmp_path: pathlib.Path) -> None:
    """Only \\n ends a line: \\x0b, \\x0c, \\x1c, \\x85 and \\u2028 stay inside."""
    text = "a\x0bb\x0cc\x1cd\x85e\u2028f\u2029g\n"
    await run_child(tmp_path, f"import sys; sys.stdout.write({text!r})")
    assert await read_all(tmp_path) == [text]


async def test_200k_lines_read_back_byte_exact(tmp_path: pathlib.Path) -> None:
    """200 000 lines written by the child read back exactly, in order."""
    code = "w = __import__('sys').stdout.write\nfor i in range(200000): w(f'line {i:07d} ' + 'é' * (i % 7) + '\\n')\n"
    await run_child(tmp_path, code)
    expected = "".join(f"line {i:07d} " + "é" * (i % 7) + "\n" for i in range(200000))
    lines = await read_all(tmp_path)
    assert len(lines) == 200000
    assert "".join(lines) == expected


async def test_missing_directory_or_file_yields_nothing(tmp_path: pathlib.Path) -> None:
    """Without follow, a log that does not exist yet yields no line (and raises nothing)."""
    assert await read_all(tmp_path / "nope") == []
    (tmp_path / "empty").mkdir()
    assert await read_all(tmp_path / "empty", Stream.STDERR) == []


async def test_a_read_returns_what_exists_while_the_writer_runs(tmp_path: pathlib.Path) -> None:
    """Without follow, a log still being written is read up to its current end, partial line
    included: the stream's own file at once, the combined one once the partial line has waited
    its turn there (``_TAIL_WAIT``: it is held back so that the other stream's lines never land
    inside it)."""
    child = Child(tmp_path)
    await child.start(
        "import sys; sys.stdout.write('one\\ntwo'); sys.stdout.flush(); sys.stdin.readline()",
        stdin=asyncio.subprocess.PIPE,
    )
    try:
        async for _ in iter_log_lines(tmp_path, follow=True, is_finished=child.finished):
            break
        assert await read_all(tmp_path, Stream.STDOUT) == ["one\n", "two"]
        with anyio.fail_after(5):
            while (combined := await read_all(tmp_path)) != ["one\n", "two"]:
                assert combined == ["one\n"], combined
                await asyncio.sleep(0.02)
    finally:
        await child.aclose()


# -- since / until ---------------------------------------------------------------------------------

WINDOW_CHILD = (
    "import sys, time\n"
    "def batch(tag):\n"
    "    for i in range(3): print(f'{tag} {i}', flush=True)\n"
    "    print(f'{tag}-end {time.time()}', file=sys.stderr, flush=True)\n"
    "batch('A'); time.sleep(0.3); batch('B'); time.sleep(0.3); batch('C')\n"
    "sys.stdout.write('half '); sys.stdout.flush(); time.sleep(0.3); print('line', flush=True)\n"
)


def chunk_times(directory: pathlib.Path) -> list[tuple[float, bytes]]:
    """(time read, bytes) of every chunk of combined.log, from the timing index."""
    data = (directory / "combined.log").read_bytes()
    body = (directory / INDEX_FILE).read_bytes()[len(INDEX_MAGIC) :]
    return [
        (t / 1e9, data[c_off : c_off + length])
        for t, _s_off, c_off, length, _sid in RECORD.iter_unpack(body)
    ]


def gap(chunks: list[tuple[float, bytes]], before: bytes, after: bytes) -> float:
    """The middle of the pause between the chunk holding ``before`` and the one holding ``after``."""
    t_before = next(t for t, text in chunks if before in text)
    t_after = next(t for t, text in chunks if after in text)
    assert t_after - t_before > 0.1, (before, after)
    return (t_before + t_after) / 2


async def window_log(tmp_path: pathlib.Path) -> tuple[float, float, float]:
    """Runs WINDOW_CHILD; returns the middles of its pauses: after A, after B, inside 'half line'."""
    await run_child(tmp_path, WINDOW_CHILD)
    chunks = chunk_times(tmp_path)
    return (
        gap(chunks, b"A-end", b"B 0"),
        gap(chunks, b"B-end", b"C 0"),
        gap(chunks, b"half", b"line"),
    )


async def test_since_and_until_select_the_lines_written_in_the_window(
    tmp_path: pathlib.Path,
) -> None:
    """since/until pick the batches written between them, per stream and combined."""
    after_a, after_b, _ = await window_log(tmp_path)
    since, until = after_a, after_b
    assert await read_all(tmp_path, Stream.STDOUT, since=since, until=until) == [
        "B 0\n",
        "B 1\n",
        "B 2\n",
    ]
    assert [line.split()[0] for line in await read_all(tmp_path, since=since, until=until)] == [
        "B",
        "B",
        "B",
        "B-end",
    ]
    assert await read_all(tmp_path, Stream.STDOUT, until=after_a) == ["A 0\n", "A 1\n", "A 2\n"]
    assert [line[0] for line in await read_all(tmp_path, Stream.STDOUT, since=after_b)] == [
        "C",
        "C",
        "C",
        "h",
    ]


async def test_windows_with_nothing_inside_yield_nothing(tmp_path: pathlib.Path) -> None:
    """A window before the first or after the last write is empty; so is one between two writes."""
    after_a, _, _ = await window_log(tmp_path)
    assert await read_all(tmp_path, since=time.time() + 60) == []
    assert await read_all(tmp_path, until=after_a - 60) == []
    assert await read_all(tmp_path, since=after_a - 0.01, until=after_a + 0.01) == []


async def test_a_line_written_partly_inside_the_window_is_kept(tmp_path: pathlib.Path) -> None:
    """A line started before since and finished after it is yielded whole (likewise across until)."""
    _, _, inside = await window_log(tmp_path)
    assert await read_all(tmp_path, Stream.STDOUT, since=inside) == ["half line\n"]
    assert (await read_all(tmp_path, Stream.STDOUT, until=inside))[-1] == "half line\n"


async def test_since_and_until_combine_with_regex(tmp_path: pathlib.Path) -> None:
    """regex filters the lines of the window."""
    import re

    after_a, after_b, _ = await window_log(tmp_path)
    lines = await read_all(tmp_path, since=after_a, until=after_b, regex=re.compile(r"^B [12]$"))
    assert lines == ["B 1\n", "B 2\n"]


async def test_a_file_without_index_is_timed_by_its_mtime(tmp_path: pathlib.Path) -> None:
    """A plain log (as Slurm writes) is wholly inside a window containing its mtime, else outside."""
    (tmp_path / "stdout.log").write_bytes(b"one\ntwo\n")
    os.utime(tmp_path / "stdout.log", (1000.0, 1000.0))
    assert await read_all(tmp_path, Stream.STDOUT, since=999.0) == ["one\n", "two\n"]
    assert await read_all(tmp_path, Stream.STDOUT, since=1001.0) == []
    assert await read_all(tmp_path, Stream.STDOUT, until=999.0) == []
    assert await read_all(tmp_path, Stream.STDOUT, since=999.0, until=1000.5) == ["one\n", "two\n"]


# -- bad arguments ---------------------------------------------------------------------------------


def test_since_after_until_is_refused(tmp_path: pathlib.Path) -> None:
    """since > until raises ValueError naming both, before anything is read."""
    with pytest.raises(ValueError, match=r"since .* is after until"):
        iter_log_lines(tmp_path, since=20.0, until=10.0)


def test_unknown_stream_is_refused(tmp_path: pathlib.Path) -> None:
    """An unknown stream raises ValueError naming it and the supported ones."""
    with pytest.raises(ValueError, match=r"'stdlog'.*stdout, stderr, combined"):
        iter_log_lines(tmp_path, "stdlog")  # type: ignore[arg-type]


def test_times_must_be_numbers(tmp_path: pathlib.Path) -> None:
    """since/until are POSIX timestamps; anything else raises TypeError naming the argument."""
    import datetime

    with pytest.raises(TypeError, match="since"):
        iter_log_lines(tmp_path, since=datetime.datetime.now())  # type: ignore[arg-type]


def test_poll_interval_must_be_positive(tmp_path: pathlib.Path) -> None:
    """A zero or negative poll_interval raises ValueError."""
    with pytest.raises(ValueError, match="poll_interval"):
        iter_log_lines(tmp_path, follow=True, poll_interval=0)


# -- following --------------------------------------------------------------------------------------


async def test_follow_yields_lines_as_written_then_drains_the_partial_last_line(
    tmp_path: pathlib.Path,
) -> None:
    """A follower sees each line while the child runs and the unterminated last line once it is done."""
    child = Child(tmp_path)
    code = (
        "import sys\n"
        "for i in range(3):\n"
        "    print(f'line {i}', flush=True); sys.stdin.readline()\n"
        "sys.stdout.write('tail without newline')\n"
    )
    await child.start(code, stdin=asyncio.subprocess.PIPE)
    assert child.proc is not None and child.proc.stdin is not None
    seen = []
    try:
        async for line in iter_log_lines(tmp_path, follow=True, is_finished=child.finished):
            seen.append(line)
            if line.startswith("line"):
                child.proc.stdin.write(b"\n")
                await child.proc.stdin.drain()
            if len(seen) == 3:
                await child.wait()
    finally:
        await child.aclose()
    assert seen == ["line 0\n", "line 1\n", "line 2\n", "tail without newline"]


async def test_follow_waits_for_a_missing_directory(tmp_path: pathlib.Path) -> None:
    """A follower started before the log directory exists picks the log up once it is created."""
    directory = tmp_path / "app" / "role" / "0"
    lines: list[str] = []
    children: list[Child] = []

    async def finished() -> bool:
        return bool(children) and children[0].done

    async def reader() -> None:
        async for line in iter_log_lines(directory, follow=True, is_finished=finished):
            lines.append(line)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    child = Child(directory)
    children.append(child)
    await child.start("print('hello'); print('world')")
    await child.wait()
    await asyncio.wait_for(task, 30)
    await child.aclose()
    assert lines == ["hello\n", "world\n"]


async def test_follow_stops_when_finished_even_if_the_file_never_appears(
    tmp_path: pathlib.Path,
) -> None:
    """A follower of a missing log stops (yielding nothing) once is_finished says so."""
    calls = 0

    async def finished() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 2

    lines = await asyncio.wait_for(
        read_all(tmp_path / "never", follow=True, is_finished=finished), 10
    )
    assert lines == []


async def test_follow_200k_lines_byte_exact_while_written(tmp_path: pathlib.Path) -> None:
    """A follower reading while 200 000 lines are written gets them all, exactly, in order."""
    code = "w = __import__('sys').stdout.write\nfor i in range(200000): w(f'line {i:07d} ' + 'é' * (i % 7) + '\\n')\n"
    expected = "".join(f"line {i:07d} " + "é" * (i % 7) + "\n" for i in range(200000))
    child = Child(tmp_path)
    await child.start(code)
    lines = await follow(child)
    assert len(lines) == 200000
    assert "".join(lines) == expected


async def test_follow_a_1mb_line_written_in_pieces(tmp_path: pathlib.Path) -> None:
    """A follower yields a 1 MB line once, whole, after its last piece arrives."""
    code = (
        "import sys\n"
        "for i in range(256): sys.stdout.write('y' * 4096); sys.stdout.flush()\n"
        "sys.stdout.write('\\n')\n"
    )
    child = Child(tmp_path)
    await child.start(code)
    assert await follow(child, Stream.STDOUT) == ["y" * (1 << 20) + "\n"]


async def test_follow_progress_bar_and_invalid_utf8(tmp_path: pathlib.Path) -> None:
    """A follower passes \\r progress lines through and replaces invalid UTF-8."""
    code = (
        "import sys\n"
        "for p in (0, 50, 100): sys.stdout.write(f'\\r{p}%'); sys.stdout.flush()\n"
        "sys.stdout.buffer.write(b'\\n\\xff\\n'); sys.stdout.flush()\n"
    )
    child = Child(tmp_path)
    await child.start(code)
    assert await follow(child) == ["\r0%\r50%\r100%\n", "\ufffd\n"]


async def test_follow_each_stream_and_regex(tmp_path: pathlib.Path) -> None:
    """A follower reads the selected stream only and applies the regex."""
    import re

    code = "import sys\nfor i in range(6): print(f'{i}', file=sys.stderr if i % 2 else sys.stdout, flush=True)"
    child = Child(tmp_path)
    await child.start(code)
    assert await follow(child, Stream.STDERR, regex=re.compile("[35]")) == ["3\n", "5\n"]


async def test_follow_with_since_skips_older_lines(tmp_path: pathlib.Path) -> None:
    """A follower with since yields only lines written after it."""
    code = (
        "import sys, time\n"
        "print('old', flush=True); print(time.time(), file=sys.stderr, flush=True)\n"
        "sys.stdin.readline(); print('new', flush=True)\n"
    )
    child = Child(tmp_path)
    await child.start(code, stdin=asyncio.subprocess.PIPE)
    assert child.proc is not None and child.proc.stdin is not None
    async for _ in iter_log_lines(tmp_path, Stream.STDERR, follow=True, is_finished=child.finished):
        break
    since = time.time()
    child.proc.stdin.write(b"go\n")
    await child.proc.stdin.drain()
    child.proc.stdin.close()
    assert await follow(child, Stream.STDOUT, since=since) == ["new\n"]


async def test_follow_with_until_stops_after_the_window(tmp_path: pathlib.Path) -> None:
    """A follower with until stops once later output arrives, without being told the app finished."""
    code = (
        "import sys, time\n"
        "print('early', flush=True); sys.stdin.readline(); print('late', flush=True); time.sleep(30)\n"
    )
    child = Child(tmp_path)
    await child.start(code, stdin=asyncio.subprocess.PIPE)
    assert child.proc is not None and child.proc.stdin is not None
    try:
        async for _ in iter_log_lines(tmp_path, follow=True, is_finished=child.finished):
            break
        until = time.time()
        lines = []
        async for line in iter_log_lines(tmp_path, follow=True, until=until):
            lines.append(line)
            child.proc.stdin.write(b"go\n")
            await child.proc.stdin.drain()
    finally:
        await child.aclose()
    assert lines == ["early\n"]


async def test_final_read_waits_for_an_undrained_writer(tmp_path: pathlib.Path) -> None:
    """When is_finished is already true, the follower still gets what a writer here has not drained yet."""
    child = Child(tmp_path)
    code = "import time\nfor i in range(5): print(i, flush=True); time.sleep(0.05)\n"
    await child.start(code)

    async def finished() -> bool:
        return True

    try:
        lines = await read_all(tmp_path, follow=True, is_finished=finished)
    finally:
        await child.wait()
        await child.aclose()
    assert lines == [f"{i}\n" for i in range(5)]


async def test_no_busy_loop_while_idle(tmp_path: pathlib.Path) -> None:
    """While nothing is written, is_finished is called a bounded number of times (back-off to 1 s)."""
    child = Child(tmp_path)
    await child.start(
        "import sys; print('up', flush=True); sys.stdin.readline()", stdin=asyncio.subprocess.PIPE
    )
    assert child.proc is not None and child.proc.stdin is not None
    lines = []

    async def reader() -> None:
        async for line in iter_log_lines(tmp_path, follow=True, is_finished=child.finished):
            lines.append(line)

    task = asyncio.create_task(reader())
    try:
        while not lines:
            await asyncio.sleep(0.01)
        before = child.checks
        await asyncio.sleep(1.5)
        idle_checks = child.checks - before
        child.proc.stdin.close()
        await child.wait()
        await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await child.aclose()
    assert idle_checks <= 10
    assert lines == ["up\n"]


async def test_steady_output_does_not_check_finished_per_chunk(tmp_path: pathlib.Path) -> None:
    """A follower of 200 separate writes calls is_finished far fewer times than it wakes for data."""
    code = "import time\nfor i in range(200): print(i, flush=True); time.sleep(0.003)\n"
    child = Child(tmp_path)
    await child.start(code)
    lines = await follow(child, Stream.STDOUT)
    assert lines == [f"{i}\n" for i in range(200)]
    assert child.checks < 40


async def test_output_on_the_other_stream_does_not_wake_a_follower(tmp_path: pathlib.Path) -> None:
    """A stdout follower is not woken (nor checks is_finished) for each chunk written to stderr."""
    code = (
        "import sys, time\n"
        "for i in range(200): print(i, file=sys.stderr, flush=True); time.sleep(0.003)\n"
        "print('only line', flush=True)\n"
    )
    child = Child(tmp_path)
    await child.start(code)
    assert await follow(child, Stream.STDOUT) == ["only line\n"]
    assert child.checks < 40


async def test_closing_a_follower_releases_its_wakers_and_watches(tmp_path: pathlib.Path) -> None:
    """Breaking out of a follower unregisters it and closes the inotify instance it used."""
    child = Child(tmp_path)
    await child.start(
        "import sys; print('x', flush=True); sys.stdin.readline()", stdin=asyncio.subprocess.PIPE
    )
    try:
        lines = iter_log_lines(tmp_path, follow=True, is_finished=child.finished)
        async for _ in lines:
            break
        await lines.aclose()
        assert _notify.directory_key(tmp_path) not in _notify._wakers
        assert asyncio.get_running_loop() not in _inotify._hubs
    finally:
        await child.aclose()


class HoldingExecutor(ThreadPoolExecutor):
    """One worker thread; while ``hold`` is set, each call submitted waits in the queue behind a
    job that blocks until ``release`` is set (so that it can be cancelled before it starts)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.hold = False
        self.held = asyncio.Event()
        self.release = threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.hold:
            super().submit(self.release.wait)
            self.held.set()
        return super().submit(fn, *args, **kwargs)


def open_fds_on(directory: pathlib.Path) -> list[str]:
    """The files under ``directory`` this process has descriptors on."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [t for t in targets if t.startswith(f"{directory}{os.sep}")]


async def test_a_follower_cancelled_while_its_read_waits_for_a_thread_closes_its_file(
    tmp_path: pathlib.Path,
) -> None:
    """A follower cancelled while its next read is still queued for a worker thread closes its log
    file (the queued read, cancelled before it started, kept it open for good)."""
    (tmp_path / "combined.log").write_text("first\n")
    executor = HoldingExecutor()
    asyncio.get_running_loop().set_default_executor(executor)
    got = asyncio.Event()

    async def finished() -> bool:
        return False

    async def reader() -> None:
        async for _ in iter_log_lines(
            tmp_path, follow=True, is_finished=finished, poll_interval=0.05
        ):
            got.set()

    task = asyncio.create_task(reader())
    try:
        with anyio.fail_after(20):
            await got.wait()
            assert open_fds_on(tmp_path) == [str(tmp_path / "combined.log")]
            executor.hold = True
            await executor.held.wait()  # the follower's next poll is queued behind the held job
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            executor.hold = False
            executor.release.set()
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, 0)  # queue drained
        assert open_fds_on(tmp_path) == []
    finally:
        task.cancel()
        executor.release.set()
        executor.shutdown(wait=True)


# -- other processes ------------------------------------------------------------------------------

FOLLOWER = """
import asyncio, logging, pathlib, sys
from asynctorchx.logs import iter_log_lines
handler = logging.StreamHandler(sys.stderr)
logging.getLogger("asynctorchx.logs").addHandler(handler)
logging.getLogger("asynctorchx.logs").setLevel(logging.DEBUG)
directory = pathlib.Path(sys.argv[1])
done = pathlib.Path(sys.argv[2])
checks = 0
async def finished():
    global checks
    checks += 1
    return done.exists()
async def main():
    async for line in iter_log_lines(directory, follow=True, is_finished=finished):
        sys.stdout.write(line)
        sys.stdout.flush()
    print(f"checks={checks}", file=sys.stderr)
asyncio.run(main())
"""


async def follow_from_another_process(
    tmp_path: pathlib.Path, env: dict[str, str]
) -> tuple[str, str]:
    """Runs FOLLOWER in a subprocess while this process writes a log; returns its stdout, stderr."""
    directory = tmp_path / "logs" / "0"
    done = tmp_path / "done"
    follower = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FOLLOWER,
        str(directory),
        str(done),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert follower.stdout is not None
    child = Child(directory)
    code = (
        "import sys\nfor i in range(5):\n    print(f'line {i}', flush=True); sys.stdin.readline()\n"
    )
    await child.start(code, stdin=asyncio.subprocess.PIPE)
    assert child.proc is not None and child.proc.stdin is not None
    try:
        for i in range(5):
            got = await asyncio.wait_for(follower.stdout.readline(), 20)
            assert got == f"line {i}\n".encode()
            child.proc.stdin.write(b"\n")
            await child.proc.stdin.drain()
        await child.wait()
        done.touch()
        out, err = await asyncio.wait_for(follower.communicate(), 20)
    finally:
        if follower.returncode is None:
            follower.kill()
            await follower.wait()
        await child.aclose()
    assert follower.returncode == 0, err
    return out.decode(), err.decode()


async def test_a_follower_in_another_process_wakes_through_inotify(tmp_path: pathlib.Path) -> None:
    """A follower in a second process gets each line as it is written, woken by inotify, checking is_finished rarely."""
    if not _inotify.available():
        engine_missing("inotify")
    _, err = await follow_from_another_process(tmp_path, {})
    assert "woken by inotify" in err
    checks = int(err.rsplit("checks=", 1)[1])
    assert checks <= 10


async def test_a_follower_without_inotify_falls_back_to_polling(tmp_path: pathlib.Path) -> None:
    """With inotify disabled, a follower in a second process still gets every line, by polling."""
    _, err = await follow_from_another_process(tmp_path, {_inotify.DISABLE_ENV: "1"})
    assert "woken by inotify" not in err
    assert "woken by timer" in err


async def test_regex_may_be_a_string(tmp_path: pathlib.Path) -> None:
    """A string regex is compiled; an invalid one raises ValueError naming it."""
    await run_child(tmp_path, "print('keep me'); print('drop me')")
    assert await read_all(tmp_path, regex="^keep") == ["keep me\n"]
    with pytest.raises(ValueError, match=r"invalid log regex '\('"):
        iter_log_lines(tmp_path, regex="(")


async def test_a_follower_on_another_event_loop_is_woken_by_the_writer(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower running its own loop in another thread is woken directly by this loop's writer."""
    import logging
    import threading

    caplog.set_level(logging.DEBUG, logger="asynctorchx.logs")
    child = Child(tmp_path)
    finished = threading.Event()
    lines: list[str] = []

    async def follower() -> None:
        async def done() -> bool:
            return finished.is_set()

        async for line in iter_log_lines(tmp_path, follow=True, is_finished=done):
            lines.append(line)

    thread = threading.Thread(target=lambda: asyncio.run(follower()))
    thread.start()
    try:
        await child.start("import time\nfor i in range(3): print(i, flush=True); time.sleep(0.05)")
        await child.wait()
    finally:
        finished.set()
        wake_readers(tmp_path)
        await asyncio.to_thread(thread.join, 20)
        await child.aclose()
    assert lines == ["0\n", "1\n", "2\n"]
    assert "woken by data" in caplog.text


def test_the_logs_package_does_not_import_backends() -> None:
    """asynctorchx.logs sits below the backends: importing it loads no scheduler module."""
    import subprocess

    code = (
        "import sys, asynctorchx.logs\n"
        "bad = [m for m in sys.modules if m.startswith('asynctorchx.schedulers.') "
        "and m != 'asynctorchx.schedulers.api']\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_wake_readers_takes_a_reason_by_value_and_names_a_bad_one(tmp_path: pathlib.Path) -> None:
    """wake_readers accepts a Wake or its value; anything else is a ValueError naming it."""
    from asynctorchx.logs import Wake

    wake_readers(tmp_path, Wake.STATE)
    wake_readers(tmp_path, "eof")
    with pytest.raises(ValueError, match="got 'bogus'"):
        wake_readers(tmp_path, "bogus")


@pytest.mark.parametrize("kind", ["dangling-link", "file"])
async def test_a_follower_whose_log_path_is_not_a_directory_waits_quietly(
    tmp_path: pathlib.Path, kind: str
) -> None:
    """The log directory's path is a dangling symbolic link or a regular file: a follower waits
    for the app to finish, asking a few times a second at most (it spun, asking thousands of
    times a second, on a core), and ends when it has."""
    directory = tmp_path / "app" / "replica0"
    directory.parent.mkdir()
    if kind == "file":
        directory.write_text("x")
    else:
        directory.symlink_to(tmp_path / "gone")
    asked = 0
    finished = asyncio.Event()

    async def is_finished() -> bool:
        nonlocal asked
        asked += 1
        return finished.is_set()

    follower = asyncio.create_task(read_all(directory, follow=True, is_finished=is_finished))
    await asyncio.sleep(1.0)  # (a stretch of the follower's idle life, counted)
    asked_in_a_second = asked
    finished.set()
    with anyio.fail_after(10):
        assert await follower == []
    assert asked_in_a_second < 50


async def test_a_follower_with_until_in_the_past_ends_although_the_last_line_is_open(
    tmp_path: pathlib.Path,
) -> None:
    """The last line of the window is still open (a progress bar's ``\\r`` updates, no newline)
    and ``until`` passed long ago while the app runs on: the follower yields what a plain read
    of the window yields and ends, instead of waiting for the app."""
    t0 = time.time_ns() - 3600 * 10**9
    done, step1, step2 = b"epoch 1 done\n", b"\rstep 1/100", b"\rstep 2/100"
    index = (
        INDEX_MAGIC
        + RECORD.pack(t0, 0, 0, len(done), 0)
        + RECORD.pack(t0 + 10**9, len(done), len(done), len(step1), 0)
        + RECORD.pack(time.time_ns(), len(done + step1), len(done + step1), len(step2), 0)
    )
    (tmp_path / INDEX_FILE).write_bytes(index)
    for name in ("stdout.log", "combined.log"):
        (tmp_path / name).write_bytes(done + step1 + step2)
    until = (t0 + 2 * 10**9) / 1e9
    plain = await read_all(tmp_path, until=until)
    assert plain[0] == "epoch 1 done\n" and plain[-1].startswith("\rstep 1/100")

    async def running() -> bool:
        return False

    with anyio.fail_after(10):
        followed = await read_all(tmp_path, until=until, follow=True, is_finished=running)
    assert followed == plain


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_since_or_until_that_is_not_a_finite_time_is_a_value_error(
    tmp_path: pathlib.Path, bad: float
) -> None:
    with pytest.raises(ValueError, match="since must be a finite POSIX timestamp"):
        iter_log_lines(tmp_path, since=bad)
    with pytest.raises(ValueError, match="until must be a finite POSIX timestamp"):
        iter_log_lines(tmp_path, until=bad)


_OPEN_AT_LIMIT = """
import os, resource, sys
from asynctorchx.logs._reader import open_regular
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    open_regular(sys.argv[1])
except OSError as e:
    print(e)
"""


@pytest.mark.timeout(60)
def test_a_log_read_at_the_descriptor_limit_says_which_limit(tmp_path: pathlib.Path) -> None:
    """Opening a log with no descriptor left fails naming the file and the limit to raise (it was
    a bare "Too many open files")."""
    import subprocess

    log = tmp_path / "combined.log"
    log.write_text("x\n")
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_AT_LIMIT, str(log)],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout
    assert "Too many open files" in out and "ulimit -n" in out and str(log) in out, out
