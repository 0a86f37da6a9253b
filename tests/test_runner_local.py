"""AsyncRunner against the real local backend: every method, waiting semantics, and status-round cost."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynctorchx import AppEvent, AsyncRunner
from asynctorchx.schedulers import get_scheduler_factories
from asynctorchx.schedulers.api import DescribeAppResponse, Scheduler, Stream
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidComponentArgsException,
    InvalidRunConfigException,
    Role,
    UnknownAppException,
    UnknownSchedulerException,
    is_terminal,
    parse_app_handle,
)
from asynctorchx.specs.errors import ComponentNotFoundException
from asynctorchx.testing import AppScript, ScriptedBackend

_NOW = datetime.datetime.now()
LOCAL = "local_cwd"
ORDER = {
    AppState.UNSUBMITTED: 0,
    AppState.SUBMITTED: 1,
    AppState.PENDING: 2,
    AppState.RUNNING: 3,
    AppState.SUCCEEDED: 4,
    AppState.FAILED: 4,
    AppState.CANCELLED: 4,
}


def sh_app(script: str, name: str = "app", role: str = "main", **role_kw: Any) -> AppDef:
    """A one-role app running ``sh -c script``."""
    return AppDef(name, [Role(role, image=".", entrypoint="sh", args=["-c", script], **role_kw)])


def session() -> str:
    return f"rl-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def runner(root: Path) -> AsyncIterator[AsyncRunner]:
    async with AsyncRunner(name=session(), local_root=str(root)) as r:
        yield r


def app_id(handle: str) -> str:
    return parse_app_handle(handle)[2]


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(condition: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Polls ``condition()`` (bounded) until it is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


# -- submitting, status and waiting ------------------------------------------------------------


async def test_run_wait_status_succeeded(runner: AsyncRunner) -> None:
    """run returns a local_cwd handle of the runner's session; wait and status report SUCCEEDED."""
    handle = await runner.run(sh_app("echo hi"), LOCAL)
    backend, sess, _ = parse_app_handle(handle)
    assert (backend, sess) == (LOCAL, runner.name)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.SUCCEEDED
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.SUCCEEDED


async def test_failed_app_reports_exit_code(runner: AsyncRunner) -> None:
    """A replica exiting 3 makes the app FAILED, with the exit code in the replica status."""
    handle = await runner.run(sh_app("exit 3"), LOCAL)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.FAILED
    replica = final.roles[0].replicas[0]
    assert replica.exit_code == 3


async def test_unknown_app(runner: AsyncRunner) -> None:
    """An unknown app id gives None from wait/status/describe, UnknownAppException from log_lines."""
    handle = f"{LOCAL}://{runner.name}/no-such-app-{uuid.uuid4().hex[:6]}"
    assert await runner.wait(handle, timeout=10) is None
    assert await runner.status(handle) is None
    assert await runner.describe(handle) is None
    with pytest.raises(UnknownAppException):
        async for _ in runner.log_lines(handle, "main"):
            pass
    await runner.cancel(handle)  # idempotent: nothing to cancel is not an error


async def test_handle_of_another_session_is_rejected(runner: AsyncRunner) -> None:
    """A handle naming another session raises UnknownAppException instead of reading its app."""
    with pytest.raises(UnknownAppException, match="session"):
        await runner.status(f"{LOCAL}://someone-else/app-1")


async def test_wait_all_returns_every_final_status(runner: AsyncRunner) -> None:
    """wait_all maps each handle to its final status."""
    ok = await runner.run(sh_app("true"), LOCAL)
    bad = await runner.run(sh_app("exit 1"), LOCAL)
    slow = await runner.run(sh_app("sleep 0.2"), LOCAL)
    done = await runner.wait_all([ok, bad, slow], timeout=30)
    assert {h: s.state if s else None for h, s in done.items()} == {
        ok: AppState.SUCCEEDED,
        bad: AppState.FAILED,
        slow: AppState.SUCCEEDED,
    }


async def test_as_completed_yields_in_completion_order(runner: AsyncRunner) -> None:
    """Apps sleeping 0.3/0.1/0.2 s come back from as_completed in the order 0.1, 0.2, 0.3."""
    delays = ["0.3", "0.1", "0.2"]
    handles = await asyncio.gather(
        *(runner.run(sh_app(f"sleep {d}", name=f"s{d[-1]}"), LOCAL) for d in delays)
    )
    by_handle = dict(zip(handles, delays, strict=True))
    order = []
    async for handle, status in runner.as_completed(handles, timeout=30):
        assert status is not None and status.state == AppState.SUCCEEDED
        order.append(by_handle[handle])
    assert order == ["0.1", "0.2", "0.3"]


async def test_as_completed_timeout_yields_finished_then_raises(runner: AsyncRunner) -> None:
    """as_completed(timeout=) yields the apps that finished, then raises TimeoutError."""
    quick = await runner.run(sh_app("true"), LOCAL)
    slow = await runner.run(sh_app("sleep 30"), LOCAL)
    got = []
    with pytest.raises(TimeoutError):
        async for handle, _ in runner.as_completed([quick, slow], timeout=2):
            got.append(handle)
    assert got == [quick]
    await runner.cancel(slow)


# -- watch ---------------------------------------------------------------------------------------


async def collect(runner: AsyncRunner, handles: Sequence[str]) -> list[AppEvent]:
    events = []
    async for event in runner.watch(handles):
        events.append(event)
    return events


def assert_chain(events: Sequence[AppEvent]) -> None:
    """Each event's previous_state is the state of the event before it (None for the first)."""
    previous = None
    for event in events:
        assert event.previous_state == previous
        previous = event.state


async def test_watch_sequence_to_success(runner: AsyncRunner) -> None:
    """watch yields SUBMITTED/PENDING/RUNNING in order, then SUCCEEDED as the last event."""
    handle = await runner.run(sh_app("sleep 0.4"), LOCAL)
    events = await asyncio.wait_for(collect(runner, [handle]), 30)
    states = [e.state for e in events]
    assert states[0] in (AppState.SUBMITTED, AppState.PENDING, AppState.RUNNING)
    assert AppState.RUNNING in states
    assert states[-1] == AppState.SUCCEEDED
    assert [ORDER[s] for s in states] == sorted(ORDER[s] for s in states)
    assert len(set(states)) == len(states)
    assert all(not e.is_terminal for e in events[:-1]) and events[-1].is_terminal
    assert_chain(events)
    assert all(e.handle == handle for e in events)


async def test_watch_reports_a_restart(runner: AsyncRunner, tmp_path: Path) -> None:
    """A replica that fails once with max_retries=1 shows an event with num_restarts=1, then SUCCEEDED."""
    marker = tmp_path / "first-attempt-done"
    script = f"if [ -e {marker} ]; then sleep 0.4; exit 0; fi; touch {marker}; sleep 0.3; exit 1"
    handle = await runner.run(sh_app(script, max_retries=1), LOCAL)
    events = await asyncio.wait_for(collect(runner, [handle]), 30)
    restarted = [e for e in events if e.num_restarts == 1 and not e.is_terminal]
    assert restarted, [(e.state, e.num_restarts) for e in events]
    assert events[0].num_restarts == 0
    last = events[-1]
    assert last.state == AppState.SUCCEEDED and last.num_restarts == 1
    assert last.status is not None and last.status.num_restarts == 1
    assert all(not e.is_terminal for e in events[:-1])


async def test_watch_several_apps_ends_when_all_are_final(runner: AsyncRunner) -> None:
    """watch over several apps ends after the last one's terminal event, one terminal event each."""
    handles = [await runner.run(sh_app(f"sleep 0.{i}"), LOCAL) for i in (1, 2)]
    events = await asyncio.wait_for(collect(runner, handles), 30)
    terminal = [e.handle for e in events if e.is_terminal]
    assert sorted(terminal) == sorted(handles)
    assert events[-1].is_terminal


# -- waiting does not own the app ------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["garbage", "nosuch://s/x", "scripted://another-session/x"])
async def test_watch_with_a_bad_handle_after_good_ones_leaves_no_listener(bad: str) -> None:
    """watch([good, bad]) raises for the bad handle and stops listening to the good one."""
    backend = ScriptedBackend("scripted")  # runs until cancelled
    async with AsyncRunner(name="s", scheduler_factories={"scripted": backend}) as runner:
        handle = await runner.run(sh_app("sleep 60"), "scripted")
        with anyio.fail_after(10), pytest.raises(Exception, match=re.escape(bad.split("://")[0])):
            async for _ in runner.watch([handle, bad]):
                pass
        assert not runner.hub("scripted").awaited()


async def test_one_handle_instead_of_a_list_is_a_clear_error() -> None:
    """wait_all/as_completed/watch given one handle string raise TypeError naming it, not its first character."""
    backend = ScriptedBackend("scripted", AppScript(states=[(0, AppState.SUCCEEDED)]))
    async with AsyncRunner(name="s", scheduler_factories={"scripted": backend}) as runner:
        handle = await runner.run(sh_app("true"), "scripted")
        with anyio.fail_after(10):
            with pytest.raises(TypeError, match=re.escape(repr(handle))):
                await runner.wait_all(handle)
            with pytest.raises(TypeError, match=re.escape(repr(handle))):
                async for _ in runner.as_completed(handle):
                    pass
            with pytest.raises(TypeError, match=re.escape(repr(handle))):
                async for _ in runner.watch(handle):
                    pass


async def test_wait_timeout_leaves_app_running(runner: AsyncRunner) -> None:
    """wait(timeout=) raises TimeoutError and the app is still RUNNING afterwards."""
    handle = await runner.run(sh_app("sleep 30"), LOCAL)
    with pytest.raises(TimeoutError):
        await runner.wait(handle, timeout=0.3)
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    await runner.cancel(handle)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.CANCELLED


async def test_cancelling_the_waiting_task_leaves_app_running(runner: AsyncRunner) -> None:
    """Cancelling a task awaiting wait() does not cancel the app; a later wait still works."""
    handle = await runner.run(sh_app("sleep 30"), LOCAL)
    waiter = asyncio.create_task(runner.wait(handle))
    hub = runner.hub(LOCAL)
    await until(lambda: (e := hub.entry(app_id(handle))) is not None and e.known, what="hub")
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.RUNNING
    await runner.cancel(handle)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.CANCELLED


# -- cancel, describe, list, logs ------------------------------------------------------------------


async def test_cancel_is_idempotent_and_ends_cancelled(runner: AsyncRunner) -> None:
    """cancel stops a running app (CANCELLED) and cancelling it again is harmless."""
    handle = await runner.run(sh_app("sleep 30"), LOCAL)
    await runner.cancel(handle)
    await runner.cancel(handle)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.CANCELLED
    await runner.cancel(handle)
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.CANCELLED


async def test_describe_returns_the_app(runner: AsyncRunner) -> None:
    """describe returns the app's name and roles as submitted."""
    app = AppDef(
        "two-roles",
        [
            Role("a", image=".", entrypoint="sh", args=["-c", "true"], num_replicas=2),
            Role("b", image=".", entrypoint="sh", args=["-c", "true"], env={"X": "1"}),
        ],
    )
    handle = await runner.run(app, LOCAL)
    described = await runner.describe(handle)
    assert described is not None
    assert described.name == "two-roles"
    assert [(r.name, r.num_replicas) for r in described.roles] == [("a", 2), ("b", 1)]
    assert described.roles[0].entrypoint == "sh"
    assert described.roles[1].env.get("X") == "1"
    await runner.wait(handle, timeout=30)


async def test_list_has_handles_and_states(runner: AsyncRunner) -> None:
    """list returns the runner's apps with their handles, names and states."""
    done = await runner.run(sh_app("true", name="finished"), LOCAL)
    live = await runner.run(sh_app("sleep 30", name="running"), LOCAL)
    await runner.wait(done, timeout=30)
    listed = {a.app_handle: a for a in await runner.list(LOCAL)}
    assert done in listed and live in listed
    assert listed[done].state == AppState.SUCCEEDED and listed[done].name == "finished"
    assert listed[live].state == AppState.RUNNING and listed[live].name == "running"
    assert listed[done].app_id == app_id(done)
    await runner.cancel(live)


async def test_log_lines_streams_regex_and_replicas(runner: AsyncRunner) -> None:
    """log_lines reads each replica's stdout/stderr, keeps newlines and filters with regex."""
    script = 'for i in 1 2 3; do echo "out $REPLICA $i"; done; echo "err $REPLICA" >&2'
    app = sh_app(script, num_replicas=2, env={"REPLICA": "${replica_id}"})
    handle = await runner.run(app, LOCAL)
    await runner.wait(handle, timeout=30)

    async def lines(k: int = 0, **kw: Any) -> list[str]:
        return [line async for line in runner.log_lines(handle, "main", k, **kw)]

    assert await lines(0, streams=Stream.STDOUT) == ["out 0 1\n", "out 0 2\n", "out 0 3\n"]
    assert await lines(1, streams=Stream.STDOUT) == ["out 1 1\n", "out 1 2\n", "out 1 3\n"]
    assert await lines(1, streams=Stream.STDERR) == ["err 1\n"]
    assert await lines(0, streams=Stream.COMBINED) == [
        "out 0 1\n",
        "out 0 2\n",
        "out 0 3\n",
        "err 0\n",
    ]
    assert await lines(0, regex=r" [13]$", streams=Stream.STDOUT) == ["out 0 1\n", "out 0 3\n"]


async def test_log_lines_tail_follows_until_the_end(runner: AsyncRunner) -> None:
    """should_tail=True yields lines while the app writes them and stops when it is terminal."""
    handle = await runner.run(
        sh_app("for i in 1 2 3 4 5; do echo line $i; sleep 0.05; done"), LOCAL
    )
    got = []
    async for line in runner.log_lines(handle, "main", should_tail=True, streams=Stream.STDOUT):
        got.append(line)
    assert got == [f"line {i}\n" for i in range(1, 6)]
    status = await runner.status(handle)
    assert status is not None and status.state == AppState.SUCCEEDED


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"regex": "("}, ValueError),
        ({"k": -1}, ValueError),
        ({"k": "0"}, TypeError),
        ({"cursor": "garbage"}, ValueError),
        ({"since": _NOW, "until": _NOW - datetime.timedelta(hours=1)}, ValueError),
    ],
    ids=["regex", "negative_k", "k_type", "cursor", "since_after_until"],
)
@pytest.mark.parametrize("method", ["log_lines", "log_entries"])
async def test_log_arguments_are_refused_at_the_call(
    runner: AsyncRunner, method: str, kw: dict[str, Any], error: type[Exception]
) -> None:
    """A bad argument raises at the call, as the scheduler's own ``log_iter`` does (a service
    checks a request before it starts streaming the response); it raised at the first line."""
    handle = await runner.run(sh_app("echo hi"), LOCAL)
    await runner.wait(handle, timeout=30)
    with pytest.raises(error):
        getattr(runner, method)(handle, "main", **kw)


async def test_an_unknown_app_or_session_raises_at_the_first_line(runner: AsyncRunner) -> None:
    """What only reading can tell (the app, the handle's session) still raises when the first
    line is asked for, not at the call."""
    for handle in (f"{LOCAL}://{runner.name}/no-such-app", f"{LOCAL}://other/app"):
        lines = runner.log_lines(handle, "main")
        with pytest.raises(UnknownAppException):
            await anext(lines)


async def test_polling_status_in_a_loop_lets_other_tasks_run(runner: AsyncRunner) -> None:
    """``status`` of an app this runner launched is answered from memory, yet it is a point where
    other tasks run: a caller polling it without a sleep does not starve the event loop (another
    task got no turn in 200 polls)."""
    handle = await runner.run(sh_app("sleep 30"), LOCAL)
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    before = turns
    for _ in range(200):
        await runner.status(handle)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert turns - before >= 100, turns - before
    await runner.cancel(handle)


# -- dry runs, schedule, components, options -------------------------------------------------------


async def test_dryrun_launches_nothing_then_schedule_runs_it(runner: AsyncRunner) -> None:
    """dryrun is pure (nothing listed); schedule submits the dry run and the app succeeds."""
    app = sh_app("echo scheduled")
    info = runner.dryrun(app, LOCAL, cfg={})
    assert info.scheduler == LOCAL
    assert await runner.list(LOCAL) == []
    handle = await runner.schedule(info)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.SUCCEEDED
    assert [ln async for ln in runner.log_lines(handle, "main", streams=Stream.STDOUT)] == [
        "scheduled\n"
    ]


async def test_run_component_echo(runner: AsyncRunner) -> None:
    """run_component('utils.echo') runs the builtin and its message is in the echo role's log."""
    handle = await runner.run_component("utils.echo", ["--msg", "hi there"], LOCAL)
    final = await runner.wait(handle, timeout=30)
    assert final is not None and final.state == AppState.SUCCEEDED
    lines = [ln async for ln in runner.log_lines(handle, "echo", streams=Stream.STDOUT)]
    assert lines == ["hi there\n"]


async def test_dryrun_component_is_pure(runner: AsyncRunner) -> None:
    """dryrun_component builds the request of a component without launching it."""
    info = runner.dryrun_component("utils.sh", ["echo", "x"], LOCAL)
    assert info.scheduler == LOCAL
    assert await runner.list(LOCAL) == []


async def test_bad_input_fails_before_anything_runs(runner: AsyncRunner) -> None:
    """Unknown scheduler, bad cfg and unknown component raise before any app is launched."""
    with pytest.raises(UnknownSchedulerException, match="local_cwd"):
        await runner.run(sh_app("true"), "no_such_scheduler")
    with pytest.raises(InvalidRunConfigException, match="prepend_cwd"):
        await runner.run(sh_app("true"), LOCAL, cfg={"prepend_cwd": "yes please"})
    with pytest.raises(ComponentNotFoundException):
        await runner.run_component("utils.ehco", [], LOCAL)
    assert await runner.list(LOCAL) == []


async def test_a_cfg_that_is_not_a_mapping_is_a_clear_error(runner: AsyncRunner) -> None:
    """cfg given as a 'k=v' string (or a list) raises TypeError naming it; nothing is launched."""
    for bad in ["log_dir=/tmp/x", [("prepend_cwd", True)]]:
        with pytest.raises(TypeError, match="cfg must be a mapping .* got " + re.escape(repr(bad))):
            await runner.run(sh_app("true"), LOCAL, bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cfg must be a mapping"):
            runner.dryrun(sh_app("true"), LOCAL, bad)  # type: ignore[arg-type]
    assert await runner.list(LOCAL) == []


async def test_component_args_given_as_one_string_is_a_clear_error(runner: AsyncRunner) -> None:
    """component_args '--msg hi' (a string) raises TypeError naming it, not 'unrecognized arguments: - - m s g'."""
    with pytest.raises(TypeError, match=r"component_args must be .* got '--msg hi'"):
        await runner.run_component("utils.echo", "--msg hi", LOCAL)
    with pytest.raises(TypeError, match=r"component_args must be .* got '--msg hi'"):
        runner.dryrun_component("utils.echo", "--msg hi", LOCAL)
    with pytest.raises(TypeError, match=r"component_args must be .* got '--msg hi'"):
        async with runner.launched("utils.echo", LOCAL, component_args="--msg hi"):
            pass
    assert await runner.list(LOCAL) == []


async def test_component_args_as_a_mapping_get_decoded_config_defaults(root: Path) -> None:
    """With component_args given as a mapping, [component:NAME] defaults (strings, as
    .torchxconfig holds them) are decoded by each parameter's type, as with a list of arguments;
    one that does not decode names where it was set."""
    defaults = {"utils.echo": {"num_replicas": "2"}}
    async with AsyncRunner(session(), defaults, local_root=str(root)) as runner:
        info = runner.dryrun_component("utils.echo", {"msg": "hi"}, LOCAL)
        assert info.app is not None and info.app.roles[0].num_replicas == 2
        assert info.app.roles[0].args == ["hi"]
    bad = {"utils.echo": {"num_replicas": "two"}}
    async with AsyncRunner(session(), bad, local_root=str(root)) as runner:
        with pytest.raises(InvalidComponentArgsException, match=r"\[component:utils\.echo\]"):
            await runner.run_component("utils.echo", {"msg": "hi"}, LOCAL)
        assert await runner.list(LOCAL) == []


def tree(path: Path) -> set[str]:
    """Every file and directory under ``path`` (relative), empty when it does not exist."""
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


@pytest.mark.parametrize(
    ("component", "args", "message"),
    [
        ("utils.touch", [], "the following arguments are required: --file"),
        (
            "utils.echo",
            ["--num_replicas", "two"],
            "argument --num_replicas: invalid int value: 'two'",
        ),
        ("utils.sh", ["--num_replicas"], "argument --num_replicas: expected one argument"),
    ],
    ids=["missing-required", "wrong-type", "missing-value"],
)
async def test_bad_component_args_raise_and_launch_nothing(
    runner: AsyncRunner, root: Path, component: str, args: list[str], message: str
) -> None:
    """run_component with bad arguments raises InvalidComponentArgsException naming the argument;
    no app is listed and no log directory is created (a good run afterwards is both)."""
    before = tree(root)
    with pytest.raises(InvalidComponentArgsException) as caught:
        await runner.run_component(component, args, LOCAL)
    assert isinstance(caught.value, ValueError)  # the documented base class
    assert message in str(caught.value)
    assert caught.value.component == component  # the name it was asked by
    assert await runner.list(LOCAL) == []
    assert tree(root) == before

    good = await runner.run_component("utils.echo", ["--msg", "ok"], LOCAL)
    final = await runner.wait(good, timeout=30)
    assert final is not None and final.state == AppState.SUCCEEDED
    assert [a.app_handle for a in await runner.list(LOCAL)] == [good]
    assert any(app_id(good) in part for part in tree(root) - before)


async def test_run_opts_and_cfg_from_str(runner: AsyncRunner) -> None:
    """scheduler_backends lists the local backends; run options parse from 'k=v' strings."""
    assert {"local_cwd", "local_dir"} <= set(runner.scheduler_backends())
    opts = runner.scheduler_run_opts(LOCAL)
    assert opts.get("log_dir") is not None
    assert runner.cfg_from_str(LOCAL, "log_dir=/tmp/x,prepend_cwd=True") == {
        "log_dir": "/tmp/x",
        "prepend_cwd": True,
    }


# -- lifecycle -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", ".", "a\0b", "a/b", "a b", None])
def test_a_bad_runner_name_is_refused_naming_it(name: object) -> None:
    """A runner name that is no safe directory name ('..', NUL, '/') raises ValueError naming it."""
    with pytest.raises(ValueError, match="runner name must be .* got " + re.escape(repr(name))):
        AsyncRunner(name=name)  # type: ignore[arg-type]


async def test_close_twice_and_use_after_close(root: Path) -> None:
    """close() twice is fine; after it every method raises RuntimeError('...closed')."""
    runner = AsyncRunner(name=session(), local_root=str(root))
    with pytest.raises(RuntimeError, match="not open"):
        await runner.run(sh_app("true"), LOCAL)
    async with runner:
        handle = await runner.run(sh_app("true"), LOCAL)
        await runner.wait(handle, timeout=30)
    await runner.close()
    await runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        await runner.status(handle)
    with pytest.raises(RuntimeError, match="closed"):
        await runner.run(sh_app("true"), LOCAL)
    with pytest.raises(RuntimeError, match="closed"):
        await runner.wait(handle)
    with pytest.raises(RuntimeError, match="closed"):
        await runner.open()


def test_a_runner_used_from_another_event_loop_says_so() -> None:
    """A runner opened in one asyncio.run and called from a second raises RuntimeError at once."""
    backend = ScriptedBackend("scripted", AppScript(states=[(0, AppState.SUCCEEDED)]))
    runner = AsyncRunner(name=session(), scheduler_factories={"scripted": backend})

    async def first() -> str:
        await runner.open()
        handle = await runner.run(sh_app("true"), "scripted")
        await runner.wait(handle, timeout=30)
        return handle

    handle = asyncio.run(first())

    async def second() -> list[str]:
        calls = [
            lambda: runner.run(sh_app("true"), "scripted"),
            lambda: runner.status(handle),
            lambda: runner.wait(handle),
            lambda: runner.wait_all([handle]),
            runner.close,
        ]
        errors = []
        for call in calls:
            with anyio.fail_after(10), pytest.raises(RuntimeError) as info:
                await call()
            errors.append(str(info.value))
        return errors

    for error in asyncio.run(second()):
        assert "opened in another event loop" in error


async def test_a_first_run_in_progress_when_the_runner_closes_raises_closed(root: Path) -> None:
    """A first ``run()`` still reading the trackers' config when ``close()`` is called raises
    RuntimeError('...closed'), not a CancelledError in a task nobody cancelled."""
    runner = AsyncRunner(name=session(), local_root=str(root))
    await runner.open()
    first = asyncio.create_task(runner.run(sh_app("true"), LOCAL))
    await asyncio.sleep(0)  # it waits for the config read (a worker thread)
    await asyncio.wait_for(runner.close(), 15)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(first, 15)
    assert not first.cancelled()
    assert not (root / ".apps").exists() or not list((root / ".apps").iterdir())


async def test_close_right_after_cancel_returns(root: Path) -> None:
    """close() just after cancel() (the hub is being woken as it is stopped) returns promptly."""
    runner = AsyncRunner(name=session(), local_root=str(root))
    async with runner:
        quick = await runner.run(sh_app("true"), LOCAL)
        slow = await runner.run(sh_app("sleep 30"), LOCAL)
        with pytest.raises(TimeoutError):
            async for _ in runner.as_completed([quick, slow], timeout=0.5):
                pass
        await runner.cancel(slow)
        await asyncio.wait_for(runner.close(), 15)


async def test_close_wakes_waiters_with_an_error(root: Path) -> None:
    """A wait in progress when the runner closes raises RuntimeError instead of hanging."""
    runner = AsyncRunner(name=session(), local_root=str(root))
    async with runner:
        handle = await runner.run(sh_app("sleep 30"), LOCAL)
        waiter = asyncio.create_task(runner.wait(handle))
        hub = runner.hub(LOCAL)
        await until(lambda: (e := hub.entry(app_id(handle))) is not None and e.known)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(waiter, 10)


async def test_closing_the_runner_stops_its_local_apps(root: Path, tmp_path: Path) -> None:
    """Closing the runner stops the local apps it launched, their children included."""
    child_pid = tmp_path / "child.pid"
    name = session()
    async with AsyncRunner(name=name, local_root=str(root)) as runner:
        handle = await runner.run(sh_app(f"sleep 60 & echo $! > {child_pid}; wait"), LOCAL)
        await until(lambda: child_pid.exists() and child_pid.read_text().strip(), what="the child")
        status = await runner.status(handle)
        assert status is not None and status.state == AppState.RUNNING
        replica_pid = status.roles[0].replicas[0].pid
        assert replica_pid is not None
        started = [replica_pid, int(child_pid.read_text())]
        assert all(alive(p) for p in started)
    await until(lambda: not any(alive(p) for p in started), what="the app to be stopped")
    async with AsyncRunner(name=name, local_root=str(root)) as other:
        status = await other.status(handle)
    assert status is not None and is_terminal(status.state)
    assert status.state != AppState.SUCCEEDED


# -- cost of waiting -------------------------------------------------------------------------------


class RecordingScheduler:
    """Wraps a real scheduler and counts the status calls the runner makes on it."""

    def __init__(self, inner: Scheduler[Any]) -> None:
        self._inner = inner
        self.describe_calls: list[str] = []
        self.rounds: list[list[str]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        self.describe_calls.append(app_id)
        return await self._inner.describe(app_id)

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        self.rounds.append(list(app_ids))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._inner.describe_many(app_ids)
        finally:
            self.in_flight -= 1


class Gate:
    """A lock file held exclusively by the test: apps running ``flock -s PATH true`` block on it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("w")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self) -> None:
        """Lets every blocked app (and any later one) through."""
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    g = Gate(tmp_path / "gate")
    try:
        yield g
    finally:
        g.release()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_500_apps_through_as_completed_cost_one_round_per_tick(
    root: Path, gate: Gate
) -> None:
    """500 apps waited through as_completed: one describe_many per hub round, single-flight, no describe."""
    recorders: list[RecordingScheduler] = []
    real = get_scheduler_factories()[LOCAL]

    def factory(session_name: str, **params: Any) -> Any:
        recorder = RecordingScheduler(real(session_name, **params))
        recorders.append(recorder)
        return recorder

    n = 500
    app = AppDef(
        "gated", [Role("main", image=".", entrypoint="flock", args=["-s", str(gate.path), "true"])]
    )
    async with AsyncRunner(
        name=session(), local_root=str(root), scheduler_factories={LOCAL: factory}
    ) as runner:
        handles = [await runner.run(app, LOCAL) for _ in range(n)]
        hub = runner.hub(LOCAL)
        rounds_before_release = hub.rounds
        done: dict[str, Any] = {}
        gate.release()
        async for handle, status in runner.as_completed(handles, timeout=90):
            done[handle] = status
        (recorder,) = recorders
        assert len(done) == n
        assert all(s is not None and s.state == AppState.SUCCEEDED for s in done.values())
        assert len(recorder.rounds) == hub.rounds
        assert recorder.max_in_flight == 1
        assert recorder.describe_calls == []
        assert all(len(ids) == len(set(ids)) for ids in recorder.rounds)
        rounds_to_finish = hub.rounds - rounds_before_release
        print(
            f"\n{n} apps: {hub.rounds} rounds in all, {rounds_to_finish} after launching, "
            f"{sum(map(len, recorder.rounds))} app descriptions"
        )
        # exits are batched: far fewer rounds than apps (how many share a round depends on how the
        # exits spread out in time on a busy machine: 100-110 rounds for 500 apps were seen on a
        # loaded 2-core VM, 40-60 on a quiet one); a hub polling per waiter would need >= n calls
        assert rounds_to_finish <= n // 2


class SubmitPause:
    """Wraps the real local scheduler: its submits complete, then wait for ``go`` before returning."""

    def __init__(self, inner: Scheduler[Any]) -> None:
        self._inner = inner
        self.submitted = asyncio.Event()
        self.go = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def schedule(self, dryrun_info: Any) -> str:
        app_id: str = await self._inner.schedule(dryrun_info)
        self.submitted.set()
        await self.go.wait()
        return app_id


async def test_a_run_whose_submit_ends_as_the_runner_closes_returns_the_handle(
    root: Path,
) -> None:
    """A run() whose local submit completes while close() runs returns the handle of the app
    (which the close stopped: CANCELLED), rather than raising 'closed' with the app unnamed."""
    real = get_scheduler_factories()[LOCAL]
    made: list[SubmitPause] = []

    def factory(session_name: str, **params: Any) -> Any:
        made.append(SubmitPause(real(session_name, **params)))
        return made[-1]

    name = session()
    runner = AsyncRunner(name=name, local_root=str(root), scheduler_factories={LOCAL: factory})
    await runner.open()
    run = asyncio.create_task(runner.run(sh_app("exec sleep 60"), LOCAL))
    with anyio.fail_after(30):
        await until(lambda: bool(made), what="the scheduler")
        await made[0].submitted.wait()
        closing = asyncio.create_task(runner.close())
        await until(lambda: made[0]._inner._closed, what="the close to reach the scheduler")
        made[0].go.set()
        handle = await run
        await closing
    assert parse_app_handle(handle)[:2] == (LOCAL, name)
    async with AsyncRunner(name=name, local_root=str(root)) as other:
        status = await other.status(handle)
    assert status is not None and status.state == AppState.CANCELLED
    pid = status.roles[0].replicas[0].pid
    assert pid is not None
    await until(lambda: not alive(pid), what="the app's process to be gone")
