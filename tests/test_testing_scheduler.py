"""asynctorchx.testing: the scripted in-memory scheduler and its virtual clock, through the runner."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynctorchx import AsyncRunner
from asynctorchx.runner import PollSettings
from asynctorchx.schedulers.api import Stream, UnknownRoleException
from asynctorchx.specs import AppDef, AppState, Role, UnknownAppException
from asynctorchx.testing import (
    AppScript,
    Fault,
    LogLine,
    ScriptedBackend,
    ScriptedScheduler,
    ScriptError,
    Transition,
    VirtualClock,
    lines,
)

#: Status polls 10 s apart: with these settings only a pushed change can wake a waiter in time.
SLOW_POLL = PollSettings(min_interval=10, max_interval=10, push_safety_interval=30)


def app(name: str = "train", role: str = "trainer", replicas: int = 2) -> AppDef:
    return AppDef(name, [Role(role, image="img", entrypoint="train.py", num_replicas=replicas)])


def runner_for(*backends: ScriptedBackend, **kw: Any) -> AsyncRunner:
    return AsyncRunner("t", scheduler_factories={b.name: b for b in backends}, **kw)


LIFE = AppScript(
    states=[(0, AppState.PENDING), (5, AppState.RUNNING), (60, AppState.SUCCEEDED)],
    logs=[
        *lines("trainer", ["epoch 1", "epoch 2", "epoch 3"], start=10, every=20),
        LogLine(15, "trainer", "warning: slow", stream=Stream.STDERR),
        LogLine(20, "trainer", "replica 1 up", replica=1),
    ],
)


async def test_states_follow_the_virtual_clock() -> None:
    """An app is SUBMITTED..RUNNING..SUCCEEDED exactly as the test advances the virtual clock."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", LIFE, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(replicas=2), "slurm")
        seen = []
        for step in (0, 4.9, 0.1, 54.9, 0.1):
            clock.advance(step)
            status = await runner.status(handle)
            assert status is not None
            seen.append(status.state)
        assert seen == [
            AppState.PENDING,
            AppState.PENDING,
            AppState.RUNNING,
            AppState.RUNNING,
            AppState.SUCCEEDED,
        ]
        status = await runner.status(handle)
        assert status is not None
        assert [r.exit_code for r in status.roles[0].replicas] == [0, 0]


async def test_waiters_wake_when_the_clock_passes_a_transition() -> None:
    """A wait() and a watch() wake at once when the clock passes a transition (pushed, not polled)."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", LIFE, clock=clock)
    async with runner_for(slurm, poll_settings=SLOW_POLL) as runner:
        handle = await runner.run(app(), "slurm")
        waiter = asyncio.create_task(runner.wait(handle, timeout=5))
        events = []
        with anyio.fail_after(5):
            async for event in runner.watch([handle]):
                events.append(event.state)
                clock.advance(30)  # each event lets the clock move on
        assert events == [AppState.PENDING, AppState.RUNNING, AppState.SUCCEEDED]
        status = await waiter
        assert status is not None and status.state == AppState.SUCCEEDED


async def test_a_polled_backend_is_described_in_rounds() -> None:
    """With push=False nothing is pushed: the runner's polls see the scripted transitions."""
    clock = VirtualClock()
    slurm = ScriptedBackend(
        "slurm", AppScript(states=[(0, AppState.RUNNING), (1, AppState.FAILED)]), clock=clock
    )
    slurm.push = False
    fast = PollSettings(min_interval=0.01, max_interval=0.02)
    async with runner_for(slurm, poll_settings=fast) as runner:
        handle = await runner.run(app(), "slurm")
        clock.advance(1)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.FAILED
        assert slurm.calls["describe_many"] >= 1


async def test_log_lines_by_replica_stream_regex_and_time() -> None:
    """log_lines serves each replica's scripted lines by stream, regex and since/until, as written so far."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", LIFE, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(replicas=2), "slurm")
        submitted = clock.now()

        async def read(**kw: Any) -> list[str]:
            return [line async for line in runner.log_lines(handle, "trainer", **kw)]

        assert await read() == []
        clock.advance(31)
        assert await read() == ["epoch 1\n", "warning: slow\n", "epoch 2\n"]
        assert await read(streams=Stream.STDOUT) == ["epoch 1\n", "epoch 2\n"]
        assert await read(streams=Stream.STDERR) == ["warning: slow\n"]
        assert await read(k=1) == ["replica 1 up\n"]
        assert await read(regex=r"epoch \d") == ["epoch 1\n", "epoch 2\n"]
        assert await read(since=submitted + timedelta(seconds=15)) == [
            "warning: slow\n",
            "epoch 2\n",
        ]
        assert await read(until=submitted + timedelta(seconds=14)) == ["epoch 1\n"]


async def test_tail_follows_the_clock_and_stops_at_the_end() -> None:
    """should_tail yields each line when the clock reaches it and stops once the app is terminal."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", LIFE, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")
        got: list[str] = []
        clock.advance(10)  # the first line
        with anyio.fail_after(5):
            async for line in runner.log_lines(
                handle, "trainer", should_tail=True, streams=Stream.STDOUT
            ):
                got.append(line)
                clock.advance(20)  # the next line is 20 s later
            assert got == ["epoch 1\n", "epoch 2\n", "epoch 3\n"]
        status = await runner.status(handle)
        assert status is not None and status.state == AppState.SUCCEEDED


async def test_lines_of_a_text_keep_their_newlines() -> None:
    """A scripted text of several lines is served line by line; a final newline is added once."""
    slurm = ScriptedBackend("slurm", AppScript(logs=[LogLine(0, "trainer", "a\r50%\nb\n\nc")]))
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")
        got = [line async for line in runner.log_lines(handle, "trainer")]
        assert got == ["a\r50%\n", "b\n", "\n", "c\n"]


async def test_cancel_waits_out_the_stop_delay_and_cuts_the_script() -> None:
    """cancel() ends the app CANCELLED after stop_delay; later transitions and lines never happen."""
    clock = VirtualClock()
    script = AppScript(
        states=[(0, AppState.RUNNING), (100, AppState.SUCCEEDED)],
        logs=lines("trainer", ["early", "during stop", "late"], start=1, every=10),
        stop_delay=15,
    )
    slurm = ScriptedBackend("slurm", script, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")
        clock.advance(5)
        await runner.cancel(handle)
        await runner.cancel(handle)  # idempotent
        status = await runner.status(handle)
        assert status is not None and status.state == AppState.RUNNING
        clock.advance(15)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.CANCELLED
        assert status.msg == "cancelled"
        assert status.roles[0].replicas[0].exit_code is None
        clock.advance(100)
        assert [line async for line in runner.log_lines(handle, "trainer")] == [
            "early\n",
            "during stop\n",
        ]
        status = await runner.status(handle)
        assert status is not None and status.state == AppState.CANCELLED
        await runner.cancel(handle)  # a terminal app: nothing happens
        assert slurm.app(handle.rsplit("/", 1)[1]).cancelled


async def test_exit_codes_messages_and_restarts() -> None:
    """Scripted exit codes per replica, messages and restart counts are what status reports."""
    clock = VirtualClock()
    script = AppScript(
        states=[
            (0, AppState.RUNNING),
            Transition(10, AppState.RUNNING, msg="restarted", num_restarts=1),
            Transition(20, AppState.FAILED, msg="OOM killed"),
        ],
        exit_codes={"trainer": [0, 137]},
    )
    slurm = ScriptedBackend("slurm", script, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(replicas=2), "slurm")
        clock.advance(10)
        status = await runner.status(handle)
        assert status is not None
        assert (status.state, status.num_restarts, status.msg) == (
            AppState.RUNNING,
            1,
            "restarted",
        )
        assert [r.exit_code for r in status.roles[0].replicas] == [None, None]
        clock.advance(10)
        status = await runner.status(handle)
        assert status is not None
        assert (status.state, status.num_restarts, status.msg) == (
            AppState.FAILED,
            1,
            "OOM killed",
        )
        assert [r.exit_code for r in status.roles[0].replicas] == [0, 137]


async def test_scripts_are_chosen_by_app_name_or_function() -> None:
    """scripts={name: script} or a function picks each app's script; others get the default."""
    ok = AppScript(states=[(0, AppState.SUCCEEDED)])
    bad = AppScript(states=[(0, AppState.FAILED)])
    by_name = ScriptedBackend("a", scripts={"good": ok}, default=bad)
    by_fn = ScriptedBackend("b", scripts=lambda a, cfg: ok if cfg.get("lr") == "0.1" else None)
    async with runner_for(by_name, by_fn) as runner:
        states = {}
        for name in ("good", "other"):
            st = await runner.wait(await runner.run(app(name), "a"), timeout=5)
            states[name] = st.state if st else None
        assert states == {"good": AppState.SUCCEEDED, "other": AppState.FAILED}
        h = await runner.run(app(), "b", {"lr": "0.1"})
        st = await runner.wait(h, timeout=5)
        assert st is not None and st.state == AppState.SUCCEEDED
        h2 = await runner.run(app(), "b", {"lr": "1"})
        st2 = await runner.status(h2)
        assert st2 is not None and st2.state == AppState.RUNNING  # the default script
        assert by_fn.app(h.rsplit("/", 1)[1]).cfg == {"lr": "0.1"}


async def test_list_describe_and_set_state() -> None:
    """list() gives every app with its handle, describe() its roles; set_state moves an app now."""
    slurm = ScriptedBackend("slurm")
    async with runner_for(slurm) as runner:
        h1 = await runner.run(app("one"), "slurm")
        h2 = await runner.run(app("two", role="ps"), "slurm")
        listed = await runner.list("slurm")
        assert [(a.app_handle, a.name, a.state) for a in listed] == [
            (h1, "one", AppState.RUNNING),
            (h2, "two", AppState.RUNNING),
        ]
        described = await runner.describe(h2)
        assert described is not None and [r.name for r in described.roles] == ["ps"]
        slurm.set_state(h1.rsplit("/", 1)[1], AppState.SUCCEEDED, msg="done")
        status = await runner.wait(h1, timeout=5)
        assert status is not None and (status.state, status.msg) == (AppState.SUCCEEDED, "done")
        with pytest.raises(ScriptError, match="already SUCCEEDED: it cannot become RUNNING"):
            slurm.set_state(h1.rsplit("/", 1)[1], AppState.RUNNING)


async def test_faults_raise_at_the_nth_call() -> None:
    """A Fault raises its exception at exactly the n-th call of its operation; a failed submit makes no app."""
    slurm = ScriptedBackend(
        "slurm",
        faults=[
            Fault("submit", 2, RuntimeError("sbatch: slurm_controller is down")),
            Fault("describe", 1, ConnectionError("squeue timed out")),
            Fault("cancel", 1, PermissionError("scancel: access denied")),
            Fault("list", 1, OSError("list failed")),
            Fault("log_iter", 1, OSError("log unreadable")),
        ],
    )
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")
        with pytest.raises(RuntimeError, match="controller is down"):
            await runner.run(app("second"), "slurm")
        assert list(slurm.apps) == ["train-1"]
        await runner.run(app("third"), "slurm")
        assert list(slurm.apps) == ["train-1", "third-2"]
        with pytest.raises(ConnectionError):
            await runner.status(handle)
        assert (st := await runner.status(handle)) is not None and st.state == AppState.RUNNING
        with pytest.raises(PermissionError):
            await runner.cancel(handle)
        with pytest.raises(OSError, match="list failed"):
            await runner.list("slurm")
        with pytest.raises(OSError, match="log unreadable"):
            async for _ in runner.log_lines(handle, "trainer"):
                pass
        assert slurm.calls["submit"] == 3 and slurm.calls["cancel"] == 1


async def test_a_failing_status_round_is_retried_by_the_hub() -> None:
    """A describe_many fault fails one status round; the next round reports the app."""
    clock = VirtualClock()
    slurm = ScriptedBackend(
        "slurm",
        AppScript(states=[(0, AppState.RUNNING), (1, AppState.SUCCEEDED)]),
        clock=clock,
        faults=[Fault("describe_many", 1, ConnectionError("squeue timed out"))],
    )
    fast = PollSettings(min_interval=0.01, max_interval=0.02, push_safety_interval=0.05)
    async with runner_for(slurm, poll_settings=fast) as runner:
        handle = await runner.run(app(), "slurm")
        clock.advance(1)
        status = await runner.wait(handle, timeout=5)
        assert status is not None and status.state == AppState.SUCCEEDED
        assert slurm.calls["describe_many"] >= 2


async def test_submit_latency_runs_on_the_virtual_clock() -> None:
    """With submit_latency, run() returns only once the test advances the clock by that much."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", clock=clock, submit_latency=2)
    async with runner_for(slurm) as runner:
        task = asyncio.create_task(runner.run(app(), "slurm"))
        with anyio.fail_after(5):
            while slurm.in_flight_submits == 0:
                await asyncio.sleep(0)
        clock.advance(1)
        await asyncio.sleep(0)
        assert not task.done() and slurm.apps == {}
        clock.advance(1)
        with anyio.fail_after(5):
            handle = await task
        assert handle == "slurm://t/train-1"


async def test_bad_log_requests_are_clear_errors() -> None:
    """Unknown apps, roles, replicas, streams, regexes and time windows raise the documented errors."""
    clock = VirtualClock()
    slurm = ScriptedBackend("slurm", clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")

        async def read(h: str = handle, role: str = "trainer", **kw: Any) -> None:
            async for _ in runner.log_lines(h, role, **kw):
                pass

        with pytest.raises(UnknownAppException):
            await read("slurm://t/nope-9")
        with pytest.raises(UnknownRoleException, match="no role 'ps'"):
            await read(role="ps")
        with pytest.raises(UnknownRoleException, match="k=3"):
            await read(k=3)
        with pytest.raises(ValueError, match="unsupported log stream 'both'"):
            await read(streams="both")
        with pytest.raises(ValueError, match="invalid log regex"):
            await read(regex="(")
        now = clock.now()
        with pytest.raises(ValueError, match="is after until"):
            await read(since=now, until=now - timedelta(seconds=1))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: AppScript(states=[(0, AppState.SUCCEEDED), (1, AppState.RUNNING)]),
            "states\\[1\\]: a transition to RUNNING at 1 s follows the terminal state SUCCEEDED",
        ),
        (lambda: AppScript(states=[(-1, AppState.RUNNING)]), "at must be .* got -1"),
        (lambda: AppScript(states=[(math.nan, AppState.RUNNING)]), "got nan"),
        (
            lambda: AppScript(states=[(5, AppState.RUNNING), (5, AppState.FAILED)]),
            "times must increase, got 5 s after 5 s",
        ),
        (lambda: AppScript(states=[(0, AppState.UNSUBMITTED)]), "cannot become UNSUBMITTED"),
        (lambda: AppScript(states=[(0, "RUNNING")]), "must be an AppState, got 'RUNNING'"),
        (
            lambda: AppScript(
                states=[(0, AppState.RUNNING), (10, AppState.SUCCEEDED)],
                logs=[LogLine(11, "trainer", "too late")],
            ),
            "logs\\[0\\] at 11 s comes after the app ended \\(SUCCEEDED at 10 s\\): 'too late'",
        ),
        (lambda: LogLine(0, "trainer", "x", replica=-1), "replica must be .* got -1"),
        (lambda: LogLine(0, "trainer", "x", stream=Stream.COMBINED), "STDOUT or Stream.STDERR"),
        (lambda: AppScript(stop_delay=math.inf), "stop_delay must be .* got inf"),
        (lambda: AppScript(exit_codes={"trainer": "0"}), "exit code must be an integer"),
        (lambda: Fault("submitt", 1, RuntimeError()), "one of submit, .* got 'submitt'"),
        (lambda: Fault("submit", 0, RuntimeError()), "call must be an integer >= 1, got 0"),
        (lambda: Fault("submit", 1, RuntimeError), "exception instance"),
        (lambda: VirtualClock().advance(-1), "advance must be .* got -1"),
        (lambda: ScriptedBackend("slurm", submit_latency=-2), "submit_latency .* got -2"),
    ],
)
def test_inconsistent_scripts_are_clear_errors(make: Any, message: str) -> None:
    """An inconsistent script, fault or clock step raises ScriptError/ValueError naming the value."""
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (
            AppScript(logs=[LogLine(0, "ps", "x")]),
            "logs\\[0\\] names role 'ps', which the app does not have \\(roles: trainer\\)",
        ),
        (
            AppScript(logs=[LogLine(0, "trainer", "x", replica=2)]),
            "names replica 2 of role 'trainer', which has 2 replica",
        ),
        (AppScript(exit_codes={"ps": 1}), "exit_codes names role 'ps'"),
        (AppScript(exit_codes={"trainer": [0]}), "has 1 code\\(s\\) for 2 replica"),
    ],
)
async def test_a_script_that_does_not_fit_its_app_fails_the_submit(
    script: AppScript, message: str
) -> None:
    """A script naming a role or replica the app lacks fails run() with a ScriptError; no app is made."""
    slurm = ScriptedBackend("slurm", script)
    async with runner_for(slurm) as runner:
        with pytest.raises(ScriptError, match=message):
            await runner.run(app(replicas=2), "slurm")
        assert slurm.apps == {}


async def test_registering_under_another_name_is_an_error() -> None:
    """A ScriptedBackend registered under a name it does not answer to fails with both names."""
    backend = ScriptedBackend("slurm")
    async with AsyncRunner("t", scheduler_factories={"local_cwd": backend}) as runner:
        with pytest.raises(ValueError, match="as 'local_cwd' made a scheduler of backend 'slurm'"):
            await runner.run(app(), "local_cwd")
    assert backend.apps == {}


async def test_virtual_clock_sleep_and_timers() -> None:
    """VirtualClock.sleep returns when the clock is advanced past it, never before; advance_to rejects the past."""
    clock = VirtualClock()
    woke: list[float] = []

    async def sleeper(d: float) -> None:
        await clock.sleep(d)
        woke.append(clock.monotonic())

    tasks = [asyncio.create_task(sleeper(d)) for d in (3, 1, 2)]
    with anyio.fail_after(5):
        while clock.pending_timers < 3:
            await asyncio.sleep(0)
    clock.advance(1.5)
    await asyncio.sleep(0)
    assert woke == [1.5]  # the 1 s sleeper, woken when the test advanced to 1.5
    clock.advance(10)
    with anyio.fail_after(5):
        await asyncio.gather(*tasks)
    assert sorted(woke) == [1.5, 11.5, 11.5]
    with pytest.raises(ValueError, match="in the past"):
        clock.advance_to(3)


def test_the_readme_example_passes_as_written(tmp_path: Path) -> None:
    """The README's complete pytest example for asynctorchx.testing runs and its 2 tests pass."""
    root = Path(__file__).resolve().parent.parent
    section = (root / "README.md").read_text().split("### Testing code that uses the runner", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "def test_" in code
    (tmp_path / "test_readme_example.py").write_text(code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_readme_example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


@pytest.mark.parametrize("push", [True, False])
async def test_waiters_share_status_rounds_seen_in_the_call_log(push: bool) -> None:
    """200 waiters cost describe_many rounds (recorded with their app ids), never a describe each."""
    slurm = ScriptedBackend("slurm", push=push)
    fast = PollSettings(min_interval=0.01, max_interval=0.05, push_safety_interval=0.2)
    async with runner_for(slurm, poll_settings=fast) as runner:
        handles = [await runner.run(app(f"a{i}"), "slurm") for i in range(200)]
        waiters = [asyncio.create_task(runner.wait(h, timeout=10)) for h in handles]
        await slurm.wait_until(lambda: slurm.described >= set(slurm.apps))
        assert not any(w.done() for w in waiters)  # they wait on the hub, which saw them RUNNING
        for app_id in slurm.apps:
            slurm.set_state(app_id, AppState.SUCCEEDED)
        results = await asyncio.gather(*waiters)
        assert all(r is not None and r.state == AppState.SUCCEEDED for r in results)
        rounds = [c.app_ids for c in slurm.call_log if c.operation == "describe_many"]
        assert len(rounds) == runner.hub("slurm").rounds < 50
        assert slurm.calls["describe"] == 0
        view = runner._schedulers["slurm"]
    assert isinstance(view, ScriptedScheduler) and view.closed


async def test_a_10000_line_log_is_tailed_as_the_clock_moves() -> None:
    """A 10 000-line script is tailed completely, each line once, as the virtual clock passes it."""
    clock = VirtualClock()
    script = AppScript(
        states=[(0, AppState.RUNNING), (10_000, AppState.SUCCEEDED)],
        logs=lines("trainer", [f"line {i}" for i in range(10_000)], every=1),
    )
    slurm = ScriptedBackend("slurm", script, clock=clock)
    async with runner_for(slurm) as runner:
        handle = await runner.run(app(), "slurm")
        got: list[str] = []
        clock.advance(100)
        with anyio.fail_after(30):
            async for line in runner.log_lines(handle, "trainer", should_tail=True):
                got.append(line)
                if len(got) % 100 == 0:
                    clock.advance(100)
        assert got == [f"line {i}\n" for i in range(10_000)]
