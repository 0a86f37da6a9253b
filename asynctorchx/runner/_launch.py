"""Scoped launches: apps that are cancelled when the code that launched them fails or is cancelled.

``runner.launched(...)`` (one app) and ``runner.launch_group(...)`` (many, optionally as a gang) are
async context managers. When their block is left by an exception or by the cancellation of the
enclosing task, every app they launched is cancelled and waited for until it is terminal. That
clean-up runs in a task of the runner, so neither a second ``Task.cancel()`` nor an anyio cancel
scope interrupts it. Every cancel is carried to the backend whatever ``cleanup_timeout`` is (a
cancel cut off would leave the app running with nobody owning it; only the runner's
``close_timeout`` bounds a backend that never answers); ``cleanup_timeout`` bounds the wait for the
cancelled apps to end. Apps the runner already saw end are not cancelled.

A submission made inside such a block is protected too: a cancellation that arrives while the
backend is being asked waits for its answer (the app exists or not, and then the block knows it)
instead of abandoning a job nobody knows the id of. A launch still waiting for a submit slot
(``Limits``) is cancelled at once and submits nothing; one that gets its slot after its block ended
by an exception submits nothing either (it raises RuntimeError).
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
    #: True when the runner already saw the app end (its status hub's entry is final)
    known_final: Callable[[AppHandle], bool]
    #: the runner's ``close_timeout``: how long a clean-up's cancel call may take
    close_timeout: float


class GangFailedError(Exception):
    """Raised when an app of a gang (``launch_group(gang=True)``) did not succeed.

    The other apps of the gang that had not ended yet were cancelled (and waited for) before this
    was raised; the message says how many.

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
    #: True once the group's block has ended and cancels what is submitted late: a launch that
    #: only now gets its submit slot (or its turn) must submit nothing, since the app would only
    #: be cancelled again, and on the cluster the limits are there to spare
    closing: Callable[[], bool]


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
    on_error: Callable[[Exception], None] | None = None,
) -> T:
    """Runs ``coro`` to completion even if the caller is cancelled meanwhile.

    ``coro`` runs as a task of ``supervisor``; the caller waits for it under an anyio shield (scope
    cancellation) and through ``Task.cancel()`` (native cancellation). ``on_result`` gets the result
    first; then a cancellation that arrived meanwhile is raised (even if ``coro`` failed: then
    ``on_error`` gets ``coro``'s exception first, which the caller would otherwise never see), else
    the result is returned or ``coro``'s exception raised.

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
        if error is not None and on_error is not None:
            on_error(error)
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
class _Cleanup:
    """What a launch block's clean-up did with the apps it was to stop."""

    #: the apps whose cancel the backend accepted
    cancelled: list[AppHandle] = field(default_factory=list)
    #: the apps whose cancel failed or was not sent, with why: they may well still run
    not_cancelled: dict[AppHandle, str] = field(default_factory=dict)
    #: the apps cancelled but not seen terminal within ``cleanup_timeout``
    not_terminal: list[AppHandle] = field(default_factory=list)
    #: the runner was closed first: it refused the calls, and these apps were not cancelled
    runner_closed: list[AppHandle] = field(default_factory=list)

    @property
    def left(self) -> list[AppHandle]:
        """The apps not confirmed stopped."""
        return [*self.runner_closed, *self.not_cancelled, *self.not_terminal]


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
                cancelled: this app then was too; and when it ended so while this launch still
                waited for its submit slot or its turn: then nothing was submitted).
            TypeError: ``component_args`` given with an ``AppDef``.
        """
        if self._closing:
            raise RuntimeError("the launch group's block has ended: launch no more apps into it")
        late: list[AppHandle] = []
        try:
            handle = await self._launch(app, scheduler, cfg, component_args, late, run_kwargs)
        except BaseException:
            self._report_late(await self._cleanup(late, self._cleanup_timeout))
            raise
        if late:
            self._report_late(await self._cleanup(late, self._cleanup_timeout))
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
        guard = _SubmitGuard(
            lambda handle: self._add(handle, late), lambda: self._closing and self._cancel_late
        )
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

    async def _stop_all(self, handles: list[AppHandle], seconds: float) -> _Cleanup:
        """Cancels ``handles`` and waits (``seconds`` after each cancel) for them to be terminal."""
        runner = self._runner
        # a cancel cut off by cleanup_timeout would leave the app running while the block believes
        # it cancelled it: every cancel runs to its end, bounded only as the runner's close bounds
        # a backend call (a backend that never answers must not hold the block forever)
        bound = runner.close_timeout
        cancelled: set[AppHandle] = set()
        terminal: set[AppHandle] = set()
        not_cancelled: dict[AppHandle, str] = {}

        async def stop(handle: AppHandle) -> None:
            try:
                with anyio.move_on_after(bound) as scope:
                    await runner.cancel(handle)
            except Exception as e:
                if not runner.closed():  # (a closed runner refuses calls: the block reports that)
                    not_cancelled[handle] = f"{type(e).__name__}: {e}"
                return
            if scope.cancelled_caught:
                not_cancelled[handle] = (
                    f"the backend did not answer the cancel within {bound:g} s "
                    "(AsyncRunner close_timeout)"
                )
                return
            cancelled.add(handle)
            with anyio.move_on_after(seconds):
                try:
                    await runner.wait(handle)
                except Exception:
                    if not runner.closed():
                        logger.exception(
                            "waiting for %s to end after its launch block cancelled it failed",
                            handle,
                        )
                    return
                terminal.add(handle)

        async with anyio.create_task_group() as tg:
            for handle in handles:
                tg.start_soon(stop, handle)
        done = _Cleanup(cancelled=[h for h in handles if h in cancelled])
        for handle in handles:
            if handle in not_cancelled:
                done.not_cancelled[handle] = not_cancelled[handle]
            elif handle not in terminal:
                if handle in cancelled:
                    done.not_terminal.append(handle)
                else:  # neither cancelled nor refused: the runner closed under it
                    done.runner_closed.append(handle)
        return done

    async def _cleanup(self, handles: list[AppHandle], seconds: float) -> _Cleanup:
        if not handles:
            return _Cleanup()
        if self._runner.closed():  # (its close may still be under way: it refuses calls)
            self._runner_closed = True
            return _Cleanup(runner_closed=list(handles))
        try:
            done = await shielded(
                self._runner.supervisor,
                self._stop_all(handles, seconds),
                name="cancel launched apps",
            )
        except RuntimeError:  # the runner closed: it stopped what it owns; nothing more to do here
            self._runner_closed = True
            return _Cleanup(runner_closed=list(handles))
        if done.left and self._runner.closed():  # closed during the clean-up: not a timeout
            self._runner_closed = True
        return done

    def _report_late(self, done: _Cleanup) -> None:
        """Logs what the clean-up of a launch that completed after its block could not stop (the
        launch raises its own error)."""
        if done.left:
            logger.warning("%s", self._not_stopped(done, self._cleanup_timeout))

    def _not_stopped(self, done: _Cleanup, timeout: float) -> str:
        if self._runner_closed:
            left = done.left
            return (
                f"the runner was closed inside the launch block, so {len(left)} app(s) it "
                f"launched were not cancelled: {', '.join(left)}"
            )
        parts = []
        if done.not_cancelled:
            why = ", ".join(f"{h} ({reason})" for h, reason in done.not_cancelled.items())
            parts.append(
                f"{len(done.not_cancelled)} app(s) could not be cancelled on leaving the launch "
                f"block: {why}"
            )
        if done.not_terminal:
            parts.append(
                f"{len(done.not_terminal)} app(s) were not terminal {timeout:g} s after the "
                f"launch block cancelled them: {', '.join(done.not_terminal)}"
            )
        return "; ".join(parts)


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
        # an app the runner already saw end needs no cancel, and was not cancelled by the block
        stop = [h for h in stop if not runner.known_final(h)]
        done = await group._cleanup(stop, timeout)
        if done.left and (failure is not None or not ended_normally):  # else raised below
            logger.warning("%s", group._not_stopped(done, timeout))
    if failure is not None:
        raise GangFailedError(failure[0], failure[1], len(done.cancelled))
    if done.left:
        # only apps merely slow to end make a timeout; a refused cancel is an error of its own
        timed_out = not group._runner_closed and not done.not_cancelled
        error = TimeoutError if timed_out else RuntimeError
        raise error(group._not_stopped(done, timeout))


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
