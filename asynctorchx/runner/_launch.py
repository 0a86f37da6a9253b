"""Scoped launches: apps that are cancelled when the code that launched them fails or is cancelled.

``runner.launched(...)`` (one app) and ``runner.launch_group(...)`` (many, optionally as a gang) are
async context managers. When their block is left by an exception or by the cancellation of the
enclosing task, every app they launched is cancelled and waited for until it is terminal. That
clean-up runs in a task of the runner, so neither a second ``Task.cancel()`` nor an anyio cancel
scope interrupts it, and it is bounded by ``cleanup_timeout``.

A submission made inside such a block is protected too: a cancellation that arrives while the
backend is being asked waits for its answer (the app exists or not, and then the block knows it)
instead of abandoning a job nobody knows the id of. A launch still waiting for a submit slot
(``Limits``) is cancelled at once and submits nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from asynctorchx._tasks import TaskSupervisor, wait_held
from asynctorchx.specs.api import AppDef, AppHandle, AppState, AppStatus, CfgVal

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_CLEANUP_TIMEOUT = 60.0

#: ``watch_final(handle, on_final)`` calls ``on_final(status)`` once the app is final (at once if it
#: is already) and returns the function that stops watching.
WatchFinal = Callable[[AppHandle, Callable[[AppStatus | None], None]], Callable[[], None]]


@dataclass(frozen=True)
class Launcher:
    """What a launch block needs of the runner: its calls (bound methods of ``AsyncRunner``), the
    supervisor its clean-up runs in, and a way to hear that an app is final."""

    run: Callable[..., Awaitable[AppHandle]]
    run_component: Callable[..., Awaitable[AppHandle]]
    cancel: Callable[[AppHandle], Awaitable[None]]
    wait: Callable[[AppHandle], Awaitable[AppStatus | None]]
    wait_all: Callable[..., Awaitable[dict[AppHandle, AppStatus | None]]]
    supervisor: TaskSupervisor
    watch_final: WatchFinal
    #: True once the runner's close has begun (it then refuses every call)
    closed: Callable[[], bool]


class GangFailedError(Exception):
    """Raised when an app of a gang (``launch_group(gang=True)``) did not succeed.

    The other apps of the gang were cancelled (and waited for) before this was raised.

    Attributes:
        handle: the app that ended first without succeeding.
        status: its final status (None when its scheduler no longer knows it).
    """

    def __init__(self, handle: AppHandle, status: AppStatus | None, others: int) -> None:
        state = status.state.name if status is not None else "UNKNOWN"
        super().__init__(
            f"app {handle} of the gang ended {state}; the other {others} app(s) were cancelled"
        )
        self.handle = handle
        self.status = status


@dataclass
class _SubmitGuard:
    """Set (as a context variable) by a launch group around the submissions it makes."""

    on_submitted: Callable[[AppHandle], None]


_SUBMIT_GUARD: contextvars.ContextVar[_SubmitGuard | None] = contextvars.ContextVar(
    "asynctorchx_submit_guard", default=None
)


def submit_guard() -> _SubmitGuard | None:
    """The guard of the launch group making the current submission, if any."""
    return _SUBMIT_GUARD.get()


async def _outcome(coro: Coroutine[Any, Any, T]) -> tuple[T | None, Exception | None]:
    """``(result, None)`` or ``(None, exception)``: the caller gets the exception, not the
    supervisor (which would log it as a failed background task)."""
    try:
        return await coro, None
    except Exception as e:
        return None, e


async def shielded(
    supervisor: TaskSupervisor,
    coro: Coroutine[Any, Any, T],
    name: str,
    on_result: Callable[[T], None] | None = None,
) -> T:
    """Runs ``coro`` to completion even if the caller is cancelled meanwhile.

    ``coro`` runs as a task of ``supervisor``; the caller waits for it under an anyio shield (scope
    cancellation) and through ``Task.cancel()`` (native cancellation). ``on_result`` gets the result
    first; then a cancellation that arrived meanwhile is raised (even if ``coro`` failed), else the
    result is returned or ``coro``'s exception raised.

    Raises:
        RuntimeError: the supervisor was closed (the runner closed) before the task finished.
    """
    wrapped = _outcome(coro)
    try:
        task = supervisor.spawn(wrapped, name=name)
    except RuntimeError:
        wrapped.close()  # never started: no "coroutine was never awaited" warning
        coro.close()
        raise RuntimeError("the runner is closed") from None
    cancelled = await wait_held(task)
    if task.cancelled():
        raise RuntimeError(f"the runner was closed during {name}")
    result, error = task.result()
    if error is None and on_result is not None:
        on_result(result)  # type: ignore[arg-type]  # coro returned a T
    if cancelled is not None:
        raise cancelled
    if error is not None:
        raise error
    return result  # type: ignore[return-value]  # coro returned a T


def _check_timeout(value: object) -> float:
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            seconds = float(value)
    if not 0 < seconds < math.inf:
        raise ValueError(f"cleanup_timeout must be a finite number of seconds > 0, got {value!r}")
    return seconds


@dataclass
class _Member:
    handle: AppHandle
    stop_watching: Callable[[], None] | None = None


@dataclass
class LaunchGroup:
    """The apps launched in one ``runner.launch_group()`` block (see ``AsyncRunner.launch_group``).

    ``launch`` may be called from several tasks at once (e.g. tasks of an ``asyncio.TaskGroup``
    inside the block).
    """

    _runner: Launcher
    gang: bool
    _scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    _members: dict[AppHandle, _Member] = field(default_factory=dict)
    _failure: tuple[AppHandle, AppStatus | None] | None = None
    _closing: bool = False
    _runner_closed: bool = False
    # set when the block ends: whether an app whose submit was still in flight then is cancelled
    _cancel_late: bool = False
    _cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT

    @property
    def handles(self) -> list[AppHandle]:
        """The handles of the apps launched so far, in launch order."""
        return list(self._members)

    async def launch(
        self,
        app: AppDef | str,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None = None,
        *,
        component_args: Sequence[str] | Mapping[str, Any] | None = None,
        **run_kwargs: Any,
    ) -> AppHandle:
        """Submits an app (an ``AppDef``, or a component name with ``component_args``) into the group.

        Keyword arguments not named here go to ``run``/``run_component`` as they are.

        Raises:
            RuntimeError: the group's block has ended (also when it ended while this app was being
                submitted, from a task that outlived the block, and the block's apps were
                cancelled: this app then was too).
            TypeError: ``component_args`` given with an ``AppDef``.
        """
        if self._closing:
            raise RuntimeError("the launch group's block has ended: launch no more apps into it")
        late: list[AppHandle] = []
        try:
            handle = await self._launch(app, scheduler, cfg, component_args, late, run_kwargs)
        except BaseException:
            await self._cleanup(late, self._cleanup_timeout)
            raise
        if late:
            await self._cleanup(late, self._cleanup_timeout)
            raise RuntimeError(
                f"the launch group's block ended while {handle} was being submitted: "
                "it was cancelled with the group's other apps"
            )
        return handle

    async def _launch(
        self,
        app: AppDef | str,
        scheduler: str,
        cfg: Mapping[str, CfgVal] | None,
        component_args: Sequence[str] | Mapping[str, Any] | None,
        late: list[AppHandle],
        run_kwargs: dict[str, Any],
    ) -> AppHandle:
        guard = _SubmitGuard(lambda handle: self._add(handle, late))
        token = _SUBMIT_GUARD.set(guard)
        try:
            if isinstance(app, AppDef):
                if component_args is not None:
                    raise TypeError(
                        f"component_args apply to a component name, not to an AppDef "
                        f"(app {app.name!r}); got {component_args!r}"
                    )
                return await self._runner.run(app, scheduler, cfg, **run_kwargs)
            if isinstance(app, str):
                return await self._runner.run_component(
                    app,
                    [] if component_args is None else component_args,
                    scheduler,
                    cfg,
                    **run_kwargs,
                )
            raise TypeError(f"expected an AppDef or a component name, got {app!r}")
        finally:
            _SUBMIT_GUARD.reset(token)

    def _add(self, handle: AppHandle, late: list[AppHandle]) -> None:
        """Called by the runner as soon as the backend returned the app's id (before any await);
        an app submitted after the block ended goes to ``late`` if the block cancelled its apps."""
        if self._closing and self._cancel_late:
            late.append(handle)
            return
        member = _Member(handle)
        self._members[handle] = member
        # after the block, nobody would stop watching it; a closed runner watches nothing
        if self.gang and not self._closing and not self._runner.closed():
            member.stop_watching = self._runner.watch_final(
                handle, lambda status: self._on_final(handle, status)
            )

    def _on_final(self, handle: AppHandle, status: AppStatus | None) -> None:
        if self._closing or self._failure is not None:
            return
        if status is None or status.state != AppState.SUCCEEDED:
            self._failure = (handle, status)
            self._scope.cancel()

    async def wait(self, timeout: float | None = None) -> dict[AppHandle, AppStatus | None]:  # noqa: ASYNC109
        """Waits until every app launched so far is terminal; ``{handle: final status or None}``.

        In a gang, an app that does not succeed ends the block with ``GangFailedError`` instead.

        Raises:
            TimeoutError: an app was still running after ``timeout`` seconds.
        """
        return await self._runner.wait_all(self.handles, timeout=timeout)

    def _detach(self) -> None:
        for member in self._members.values():
            if member.stop_watching is not None:
                member.stop_watching()

    async def _stop_all(self, handles: list[AppHandle], seconds: float) -> list[AppHandle]:
        """Cancels ``handles`` and waits for them to be terminal; returns those not confirmed in time."""
        runner = self._runner
        unconfirmed = set(handles)

        async def stop(handle: AppHandle) -> None:
            try:
                await runner.cancel(handle)
                await runner.wait(handle)
                unconfirmed.discard(handle)
            except Exception:
                if runner.closed():  # it refuses calls now: the block reports that
                    return
                logger.exception("cancelling %s on leaving its launch block failed", handle)

        with anyio.move_on_after(seconds):
            async with anyio.create_task_group() as tg:
                for handle in handles:
                    tg.start_soon(stop, handle)
        return [h for h in handles if h in unconfirmed]

    async def _cleanup(self, handles: list[AppHandle], seconds: float) -> list[AppHandle]:
        if not handles:
            return []
        if self._runner.closed():  # (its close may still be under way: it refuses calls)
            self._runner_closed = True
            return handles
        try:
            left = await shielded(
                self._runner.supervisor,
                self._stop_all(handles, seconds),
                name="cancel launched apps",
            )
        except RuntimeError:  # the runner closed: it stopped what it owns; nothing more to do here
            self._runner_closed = True
            return handles
        if left and self._runner.closed():  # closed during the clean-up: not a timeout
            self._runner_closed = True
        return left

    def _not_stopped(self, left: list[AppHandle], timeout: float) -> str:
        if self._runner_closed:
            return (
                f"the runner was closed inside the launch block, so {len(left)} app(s) it "
                f"launched were not cancelled: {', '.join(left)}"
            )
        return (
            f"{len(left)} app(s) were not terminal {timeout:g} s after the launch block "
            f"cancelled them: {', '.join(left)}"
        )


@contextlib.asynccontextmanager
async def launch_group(
    runner: Launcher,
    *,
    gang: bool = False,
    cancel_on_exit: bool = True,
    cancel_on_normal_exit: bool = False,
    cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT,
) -> AsyncIterator[LaunchGroup]:
    """See ``AsyncRunner.launch_group``."""
    timeout = _check_timeout(cleanup_timeout)
    group = LaunchGroup(runner, gang, _cleanup_timeout=timeout)
    ended_normally = False
    try:
        with group._scope:
            yield group
            ended_normally = True
    finally:
        group._closing = True
        group._detach()
        failure = group._failure
        if failure is not None:
            stop = [h for h in group.handles if h != failure[0]]
        elif ended_normally:
            stop = group.handles if cancel_on_normal_exit else []
        else:
            stop = group.handles if cancel_on_exit else []
        group._cancel_late = failure is not None or (
            cancel_on_normal_exit if ended_normally else cancel_on_exit
        )
        left = await group._cleanup(stop, timeout)
        if left and (failure is not None or not ended_normally):  # else raised below
            logger.warning("%s", group._not_stopped(left, timeout))
    if failure is not None:
        raise GangFailedError(failure[0], failure[1], len(stop))
    if left:
        error = RuntimeError if group._runner_closed else TimeoutError
        raise error(group._not_stopped(left, timeout))


@contextlib.asynccontextmanager
async def launched(
    runner: Launcher,
    app: AppDef | str,
    scheduler: str,
    cfg: Mapping[str, CfgVal] | None = None,
    *,
    component_args: Sequence[str] | Mapping[str, Any] | None = None,
    cancel_on_exit: bool = True,
    cancel_on_normal_exit: bool = False,
    cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT,
    **run_kwargs: Any,
) -> AsyncIterator[AppHandle]:
    """See ``AsyncRunner.launched``."""
    async with launch_group(
        runner,
        cancel_on_exit=cancel_on_exit,
        cancel_on_normal_exit=cancel_on_normal_exit,
        cleanup_timeout=cleanup_timeout,
    ) as group:
        yield await group.launch(app, scheduler, cfg, component_args=component_args, **run_kwargs)
