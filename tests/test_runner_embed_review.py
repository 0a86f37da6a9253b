"""Launch blocks under stress: what they send to the backend when they fail, and what they report.

A failed launch group must not submit the launches still queued for a submit slot; its clean-up
must carry every cancel to the backend whatever ``cleanup_timeout`` is, and say which apps it
could not cancel and which were only slow to end; a gang's error counts the apps it actually
cancelled; and a submit refused while its block was cancelled is reported FAILED, with the
backend's reason. All run on the scripted in-memory backend and a virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import pytest

from asynctorchx import AsyncRunner
from asynctorchx.runner import GangFailedError, LaunchEvent, LaunchPhase, Limits
from asynctorchx.specs import AppDef, AppState, Role
from asynctorchx.testing import AppScript, Fault, ScriptedBackend, ScriptedScheduler, VirtualClock

NAME = "scripted"


def app(name: str = "app") -> AppDef:
    return AppDef(name, [Role("main", image="img", entrypoint="main")])


def scripted(**kw: Any) -> tuple[ScriptedBackend, VirtualClock, AsyncRunner]:
    clock = VirtualClock()
    limits = kw.pop("limits", None)
    backend = ScriptedBackend(NAME, clock=clock, **kw)
    runner = AsyncRunner("t", scheduler_factories={NAME: backend}, clock=clock, limits=limits)
    return backend, clock, runner


async def test_a_launch_queued_for_a_slot_when_its_group_fails_submits_nothing() -> None:
    """A group.launch() (in a task of its own) still waiting for a submit slot when the launch
    block fails raises RuntimeError once it gets the slot, without submitting anything: the
    block is over and would only cancel the app. Its launch events are QUEUED then FAILED."""
    backend, clock, runner = scripted(
        submit_latency=5, limits={NAME: Limits(max_concurrent_submits=1)}
    )
    async with runner:
        async with runner.launch_events() as events:
            with pytest.raises(KeyError):
                async with runner.launch_group() as group:
                    first = asyncio.create_task(group.launch(app("first"), NAME))
                    queued = asyncio.create_task(group.launch(app("queued"), NAME))
                    with anyio.fail_after(10):
                        async for event in events:
                            if event.phase == LaunchPhase.QUEUED:
                                break
                    await backend.wait_until(lambda: backend.in_flight_submits == 1)
                    raise KeyError("the block fails")
            clock.advance(5)  # the first submit (in flight when the block failed) completes
            with pytest.raises(RuntimeError, match="ended while"):
                await asyncio.wait_for(first, 10)
            # before the fix the queued launch reached the backend: let that submit finish, so
            # that the test fails on the assertions below rather than hanging
            sent = asyncio.create_task(backend.wait_until(lambda: backend.in_flight_submits == 1))
            done, _ = await asyncio.wait(
                {queued, sent}, timeout=10, return_when=asyncio.FIRST_COMPLETED
            )
            sent.cancel()
            if sent in done:
                clock.advance(5)
            with pytest.raises(RuntimeError, match="nothing was submitted"):
                await asyncio.wait_for(queued, 10)
        seen = [e async for e in events]
    assert [a.app.name for a in backend.apps.values()] == ["first"]
    assert backend.calls["submit"] == 1 and backend.calls["cancel"] == 1
    # (its QUEUED event was read inside the block)
    [refused] = [e for e in seen if e.app_name == "queued"]
    assert refused.phase == LaunchPhase.FAILED and "nothing was submitted" in (refused.error or "")


class _SlowCancelScheduler(ScriptedScheduler):
    """A scripted scheduler whose cancel takes 0.3 s (a slow ``scancel`` or API server)."""

    async def _cancel_existing(self, app_id: str) -> None:
        await asyncio.sleep(0.3)  # the backend's slowness under test, not a synchronisation
        await super()._cancel_existing(app_id)


async def test_a_cleanup_timeout_shorter_than_the_cancel_call_still_cancels_the_app(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Leaving a launched() block by an exception with a cleanup_timeout shorter than the
    backend's cancel call still cancels the app: the timeout bounds only the wait for the app to
    end, so the block is left with the app CANCELLED and no warning."""
    backend = ScriptedBackend(NAME)

    def factory(session_name: str, **_: Any) -> ScriptedScheduler:
        view = _SlowCancelScheduler(backend, session_name)
        backend._views.append(view)
        return view

    async with AsyncRunner("t", scheduler_factories={NAME: factory}) as runner:
        with pytest.raises(OSError, match="boom"), caplog.at_level(logging.WARNING):
            async with runner.launched(app(), NAME, cleanup_timeout=0.1):
                raise OSError("boom")
        [submitted] = backend.apps.values()
        assert submitted.cancelled, f"the app was never cancelled: {submitted.state}"
        assert submitted.state == AppState.CANCELLED
    assert "not terminal" not in caplog.text and "could not be cancelled" not in caplog.text


async def test_a_refused_cancel_is_reported_as_not_cancelled_with_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When the backend refuses the clean-up's cancel, the warning (block raised) or the
    RuntimeError (normal exit with cancel_on_normal_exit) says the app could not be cancelled
    and why, instead of claiming the block cancelled an app that was merely slow to end."""
    backend, _clock, runner = scripted(
        faults=[
            Fault("cancel", 1, ConnectionError("api server down")),
            Fault("cancel", 2, ConnectionError("api server still down")),
        ]
    )
    async with runner:
        with pytest.raises(OSError, match="boom"), caplog.at_level(logging.WARNING):
            async with runner.launched(app(), NAME) as first:
                raise OSError("boom")
        assert f"could not be cancelled on leaving the launch block: {first}" in caplog.text
        assert "ConnectionError: api server down" in caplog.text
        assert "not terminal" not in caplog.text
        with pytest.raises(RuntimeError, match="could not be cancelled") as caught:
            async with runner.launched(app(), NAME, cancel_on_normal_exit=True) as second:
                pass
        assert second in str(caught.value) and "api server still down" in str(caught.value)
        assert all(a.state == AppState.RUNNING for a in backend.apps.values())


async def test_gang_failed_error_counts_only_the_apps_it_cancelled() -> None:
    """GangFailedError says how many other apps were cancelled: here none, since the only other
    app of the gang had already SUCCEEDED when its sibling failed; no cancel is sent to it."""
    backend, clock, runner = scripted(
        scripts={
            "quick": AppScript(states=[(0, AppState.SUCCEEDED)]),
            "bad": AppScript(states=[(0, AppState.RUNNING), (5, AppState.FAILED)]),
        }
    )
    async with runner:
        with anyio.fail_after(10), pytest.raises(GangFailedError) as caught:
            async with runner.launch_group(gang=True) as gang:
                quick = await gang.launch(app("quick"), NAME)
                await runner.wait(quick)
                await gang.launch(app("bad"), NAME)
                clock.advance(5)
                await gang.wait()
    assert backend.app("quick-1").state == AppState.SUCCEEDED
    assert not backend.app("quick-1").cancelled
    assert backend.calls["cancel"] == 0
    assert "other 0 app(s) were cancelled" in str(caught.value), str(caught.value)


async def test_a_refused_submit_of_a_cancelled_launch_block_is_reported_failed() -> None:
    """A launched() block cancelled while the backend is asked waits for the answer (by design);
    when that answer is a refusal, launch_events() reports FAILED with the backend's reason (the
    caller still gets its CancelledError), not CANCELLED."""
    backend, clock, runner = scripted(
        submit_latency=1, faults=[Fault("submit", 1, RuntimeError("quota exceeded"))]
    )
    async with runner:
        async with runner.launch_events() as events:

            async def block() -> None:
                async with runner.launched(app(), NAME):
                    pytest.fail("the block should not be entered")

            task = asyncio.create_task(block())
            await backend.wait_until(lambda: backend.in_flight_submits == 1)
            task.cancel()
            clock.advance(1)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        seen: list[LaunchEvent] = [e async for e in events]
    phases = [e.phase for e in seen]
    assert phases == [LaunchPhase.SENT, LaunchPhase.FAILED], phases
    assert seen[-1].error is not None and "quota exceeded" in seen[-1].error
    assert not backend.apps
