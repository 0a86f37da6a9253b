"""runner.launched and runner.launch_group: apps that live no longer than the code that needs them.

The cancellation paths run real local processes and check that no process survives; the timing
corners (a cancellation during the submission, a clean-up that cannot finish) use the scripted
backend on a virtual clock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import poll_until

from asynctorchx import AsyncRunner
from asynctorchx.runner import GangFailedError
from asynctorchx.schedulers._local.procs import pid_alive
from asynctorchx.specs import AppDef, AppState, AppStatus, Role, is_terminal
from asynctorchx.testing import AppScript, Fault, ScriptedBackend, VirtualClock

if sys.version_info >= (3, 11):
    from builtins import ExceptionGroup
else:  # pragma: no cover
    from exceptiongroup import ExceptionGroup

LOCAL = "local_cwd"


def sh_app(script: str, name: str = "app") -> AppDef:
    return AppDef(name, [Role("main", image=".", entrypoint="sh", args=["-c", script])])


def with_child(pid_file: Path, name: str = "app") -> AppDef:
    """An app whose replica starts a child (``sleep 60``), writes the child's pid, and waits."""
    return sh_app(f"sleep 60 & echo $! > {pid_file}; wait", name)


@pytest.fixture
async def runner(tmp_path: Path) -> AsyncIterator[AsyncRunner]:
    async with AsyncRunner(
        name=f"launch-{uuid.uuid4().hex[:8]}", local_root=str(tmp_path / "state")
    ) as r:
        yield r


async def pids_of(runner: AsyncRunner, handle: str, pid_file: Path) -> list[int]:
    """The replica's pid and its child's, once both run."""
    await poll_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the child")
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    replica = status.roles[0].replicas[0].pid
    assert replica is not None
    pids = [replica, int(pid_file.read_text())]
    assert all(pid_alive(p) for p in pids)
    return pids


async def final_state(runner: AsyncRunner, handle: str) -> AppState:
    """The app's state now, which must already be terminal (the block waited for it)."""
    status = await runner.status(handle)
    assert status is not None and is_terminal(status.state), status
    return status.state


async def test_cancelling_the_enclosing_task_cancels_the_app_and_leaves_no_survivor(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """Cancelling the task inside launched() cancels the app; when the task ends, it is CANCELLED and no process survives."""
    handles: list[str] = []
    started = asyncio.Event()

    async def service() -> None:
        async with runner.launched(with_child(tmp_path / "child.pid"), LOCAL) as handle:
            handles.append(handle)
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(service())
    with anyio.fail_after(20):
        await started.wait()
    pids = await pids_of(runner, handles[0], tmp_path / "child.pid")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert await final_state(runner, handles[0]) == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_an_exception_in_the_block_cancels_the_app(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """An exception leaving the block propagates after the app was cancelled and its processes ended."""
    with pytest.raises(ValueError, match="bad request"):
        async with runner.launched(with_child(tmp_path / "child.pid"), LOCAL) as handle:
            pids = await pids_of(runner, handle, tmp_path / "child.pid")
            raise ValueError("bad request")
    assert await final_state(runner, handle) == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_a_normal_exit_keeps_the_app_running(runner: AsyncRunner, tmp_path: Path) -> None:
    """When the block ends normally the app keeps running (until cancelled explicitly)."""
    async with runner.launched(with_child(tmp_path / "child.pid"), LOCAL) as handle:
        pids = await pids_of(runner, handle, tmp_path / "child.pid")
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    assert all(pid_alive(p) for p in pids)
    await runner.cancel(handle)
    status = await runner.wait(handle, timeout=30)
    assert status is not None and status.state == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_cancel_on_normal_exit_cancels_at_the_end_of_the_block(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """With cancel_on_normal_exit=True a normal exit also cancels the app and waits for its end."""
    async with runner.launched(
        with_child(tmp_path / "child.pid"), LOCAL, cancel_on_normal_exit=True
    ) as handle:
        pids = await pids_of(runner, handle, tmp_path / "child.pid")
    assert await final_state(runner, handle) == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_cancel_on_exit_false_keeps_the_app_after_an_exception(runner: AsyncRunner) -> None:
    """With cancel_on_exit=False an exception leaves the app running."""
    with pytest.raises(KeyError):
        async with runner.launched(sh_app("sleep 60"), LOCAL, cancel_on_exit=False) as handle:
            raise KeyError("x")
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    await runner.cancel(handle)


async def test_an_anyio_timeout_around_the_block_cancels_the_app(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """A move_on_after around the block cancels it; the clean-up still runs to the app's end."""
    with anyio.move_on_after(1) as scope:
        async with runner.launched(with_child(tmp_path / "child.pid"), LOCAL) as handle:
            pids = await pids_of(runner, handle, tmp_path / "child.pid")
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert await final_state(runner, handle) == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_a_component_is_launched_with_its_arguments(runner: AsyncRunner) -> None:
    """launched() takes a component name with component_args, as run_component does."""
    with pytest.raises(RuntimeError, match="stop"):
        async with runner.launched("utils.sh", LOCAL, component_args=["sleep", "60"]) as handle:
            assert handle.startswith(f"{LOCAL}://{runner.name}/sh-")
            raise RuntimeError("stop")
    assert await final_state(runner, handle) == AppState.CANCELLED


async def test_gang_one_failure_cancels_the_others(runner: AsyncRunner, tmp_path: Path) -> None:
    """In a gang, an app that fails cancels the block and every other app; GangFailedError names it."""
    go = tmp_path / "go"
    pids: list[int] = []
    with pytest.raises(GangFailedError) as caught:
        async with runner.launch_group(gang=True) as group:
            survivors = [
                await group.launch(with_child(tmp_path / f"c{i}.pid", f"ok{i}"), LOCAL)
                for i in range(2)
            ]
            failing = await group.launch(
                sh_app(f'while [ ! -e "{go}" ]; do sleep 0.01; done; exit 3', "bad"), LOCAL
            )
            for i, h in enumerate(survivors):
                pids += await pids_of(runner, h, tmp_path / f"c{i}.pid")
            go.touch()
            await group.wait(timeout=60)  # interrupted by the failure
            pytest.fail("the gang's failure did not end the block")
    assert caught.value.handle == failing
    assert caught.value.status is not None and caught.value.status.state == AppState.FAILED
    assert await final_state(runner, failing) == AppState.FAILED
    for h in survivors:
        assert await final_state(runner, h) == AppState.CANCELLED
    await poll_until(lambda: not any(pid_alive(p) for p in pids), "the processes to be gone")


async def test_gang_an_exception_in_the_block_cancels_every_app(runner: AsyncRunner) -> None:
    """In a gang, an exception in the block cancels all its apps before it propagates."""
    with pytest.raises(ZeroDivisionError):
        async with runner.launch_group(gang=True) as group:
            handles = [await group.launch(sh_app("sleep 60"), LOCAL) for _ in range(3)]
            _ = 1 / 0
    for h in handles:
        assert await final_state(runner, h) == AppState.CANCELLED


async def test_a_group_that_is_no_gang_keeps_the_others_when_one_fails(
    runner: AsyncRunner,
) -> None:
    """Without gang=True, one app failing does not touch the others; wait() reports every final state."""
    async with runner.launch_group() as group:
        ok = await group.launch(sh_app("exit 0", "ok"), LOCAL)
        bad = await group.launch(sh_app("exit 3", "bad"), LOCAL)
        results = await group.wait(timeout=60)
    assert {h: st.state for h, st in results.items() if st} == {
        ok: AppState.SUCCEEDED,
        bad: AppState.FAILED,
    }
    assert group.handles == [ok, bad]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")
async def test_a_task_group_of_launched_apps_is_cancelled_when_one_fails(
    runner: AsyncRunner, tmp_path: Path
) -> None:
    """In an asyncio.TaskGroup, a task whose app fails cancels its siblings, whose apps are cancelled."""
    handles: dict[str, str] = {}

    async def trial(name: str, script: str) -> AppStatus:
        async with runner.launched(sh_app(script, name), LOCAL) as handle:
            handles[name] = handle
            status = await runner.wait(handle)
            assert status is not None
            status.raise_for_status()
            return status

    go = tmp_path / "go"
    with pytest.raises(ExceptionGroup) as caught:
        async with asyncio.TaskGroup() as tg:
            for i in range(3):
                tg.create_task(trial(f"long{i}", "sleep 60"))
            tg.create_task(trial("bad", f'while [ ! -e "{go}" ]; do sleep 0.01; done; exit 2'))
            await poll_until(lambda: len(handles) == 4, "all four apps to be launched")
            go.touch()
    assert "FAILED" in str(caught.value.exceptions[0])
    assert await final_state(runner, handles["bad"]) == AppState.FAILED
    for i in range(3):
        assert await final_state(runner, handles[f"long{i}"]) == AppState.CANCELLED


# -- the corners, on a virtual clock --------------------------------------------------------------


def scripted(**kw: Any) -> tuple[ScriptedBackend, VirtualClock, AsyncRunner]:
    clock = VirtualClock()
    backend = ScriptedBackend("scripted", clock=clock, **kw)
    return backend, clock, AsyncRunner("t", scheduler_factories={"scripted": backend})


def app(name: str = "app") -> AppDef:
    return AppDef(name, [Role("main", image="img", entrypoint="main")])


async def test_a_cancellation_during_the_submission_cancels_what_was_submitted() -> None:
    """A task cancelled while the backend is submitting waits for the answer, then cancels that app."""
    backend, clock, runner = scripted(submit_latency=5)
    async with runner:
        entered = asyncio.Event()

        async def service() -> None:
            entered.set()
            async with runner.launched(app(), "scripted"):
                pytest.fail("the block should not be entered")

        task = asyncio.create_task(service())
        await entered.wait()
        await poll_until(lambda: backend.in_flight_submits == 1, "the submission to start")
        task.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()  # still waiting for the backend's answer
        clock.advance(5)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        [submitted] = backend.apps.values()
        assert submitted.cancelled and submitted.state == AppState.CANCELLED


@pytest.mark.parametrize("gang", [False, True])
async def test_an_app_whose_submit_outlives_a_failed_block_is_cancelled_too(gang: bool) -> None:
    """A launch still submitting (in a task of its own) when the block fails: its app is cancelled, launch raises."""
    backend, clock, runner = scripted(submit_latency=5)
    async with runner:
        with pytest.raises(KeyError):
            async with runner.launch_group(gang=gang) as group:
                stray = asyncio.create_task(group.launch(app("stray"), "scripted"))
                await poll_until(lambda: backend.in_flight_submits == 1, "the submission to start")
                raise KeyError("the block fails")
        clock.advance(5)
        with anyio.fail_after(10), pytest.raises(RuntimeError, match="was being submitted"):
            await stray
        [submitted] = backend.apps.values()
        assert submitted.cancelled and submitted.state == AppState.CANCELLED
        assert not runner.hub("scripted").awaited()


async def test_the_clean_up_survives_further_cancellations() -> None:
    """Cancelling the task again while launched() waits for the app to end does not cut the clean-up short."""
    backend, clock, runner = scripted(default=AppScript(stop_delay=30))
    async with runner:
        inside = asyncio.Event()

        async def service() -> None:
            async with runner.launched(app(), "scripted"):
                inside.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(service())
        await inside.wait()
        [submitted] = backend.apps.values()
        task.cancel()
        await poll_until(lambda: submitted.cancelled, "the app to be cancelled")
        for _ in range(3):
            task.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
            assert not task.done()  # waiting for the stop delay to pass
        clock.advance(30)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert submitted.state == AppState.CANCELLED


async def test_the_clean_up_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """An app that does not end within cleanup_timeout: the block's exception propagates, a warning names the app."""
    backend, _clock, runner = scripted(default=AppScript(stop_delay=3600))
    async with runner:
        with pytest.raises(OSError, match="boom"), caplog.at_level(logging.WARNING):
            async with runner.launched(app(), "scripted", cleanup_timeout=0.2) as handle:
                raise OSError("boom")
        assert handle in caplog.text and "were not terminal" in caplog.text
        with pytest.raises(TimeoutError, match=r"not terminal 0\.2 s after") as caught:
            async with runner.launched(
                app(), "scripted", cleanup_timeout=0.2, cancel_on_normal_exit=True
            ) as second:
                pass
        assert second in str(caught.value)
        assert all(a.cancelled for a in backend.apps.values())


async def test_a_runner_closed_inside_the_block_is_reported_as_such(
    caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    """Closing the runner inside a launch block: leaving the block says that the runner was
    closed (RuntimeError on a normal exit, a warning when the block raised), not that a clean-up
    timed out, and leaves no never-awaited coroutine behind."""
    _backend, _clock, runner = scripted()
    async with runner:
        with pytest.raises(RuntimeError, match="runner was closed inside the launch block") as e:
            async with runner.launched(app(), "scripted", cancel_on_normal_exit=True) as first:
                await runner.close()
        assert first in str(e.value)
    _backend, _clock, runner = scripted()
    async with runner:
        with pytest.raises(OSError, match="boom"), caplog.at_level(logging.WARNING):
            async with runner.launched(app(), "scripted") as second:
                await runner.close()
                raise OSError("boom")
    assert "runner was closed inside the launch block" in caplog.text and second in caplog.text
    assert "not terminal" not in caplog.text
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


async def test_bad_arguments_are_clear_errors() -> None:
    """A bad cleanup_timeout, component_args with an AppDef, or a launch after the block raise clearly."""
    backend, _clock, runner = scripted()
    async with runner:
        with pytest.raises(ValueError, match=r"cleanup_timeout must be .* got -1"):
            async with runner.launched(app(), "scripted", cleanup_timeout=-1):
                pass
        with pytest.raises(ValueError, match="got inf"):
            async with runner.launch_group(cleanup_timeout=float("inf")):
                pass
        with pytest.raises(ValueError, match=r"cleanup_timeout must be .* got 1000000"):
            async with runner.launch_group(cleanup_timeout=10**400):  # too large for a float
                pass
        with pytest.raises(TypeError, match="component_args apply to a component name"):
            async with runner.launched(app(), "scripted", component_args=["--x"]):
                pass
        async with runner.launch_group() as group:
            pass
        with pytest.raises(RuntimeError, match="block has ended"):
            await group.launch(app(), "scripted")
        assert backend.apps == {}


async def test_a_refused_submission_raises_to_the_block_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused submit raises its error from launched(); a cancellation during it wins over it; nothing is logged as a failed task."""
    backend, clock, runner = scripted(
        submit_latency=1,
        faults=[Fault("submit", n, RuntimeError(f"refused {n}")) for n in (1, 2)],
    )
    async with runner:

        async def block() -> None:
            async with runner.launched(app(), "scripted"):
                pytest.fail("the block should not be entered")

        with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="refused 1"):
            task = asyncio.create_task(block())
            await poll_until(lambda: backend.in_flight_submits == 1, "the submission to start")
            clock.advance(1)
            await asyncio.wait_for(task, 10)
        task = asyncio.create_task(block())
        await poll_until(lambda: backend.in_flight_submits == 1, "the second submission")
        task.cancel()
        clock.advance(1)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    assert backend.apps == {}
    assert "background task" not in caplog.text
