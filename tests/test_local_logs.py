"""log_iter of the local backends end to end: real replicas writing, the scheduler reading back."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, wait_for

from asynctorchx.logs import _match
from asynctorchx.logs._match import SlowLogRegexError
from asynctorchx.schedulers.api import Stream
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role


@pytest.fixture
async def sched(tmp_path: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("logs", local_root=tmp_path / "root")
    yield s
    await s.close()


def py_app(code: str, **env: str) -> AppDef:
    return AppDef(
        "logs", [Role("main", image="x", entrypoint=sys.executable, args=["-c", code], env=env)]
    )


async def run_to_end(s: LocalScheduler, app: AppDef) -> str:
    app_id = await s.submit(app, {})
    assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
    return app_id


async def read(s: LocalScheduler, app_id: str, **kw: Any) -> list[str]:
    return [line async for line in s.log_iter(app_id, "main", **kw)]


async def test_many_lines_byte_exact(sched: LocalScheduler) -> None:
    """200 000 lines come back exactly as the replica wrote them, in order."""
    code = "import sys\nw=sys.stdout.write\nfor i in range(200000): w(f'line {i:06d} ' + 'x'*(i % 50) + '\\n')\n"
    app_id = await run_to_end(sched, py_app(code))
    got = await read(sched, app_id, streams=Stream.STDOUT)
    assert got == [f"line {i:06d} " + "x" * (i % 50) + "\n" for i in range(200000)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("unbuffered", [True, False], ids=["python-u", "block-buffered"])
async def test_combined_never_mixes_the_lines_of_the_two_streams(
    sched: LocalScheduler, unbuffered: bool
) -> None:
    """A Python replica printing to stdout and stderr (unbuffered, as training jobs often run,
    or block-buffered, whose 8 KiB writes end inside lines): every line arrives whole in the
    combined stream (lines such as 'out 214err 215' and a lone newline came out: a line cut
    where its pipe was read and the other stream's line glued to it)."""
    n, every = 20000, 1 if unbuffered else 50
    code = (
        "import sys\n"
        f"for i in range({n}):\n"
        "    print(f'out {i}')\n"
        f"    if i % {every} == 0: print(f'err {{i}}', file=sys.stderr)\n"
    )
    role = Role(
        "main",
        image="x",
        entrypoint=sys.executable,
        args=[*(["-u"] if unbuffered else []), "-c", code],
    )
    app_id = await sched.submit(AppDef("logs", [role]), {})
    assert (await wait_for(sched, app_id, timeout=60)).state == AppState.SUCCEEDED
    expected = [f"out {i}\n" for i in range(n)] + [f"err {i}\n" for i in range(0, n, every)]
    assert sorted(await read(sched, app_id)) == sorted(expected)


async def test_the_unterminated_last_lines_of_both_streams_stay_apart(
    sched: LocalScheduler,
) -> None:
    """Both streams end with a line without its newline, the first one shown (held) a while
    before the second is written: two lines in the combined stream, not 'out-lasterr-last'."""
    code = (
        "import sys, time\n"
        "sys.stdout.write('out-last'); sys.stdout.flush(); time.sleep(0.3)\n"
        "sys.stderr.write('err-last'); sys.stderr.flush()\n"
    )
    app_id = await run_to_end(sched, py_app(code))
    assert await read(sched, app_id) == ["out-last\n", "err-last"]
    assert await read(sched, app_id, streams=Stream.STDOUT) == ["out-last"]


async def test_long_line_progress_bar_and_bad_utf8(sched: LocalScheduler) -> None:
    """A 1 MB line is never split, \\r stays inside a line, invalid UTF-8 is replaced, a last partial line is kept."""
    code = (
        "import sys\nout=sys.stdout.buffer\n"
        "out.write(b'y'*1048576 + b'\\n')\n"
        "out.write(b'10%\\r50%\\r100%\\n')\n"
        "out.write(b'bad \\xff\\xfe byte\\n')\n"
        "out.write(b'no newline')\n"
    )
    app_id = await run_to_end(sched, py_app(code))
    got = await read(sched, app_id, streams=Stream.STDOUT)
    assert got == [
        "y" * 1048576 + "\n",
        "10%\r50%\r100%\n",
        "bad \ufffd\ufffd byte\n",
        "no newline",
    ]


async def test_streams_are_kept_apart_and_combined(sched: LocalScheduler) -> None:
    """stdout.log and stderr.log hold their own stream in order; combined holds both."""
    code = (
        "import sys\n"
        "for i in range(50):\n"
        "    s = sys.stdout if i % 2 else sys.stderr\n"
        "    s.write(f'{i}\\n'); s.flush()\n"
    )
    app_id = await run_to_end(sched, py_app(code))
    assert await read(sched, app_id, streams=Stream.STDOUT) == [f"{i}\n" for i in range(1, 50, 2)]
    assert await read(sched, app_id, streams=Stream.STDERR) == [f"{i}\n" for i in range(0, 50, 2)]
    combined = await read(sched, app_id)
    assert sorted(combined, key=int) == [f"{i}\n" for i in range(50)]


async def test_since_and_until(sched: LocalScheduler, tmp_path: Path) -> None:
    """since/until select the lines written after or before a moment."""
    go = tmp_path / "go"
    app = AppDef(
        "t",
        [
            Role(
                "main",
                image="x",
                entrypoint="sh",
                args=["-c", f"echo before; {GATE}; echo after"],
                env={"GO": str(go)},
            )
        ],
    )
    app_id = await sched.submit(app, {})
    with anyio.fail_after(15):
        async for line in sched.log_iter(app_id, "main", should_tail=True):
            if line == "before\n":
                await asyncio.sleep(0.05)  # keep the two writes apart in time (not synchronisation)
                middle = datetime.now()
                await asyncio.sleep(0.05)
                go.touch()
    assert await read(sched, app_id, since=middle) == ["after\n"]
    assert await read(sched, app_id, until=middle) == ["before\n"]
    assert await read(sched, app_id, since=middle, until=datetime.now()) == ["after\n"]


async def test_tail_drains_what_is_left(sched: LocalScheduler) -> None:
    """A tail started while the app runs yields everything, the last burst included, then stops."""
    code = "import sys,time\nprint('start', flush=True)\ntime.sleep(0.2)\nsys.stdout.write(''.join(f'{i}\\n' for i in range(5000)))\n"
    app_id = await sched.submit(py_app(code), {})
    with anyio.fail_after(20):
        got = await read(sched, app_id, should_tail=True)
    assert got == ["start\n", *[f"{i}\n" for i in range(5000)]]


TOLERANCE = timedelta(milliseconds=10)
STAMPED = (
    "import sys, time\n"
    "for i in range(5):\n"
    "    if i: time.sleep(0.1)\n"
    "    t = time.time()\n"
    "    sys.stdout.write(f'line {i} {t:.6f}\\n'); sys.stdout.flush()\n"
)


async def test_since_and_until_within_10_ms(sched: LocalScheduler) -> None:
    """since/until placed 10 ms either side of the moment the app printed a line include/exclude it."""
    app_id = await run_to_end(sched, py_app(STAMPED))
    lines = await read(sched, app_id)
    assert [ln.split()[:2] for ln in lines] == [["line", str(i)] for i in range(5)]
    written = [datetime.fromtimestamp(float(ln.split()[2])) for ln in lines]
    assert all(b - a >= timedelta(milliseconds=100) for a, b in itertools.pairwise(written))
    for i, t in enumerate(written):
        early, late = t - TOLERANCE, t + TOLERANCE
        assert await read(sched, app_id, since=early) == lines[i:], f"since {i} - 10 ms"
        assert await read(sched, app_id, since=late) == lines[i + 1 :], f"since {i} + 10 ms"
        assert await read(sched, app_id, until=late) == lines[: i + 1], f"until {i} + 10 ms"
        assert await read(sched, app_id, until=early) == lines[:i], f"until {i} - 10 ms"
        assert await read(sched, app_id, since=early, until=late) == [lines[i]], f"window {i}"


# An irregular interleaving, so neither "all stdout then all stderr" nor strict alternation matches.
PATTERN = "oeeoeoooeeeoeoeeoooe"


async def test_combined_keeps_arrival_order(sched: LocalScheduler, tmp_path: Path) -> None:
    """Writes alternating between stdout and stderr, each acknowledged before the next, come back
    from the combined stream in exactly the order they were written."""
    acks = tmp_path / "acks"
    acks.mkdir()
    code = (
        "import os, sys, time\n"
        f"pattern, acks = {PATTERN!r}, os.environ['ACKS']\n"
        "for i, c in enumerate(pattern):\n"
        "    s = sys.stdout if c == 'o' else sys.stderr\n"
        "    s.write(f'{c}{i} ' + 'word' * (len(pattern) - i) + '\\n'); s.flush()\n"
        "    deadline = time.monotonic() + 20\n"
        "    while not os.path.exists(os.path.join(acks, str(i))):\n"
        "        if time.monotonic() > deadline: sys.exit(9)\n"
        "        time.sleep(0.002)\n"
    )
    expected = [f"{c}{i} " + "word" * (len(PATTERN) - i) + "\n" for i, c in enumerate(PATTERN)]
    app_id = await sched.submit(py_app(code, ACKS=str(acks)), {})
    tailed = []
    with anyio.fail_after(30):
        async for line in sched.log_iter(app_id, "main", should_tail=True, streams=Stream.COMBINED):
            tailed.append(line)
            (acks / line.split()[0][1:]).touch()  # the handshake: the app writes the next line now
    assert tailed == expected
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert await read(sched, app_id, streams=Stream.COMBINED) == expected
    assert await read(sched, app_id, streams=Stream.STDOUT) == [x for x in expected if x[0] == "o"]
    assert await read(sched, app_id, streams=Stream.STDERR) == [x for x in expected if x[0] == "e"]
    assert len(os.listdir(acks)) == len(PATTERN)


class _LoopGaps:
    """The longest time the event loop went without running a 10 ms ticker, while in use."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self.longest = max(self.longest, time.monotonic() - t)

    async def __aenter__(self) -> _LoopGaps:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        await asyncio.sleep(0.05)  # (the gap a filter made is recorded by the next tick)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.mark.timeout(60)
async def test_a_catastrophic_regex_neither_freezes_the_loop_nor_runs_for_ever(
    sched: LocalScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regex filter that takes exponential time on one line ((a|aa)+$ against 40 a's and a b)
    is matched off the event loop (the loop was frozen for the whole match: every other app's
    wait and follower with it) and given up after its time bound with an error naming it."""
    monkeypatch.setattr(_match, "LINE_TIMEOUT", 1.0)
    app_id = await run_to_end(sched, py_app("print('aab'); print('a' * 40 + 'b')"))
    async with _LoopGaps() as gaps:
        with pytest.raises(SlowLogRegexError, match=r"\(a\|aa\)\+\$.* more than 1 s"):
            await read(sched, app_id, regex=r"(a|aa)+$")
    assert gaps.longest < 0.3, f"the event loop was held {gaps.longest:.2f} s"
    # an ordinary filter is matched as before (on the loop)
    assert await read(sched, app_id, regex=r"a+b$") == ["aab\n", "a" * 40 + "b\n"]
