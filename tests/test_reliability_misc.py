"""Faults found by trying to break the runner, the CLI and the log reader (issue 12, items 11-13).

Each test reproduces one fault on the real local backend (real processes, real files) or, for the
hub's pacing, on the in-memory scheduler, and pins what happens now.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_scheduler import FakeScheduler
from _logs_env import run_child, spawn

from asynctorchx import AsyncRunner
from asynctorchx.logs import Stream, iter_log_lines, wake_readers
from asynctorchx.runner import PollSettings
from asynctorchx.specs import AppDef, AppState, Role

LOCAL = "local_cwd"


def sh_app(script: str, name: str = "app", **role_kw: Any) -> AppDef:
    """A one-role app running ``sh -c script``."""
    return AppDef(name, [Role("main", image=".", entrypoint="sh", args=["-c", script], **role_kw)])


def session() -> str:
    return f"rm-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def ended(root: Path) -> AsyncIterator[tuple[str, str]]:
    """(session, handle) of a local app that succeeded, launched by a runner that is closed now."""
    name = session()
    async with AsyncRunner(name=name, local_root=str(root)) as runner:
        handle = await runner.run(sh_app("echo done"), LOCAL)
        status = await runner.wait(handle, timeout=30)
        assert status is not None and status.state == AppState.SUCCEEDED
    yield name, handle


# -- 11. a terminal app is reported terminal whatever the timeout ---------------------------------


@pytest.mark.parametrize("timeout", [0, 0.01])
async def test_wait_with_zero_timeout_reports_an_ended_app_on_a_fresh_runner(
    root: Path, ended: tuple[str, str], timeout: float
) -> None:
    """wait(h, timeout=0 or 0.01) on a fresh runner returns the final status of an app that ended."""
    name, handle = ended
    async with AsyncRunner(name=name, local_root=str(root)) as runner:
        with anyio.fail_after(30):
            status = await runner.wait(handle, timeout=timeout)
    assert status is not None and status.state == AppState.SUCCEEDED


async def test_wait_all_and_as_completed_with_zero_timeout_report_ended_apps(
    root: Path, ended: tuple[str, str]
) -> None:
    """wait_all and as_completed with timeout=0 yield ended apps, then time out on a running one."""
    name, handle = ended
    async with AsyncRunner(name=name, local_root=str(root)) as runner:
        with anyio.fail_after(30):
            done = await runner.wait_all([handle], timeout=0)
            assert done[handle] is not None and done[handle].state == AppState.SUCCEEDED
            running = await runner.run(sh_app("sleep 30"), LOCAL)
            seen = []
            with pytest.raises(TimeoutError):
                async for h, status in runner.as_completed([running, handle], timeout=0):
                    seen.append((h, None if status is None else status.state))
            assert seen == [(handle, AppState.SUCCEEDED)]
            st = await runner.status(running)
            assert st is not None and st.state == AppState.RUNNING
            await runner.cancel(running)


async def test_wait_with_a_deadline_asks_the_scheduler_instead_of_trusting_a_stale_state() -> None:
    """wait(timeout=0) on an app the hub last saw RUNNING, slow polling, returns its new final state."""
    made: list[FakeScheduler] = []

    def factory(session_name: str, **params: Any) -> FakeScheduler:
        made.append(FakeScheduler(session_name, **params))
        return made[-1]

    slow = PollSettings(min_interval=60, max_interval=60)
    async with AsyncRunner("t", scheduler_factories={"fake": factory}, poll_settings=slow) as r:
        handle = await r.run(AppDef("a", [Role("w", image="i", entrypoint="true")]), "fake")
        with anyio.fail_after(10):
            await made[0].wait_described("fake-0")
            made[0].set_state("fake-0", AppState.SUCCEEDED)  # the hub polls again in 60 s only
            status = await r.wait(handle, timeout=0)
        assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
async def test_wait_rejects_a_negative_or_nan_timeout(root: Path, bad: float) -> None:
    """wait/as_completed with a negative or NaN timeout raise ValueError naming the value."""
    async with AsyncRunner(name=session(), local_root=str(root)) as runner:
        with pytest.raises(ValueError, match=r"timeout must be .* got"):
            await runner.wait(f"{LOCAL}://{runner.name}/x", timeout=bad)
        with pytest.raises(ValueError, match=r"timeout must be .* got"):
            await runner.wait_all([f"{LOCAL}://{runner.name}/x"], timeout=bad)


@pytest.mark.parametrize("bad", ["5", True, b"1", [1]])
async def test_wait_rejects_a_timeout_that_is_not_a_number(root: Path, bad: object) -> None:
    """wait/wait_all with a string, bool or other non-number timeout raise ValueError naming it."""
    async with AsyncRunner(name=session(), local_root=str(root)) as runner:
        with pytest.raises(ValueError, match=r"timeout must be .* got " + re.escape(repr(bad))):
            await runner.wait(f"{LOCAL}://{runner.name}/x", timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"timeout must be .* got " + re.escape(repr(bad))):
            await runner.wait_all([f"{LOCAL}://{runner.name}/x"], timeout=bad)  # type: ignore[arg-type]


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "asynctorchx"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "asynctorchx"]
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": ""}
    return subprocess.run(
        [*exe, *args], env=env, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.parametrize("timeout", ["0", "0.01"])
def test_cli_wait_with_zero_timeout_reports_an_ended_app(tmp_path: Path, timeout: str) -> None:
    """`wait --timeout 0` on an app that ended prints its state, exits 0 and warns of nothing."""
    root = tmp_path / "state"
    run = _cli(root, "run", "utils.sh", "--", "true")
    assert run.returncode == 0, run.stderr
    handle = run.stdout.strip()
    result = _cli(root, "wait", "--timeout", timeout, handle)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1:] == [handle, "SUCCEEDED"]
    assert result.stderr == ""


def test_cli_wait_with_zero_timeout_on_a_running_app_exits_124(tmp_path: Path) -> None:
    """`wait --timeout 0` on a running app prints RUNNING, says it still runs, exits 124."""
    root = tmp_path / "state"
    go = tmp_path / "go"
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": ""}
    script = Path(sys.executable).parent / "asynctorchx"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "asynctorchx"]
    gate = f'while [ ! -e "{go}" ]; do sleep 0.01; done'
    run = subprocess.Popen(
        [*exe, "run", "utils.sh", "--", "sh", "-c", gate],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert run.stdout is not None
        handle = run.stdout.readline().strip()
        result = _cli(root, "wait", "--timeout", "0", handle)
        assert result.returncode == 124, result.stderr
        assert result.stdout.split()[1:] in ([handle, "RUNNING"], [handle, "PENDING"])
        assert f"still running: {handle}" in result.stderr
        assert "never awaited" not in result.stderr
    finally:
        go.touch()
        try:
            run.wait(timeout=30)
        finally:
            run.kill()
            run.communicate()


# -- 12. replica ranges are parsed in linear time, errors stay one line ---------------------------


@pytest.fixture(scope="module")
def four_replicas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(state root, handle) of a finished local app whose role 'sh' has four replicas."""
    root = tmp_path_factory.mktemp("ranges") / "state"
    run = _cli(root, "run", "utils.sh", "--num_replicas", "4", "--", "sh", "-c", "echo $RANK")
    assert run.returncode == 0, run.stderr
    return root, run.stdout.strip()


@pytest.mark.parametrize(
    ("ids", "named"),
    [("0-99999999", "4-99999999"), ("0-20000", "4-20000"), ("1,7,2-3,9-12,40,50", "7, 9-12, 40")],
)
def test_log_with_a_huge_replica_range_fails_at_once_with_one_short_line(
    four_replicas: tuple[Path, str], ids: str, named: str
) -> None:
    """`log H/role/0-99999999` on a 4-replica role exits 2 with one short line naming the bad ids."""
    root, handle = four_replicas
    result = _cli(root, "log", f"{handle}/sh/{ids}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) < 400, result.stderr[:1000]
    assert f"has no replica {named}" in lines[0] and "(its replicas: 0-3)" in lines[0]


def test_log_with_overlapping_ranges_prints_each_replica_once_in_the_order_given(
    four_replicas: tuple[Path, str],
) -> None:
    """`log H/sh/2,0-3,1-2,3` prints replicas 2, 0, 1, 3 once each, in that order."""
    root, handle = four_replicas
    result = _cli(root, "log", f"{handle}/sh/2,0-3,1-2,3" + ",0-3" * 5000)
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == [
        "sh/2",
        "sh/0",
        "sh/1",
        "sh/3",
    ]


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ("5-2", "replica range '5-2' .* is empty"),
        ("x", "replica 'x' .* is not an id or a range"),
        ("\u0663", "is not an id or a range"),  # a Unicode digit: isdigit() but not an id
        ("0-" + "9" * 5000, r"\(5002 characters\) .* is beyond any replica count"),
    ],
    ids=["empty", "word", "unicode-digit", "5000-digits"],
)
def test_bad_replica_ids_are_one_short_usage_error(ids: str, error: str) -> None:
    """An empty range, a non-id or a 5000-digit id is a one-line CliError of bounded length."""
    from asynctorchx.cli._errors import CliError
    from asynctorchx.cli.cmd_log import parse_target

    with pytest.raises(CliError, match=error) as info:
        parse_target(f"local_cwd://s/a/sh/{ids}")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_replica_ids_take_each_id_once_however_much_ranges_overlap() -> None:
    """replica_ids keeps the given order, drops repeats, and handles 10^5 overlapping ranges."""
    from asynctorchx.cli.cmd_log import ReplicaRange, replica_ids

    assert replica_ids([ReplicaRange(3, 3), ReplicaRange(0, 5), ReplicaRange(2, 4)], 6) == [
        3,
        0,
        1,
        2,
        4,
        5,
    ]
    many = [ReplicaRange(0, 9_999)] * 100_000
    assert replica_ids(many, 10_000) == list(range(10_000))


# -- 13. a line is never split, and reading it back costs about twice its size at most ------------

#: Lines of this many bytes are read back with a bounded memory cost (an exact multiple of 1 MiB).
LONG = 128 << 20
#: Reading a line of N bytes may hold it as bytes and as str at once while it is decoded: 2 N.
BOUND = 2.5

MEASURE_CHILD = r"""
import json, resource, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE)
size, head, tail = 0, b"", b""
while chunk := proc.stdout.read(1 << 20):
    if not head:
        head = chunk[:200]
    tail = (tail + chunk)[-200:]
    size += len(chunk)
code = proc.wait()
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps([code, size, peak, head.decode(), tail.decode()]))
"""


def _peak(root: Path, *argv: str) -> tuple[int, int, int, str, str]:
    """(exit code, stdout bytes, peak RSS in bytes, first and last 200 bytes) of a fresh command."""
    env = {**os.environ, "ASYNCTORCHX_LOCAL_ROOT": str(root), "TORCHXCONFIG": ""}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE_CHILD, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout
    code, size, rss_kib, head, tail = json.loads(out)
    assert rss_kib > 0, "no peak RSS measured"
    return code, size, rss_kib * 1024, head, tail


@pytest.fixture(scope="module")
def long_line_app(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(root, handle of an app that printed one LONG-byte line, handle of one that printed 'x')."""
    root = tmp_path_factory.mktemp("long") / "state"
    handles = []
    for size in (LONG, 1):
        script = f"head -c {size} /dev/zero | tr '\\0' x; echo"
        run = _cli(root, "run", "utils.sh", "--", "sh", "-c", script)
        assert run.returncode == 0, run.stderr
        handles.append(run.stdout.strip())
    return root, handles[0], handles[1]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_cli_log_of_a_128mib_line_prints_it_whole_within_2_5x_its_size(
    long_line_app: tuple[Path, str, str], as_json: bool
) -> None:
    """`asynctorchx log` of a 128 MiB line prints it whole; its peak RSS grows < 2.5x the line."""
    root, handle, small = long_line_app
    script = Path(sys.executable).parent / "asynctorchx"
    exe = [str(script)] if script.exists() else [sys.executable, "-m", "asynctorchx"]
    flags = ["--json"] if as_json else []
    _, _, baseline, _, _ = _peak(root, *exe, "log", *flags, small)
    code, size, peak, head, tail = _peak(root, *exe, "log", *flags, handle)
    assert code == 0
    if as_json:
        empty = json.dumps(
            {"handle": handle, "role": "sh", "replica": 0, "stream": None, "line": ""}
        )
        assert head.startswith(empty[:-2] + "xxxx") and tail.endswith('xxxx"}\n')
        assert size == len(empty) + LONG + 1
    else:
        assert head.startswith("sh/0 | xxxx") and tail.endswith("xxxx\n")
        assert size == len("sh/0 | ") + LONG + 1
    assert peak - baseline < BOUND * LONG, f"peak {peak >> 20} MiB, baseline {baseline >> 20} MiB"


# VmHWM, not ru_maxrss: a child started with vfork inherits its parent's ru_maxrss at exec
READ_CHILD = r"""
import asyncio, pathlib, sys
from asynctorchx.logs import iter_log_lines
def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
async def main():
    before = peak()
    sizes = []
    async for line in iter_log_lines(pathlib.Path(sys.argv[1])):
        sizes.append(len(line))
        del line  # the consumer keeps nothing: what is measured is the reader's own cost
    print(sizes, peak() - before)
asyncio.run(main())
"""


def test_reading_two_128mib_progress_lines_costs_under_2_5x_a_line(tmp_path: Path) -> None:
    """iter_log_lines of two 128 MiB lines full of \\r grows its process < 2.5x one line."""
    progress = b"y" * ((1 << 20) - 1) + b"\r"
    with open(tmp_path / "combined.log", "wb") as f:
        for _ in range(2):
            for _ in range(LONG >> 20):
                f.write(progress)
            f.write(b"\n")
    out = subprocess.run(
        [sys.executable, "-c", READ_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout.split()
    assert out[:2] == [f"[{LONG + 1},", f"{LONG + 1}]"]
    assert int(out[2]) < BOUND * LONG, f"grew {int(out[2]) >> 20} MiB"


def _long_line_script() -> tuple[str, list[str]]:
    """A child's code writing lines around the long-line threshold, and the lines it writes."""
    big = 5 << 20
    code = (
        "import sys\n"
        "w = sys.stdout.buffer.write\n"
        "w(b'a\\n')\n"
        f"for i in range({big} // 4096): w(b'x' * 4096); sys.stdout.flush()\n"
        "w(b'\\nb\\n')\n"
        f"w(('\\u00e9' * ({big} // 2 - 1) + '\\r').encode())\n"
        "w(b'\\nmiddle\\n' + b'z' * (3 << 20) + b'\\n')\n"
        "w(b'\\xff' * (3 << 20))\n"  # an unterminated last line of invalid UTF-8
    )
    lines = [
        "a\n",
        "x" * big + "\n",
        "b\n",
        "\u00e9" * (big // 2 - 1) + "\r\n",
        "middle\n",
        "z" * (3 << 20) + "\n",
        "\ufffd" * (3 << 20),
    ]
    return code, lines


async def test_lines_longer_than_the_read_block_come_back_whole(tmp_path: Path) -> None:
    """Lines of 3-5 MiB (ASCII, non-ASCII with \\r, invalid UTF-8, unterminated) read back exactly."""
    code, lines = _long_line_script()
    await run_child(tmp_path, code)
    with anyio.fail_after(30):
        got = [line async for line in iter_log_lines(tmp_path)]
        assert got == lines
        windowed = [line async for line in iter_log_lines(tmp_path, since=0.0, until=2e9)]
        assert windowed == lines
        assert [line async for line in iter_log_lines(tmp_path, since=3e9)] == []
        assert [line async for line in iter_log_lines(tmp_path, regex="^z")] == [lines[5]]


async def test_a_follower_yields_long_lines_whole(tmp_path: Path) -> None:
    """A follower yields the 3-5 MiB lines exactly, the unterminated last one once finished."""
    from asynctorchx.logs import ReplicaLogWriter

    code, lines = _long_line_script()
    writer = ReplicaLogWriter(tmp_path)
    done = False

    async def finished() -> bool:
        return done

    got: list[str] = []
    try:
        with anyio.fail_after(30):
            proc = await spawn(writer, code)
            async with anyio.create_task_group() as tg:

                async def read() -> None:
                    async for line in iter_log_lines(
                        tmp_path, Stream.STDOUT, follow=True, is_finished=finished
                    ):
                        got.append(line)

                tg.start_soon(read)
                await proc.wait()
                await writer.wait_drained()
                done = True
                wake_readers(tmp_path)
    finally:
        writer.close()
    assert got == lines


def test_a_long_line_is_printed_exactly_as_a_short_one_would_be() -> None:
    """LogPrinter writes a line longer than its slice size as the same text and JSON, unsplit."""
    import io

    from asynctorchx.cli._logs import _WRITE_SLICE, LogPrinter, app_replicas

    replicas = app_replicas([("trainer", 1)])
    line = ('q"\\\u00e9\x01\t' * (_WRITE_SLICE // 3)) + "end\n"
    text, as_json = io.StringIO(), io.StringIO()
    LogPrinter("h", replicas, text).write(replicas[0], "stderr", line)
    LogPrinter("h", replicas, as_json, as_json=True).write(replicas[0], "stdout", line)
    assert text.getvalue() == "trainer/0 ! " + line
    record = {"handle": "h", "role": "trainer", "replica": 0, "stream": "stdout", "line": line[:-1]}
    assert as_json.getvalue() == json.dumps(record, ensure_ascii=False) + "\n"
