"""ScriptedBackend: an in-memory scheduler whose apps follow the scripts a test gives them."""

from __future__ import annotations

import asyncio
import bisect
import collections
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from asynctorchx.logs import LogQuery, Stream
from asynctorchx.logs._cursor import Position, lines_of
from asynctorchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    check_replica,
    role_replica_counts,
    split_lines,
)
from asynctorchx.specs.api import (
    NONE,
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    ReplicaStatus,
    RoleStatus,
    UnknownAppException,
    is_terminal,
    make_app_handle,
    runopts,
)
from asynctorchx.testing._clock import RealClock, Timer, VirtualClock, _Clock, _seconds
from asynctorchx.testing._script import AppScript, Fault, ScriptError, Transition

ScriptChooser = Callable[[AppDef, Mapping[str, CfgVal]], "AppScript | None"]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ScriptedRequest:
    """The dry-run request of a ScriptedBackend: the app and its resolved cfg, as submitted."""

    app: AppDef
    cfg: Mapping[str, CfgVal]


@dataclass(frozen=True)
class Call:
    """One call the backend received.

    Args:
        operation: submit, describe, describe_many, cancel, list or log_iter.
        time: the backend clock's ``monotonic()`` when it was received.
        app_ids: the apps it was about (all of them for describe_many; none for submit and list).
    """

    operation: str
    time: float
    app_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Line:
    at: float
    text: str
    stream: Stream


class ScriptedApp:
    """One app submitted to a ``ScriptedBackend``: what was submitted, and its script's timeline.

    Attributes:
        app_id: its id (``{name}-{n}``, n counting the backend's submissions from 1).
        session: the session (runner name) that submitted it.
        app: the AppDef as submitted.
        cfg: the resolved run options it was submitted with.
        script: the script it follows.
        submitted_at: the backend clock's ``monotonic()`` at submission.
        submitted_time: the backend clock's ``time()`` at submission (dates its log lines).
        cancelled: True once ``cancel`` was called on it while it was not terminal.
    """

    def __init__(
        self,
        backend: ScriptedBackend,
        app_id: str,
        session: str,
        app: AppDef,
        cfg: Mapping[str, CfgVal],
        script: AppScript,
    ) -> None:
        self.app_id = app_id
        self.session = session
        self.app = app
        self.cfg = dict(cfg)
        self.script = script
        self.submitted_at = backend.clock.monotonic()
        self.submitted_time = backend.clock.time()
        self.cancelled = False
        self._backend = backend
        self._timeline: list[Transition] = list(script.transitions)
        self._lines: dict[tuple[str, int], list[_Line]] = collections.defaultdict(list)
        for line in sorted(script.logs, key=lambda ln: ln.at):  # stable: script order on ties
            text = line.text if line.text.endswith("\n") else line.text + "\n"
            for part in split_lines(text):
                self._lines[(line.role, line.replica)].append(_Line(line.at, part, line.stream))
        self._changed = asyncio.Event()
        self._timer: Timer | None = None
        self._times: list[float] | None = None  # _event_times, until the timeline changes

    # -- the timeline ---------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        """Seconds since submission, on the backend's clock."""
        return self._backend.clock.monotonic() - self.submitted_at

    @property
    def end(self) -> float | None:
        """When (seconds after submission) the app ends or ended, or None if nothing ends it yet."""
        for t in self._timeline:
            if is_terminal(t.state):
                return t.at
        return None

    def status_at(self, elapsed: float) -> tuple[AppState, str | None, int]:
        """``(state, msg, num_restarts)`` at ``elapsed`` seconds after submission."""
        state, msg, restarts = AppState.SUBMITTED, None, 0
        for t in self._timeline:
            if t.at > elapsed:
                break
            state = t.state
            if t.msg is not None:
                msg = t.msg
            if t.num_restarts is not None:
                restarts = t.num_restarts
        return state, msg, restarts

    @property
    def state(self) -> AppState:
        """The app's state now."""
        return self.status_at(self.elapsed)[0]

    def _terminal_now(self) -> bool:
        end = self.end
        return end is not None and end <= self.elapsed

    def _event_times(self) -> list[float]:
        if self._times is None:
            end = self.end
            times = {t.at for t in self._timeline}
            for lines in self._lines.values():
                times.update(ln.at for ln in lines if end is None or ln.at <= end)
            self._times = sorted(times)
        return self._times

    def _arm(self) -> None:
        """Sets the timer of the next transition or log line (one timer per app at a time)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        times = self._event_times()
        i = bisect.bisect_right(times, self.elapsed)
        if i < len(times):
            self._timer = self._backend.clock.call_at(self.submitted_at + times[i], self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._changed_now()
        self._arm()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self._backend._notify(self.app_id)

    def _set(self, state: AppState, msg: str | None, num_restarts: int | None) -> None:
        now = self.elapsed
        if self._terminal_now():
            current = self.status_at(now)[0]
            raise ScriptError(
                f"app {self.app_id!r} is already {current.name}: it cannot become {state.name}"
            )
        self._timeline = [t for t in self._timeline if t.at <= now]
        self._timeline.append(Transition(now, state, msg, num_restarts))
        self._times = None
        self._changed_now()
        self._arm()

    def _cancel(self) -> None:
        if self.cancelled or self._terminal_now():
            return
        self.cancelled = True
        stop = self.elapsed + self.script.stop_delay
        kept: list[Transition] = []
        for t in self._timeline:
            if t.at > stop:
                break
            kept.append(t)
            if is_terminal(t.state):
                break
        if not kept or not is_terminal(kept[-1].state):
            kept.append(Transition(stop, AppState.CANCELLED, "cancelled"))
        self._timeline = kept
        self._times = None
        self._changed_now()
        self._arm()

    def _exit_code(self, role: str, k: int, state: AppState) -> int | None:
        codes = self.script.exit_codes.get(role)
        if codes is None:
            return {AppState.SUCCEEDED: 0, AppState.FAILED: 1}.get(state)
        if isinstance(codes, Sequence):
            return codes[k]
        return codes

    def describe(self) -> DescribeAppResponse:
        """What the backend reports for the app now."""
        state, msg, restarts = self.status_at(self.elapsed)
        terminal = is_terminal(state)
        return DescribeAppResponse(
            app_id=self.app_id,
            state=state,
            num_restarts=restarts,
            msg=NONE if msg is None else msg,
            roles_statuses=[
                RoleStatus(
                    role.name,
                    [
                        ReplicaStatus(
                            id=k,
                            state=state,
                            role=role.name,
                            hostname="scripted",
                            exit_code=self._exit_code(role.name, k, state) if terminal else None,
                        )
                        for k in range(role.num_replicas)
                    ],
                )
                for role in self.app.roles
            ],
            roles=list(self.app.roles),
            name=self.app.name,
        )

    async def _read(
        self,
        role: str,
        k: int,
        stream: Stream,
        pattern: re.Pattern[str] | None,
        lo: float | None,
        hi: float | None,
        follow: bool,
        start: int = 0,
    ) -> AsyncIterator[tuple[int, str]]:
        """``(lines of the selection read, line)`` pairs from the ``start``-th line on."""
        entries = [
            ln
            for ln in self._lines.get((role, k), [])
            if stream == Stream.COMBINED or ln.stream == stream
        ]
        if start > len(entries):
            raise ValueError(
                f"log cursor index {start} is past the end of the script's log of {role}/{k} "
                f"({len(entries)} lines): the cursor was not taken on this log"
            )
        i = start
        while True:
            changed = self._changed
            now = self.elapsed
            end = self.end
            limit = now if end is None else min(now, end)
            while i < len(entries) and entries[i].at <= limit:
                line = entries[i]
                i += 1
                ts = self.submitted_time + line.at
                if (lo is not None and ts < lo) or (hi is not None and ts > hi):
                    continue
                if pattern is None or pattern.search(line.text):
                    yield i, line.text
            if not follow or (end is not None and end <= now):
                return
            await changed.wait()

    def __repr__(self) -> str:
        return f"<ScriptedApp {self.app_id} {self.state.name} at {self.elapsed:g} s>"


class ScriptedBackend:
    """An in-memory cluster for tests: register it on a runner, its apps follow scripts.

    It is a scheduler factory: ``AsyncRunner(scheduler_factories={"slurm": backend})`` with
    ``backend = ScriptedBackend("slurm", ...)`` makes the runner's ``slurm`` an in-memory
    scheduler (the name must match). Nothing runs: no process, container or network call. The
    backend keeps the apps of every runner (session) that uses it, like a real cluster.

    What the test can inspect: ``apps`` (by id, in submission order), ``calls`` (a Counter of the
    operations: submit, describe, describe_many, cancel, list, log_iter), ``call_log`` (each
    ``Call`` with its time and app ids), ``described``, ``in_flight_submits`` and
    ``max_in_flight_submits``; ``wait_until`` waits for a condition on them.

    Args:
        name: the scheduler name it answers to (part of every handle).
        default: the script of apps no other script is chosen for (default: RUNNING from the
            start until cancelled).
        scripts: ``{app name: AppScript}``, or a function ``(app, cfg) -> AppScript | None``
            (None: the default).
        clock: a ``VirtualClock`` to time scripts on (default: real time).
        faults: calls that raise (see ``Fault``); more can be added with ``add_fault``.
        submit_latency: seconds each submit takes, on the clock.
        run_opts: the run options to check cfgs against (default: none; any cfg is accepted and
            recorded).
        push: report changes at once (as the local backend does); False makes the runner poll.

    Raises:
        ScriptError: a bad script, fault or latency.
    """

    def __init__(
        self,
        name: str = "scripted",
        default: AppScript | None = None,
        scripts: Mapping[str, AppScript] | ScriptChooser | None = None,
        *,
        clock: VirtualClock | None = None,
        faults: Iterable[Fault] = (),
        submit_latency: float = 0.0,
        run_opts: runopts | None = None,
        push: bool = True,
    ) -> None:
        if not isinstance(name, str) or not re.fullmatch(r"[^:/\s]+", name):
            raise ScriptError(
                f"name must be a scheduler name without ':', '/' or spaces, got {name!r}"
            )
        if default is not None and not isinstance(default, AppScript):
            raise ScriptError(f"default must be an AppScript, got {default!r}")
        if isinstance(scripts, Mapping):
            for app_name, script in scripts.items():
                if not isinstance(script, AppScript):
                    raise ScriptError(f"scripts[{app_name!r}] must be an AppScript, got {script!r}")
        elif scripts is not None and not callable(scripts):
            raise ScriptError(f"scripts must be a mapping or a function, got {scripts!r}")
        if clock is not None and not isinstance(clock, VirtualClock):
            raise ScriptError(
                f"clock must be a VirtualClock (or None for real time), got {clock!r}"
            )
        self.submit_latency = _seconds(submit_latency, "submit_latency", ScriptError)
        self.name = name
        self.default = default or AppScript()
        self.scripts = scripts
        self.clock: _Clock = clock or RealClock()
        self.run_opts = run_opts or runopts()
        self.push = push
        self.apps: dict[str, ScriptedApp] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.call_log: list[Call] = []
        self.in_flight_submits = 0
        self.max_in_flight_submits = 0
        self._faults: dict[tuple[str, int], BaseException] = {}
        for fault in faults:
            self.add_fault(fault)
        self._views: list[ScriptedScheduler] = []
        self._progress = asyncio.Event()
        self._ids = 0

    # -- the factory ----------------------------------------------------------------------------

    def __call__(self, session_name: str, **scheduler_params: Any) -> ScriptedScheduler:
        """Makes this backend's scheduler for a runner (the runner calls it)."""
        view = ScriptedScheduler(self, session_name)
        self._views.append(view)
        return view

    # -- what the test drives and inspects ------------------------------------------------------

    def add_fault(self, fault: Fault) -> None:
        """Makes the ``fault.call``-th call of ``fault.operation`` raise ``fault.error``."""
        if not isinstance(fault, Fault):
            raise ScriptError(f"expected a Fault, got {fault!r}")
        self._faults[(fault.operation, fault.call)] = fault.error

    def app(self, app_id: str) -> ScriptedApp:
        """The app of that id.

        Raises:
            KeyError: no such app (the message lists the ids).
        """
        try:
            return self.apps[app_id]
        except KeyError:
            raise KeyError(
                f"no scripted app {app_id!r} (apps: {', '.join(self.apps) or 'none'})"
            ) from None

    def set_state(
        self,
        app_id: str,
        state: AppState,
        msg: str | None = None,
        num_restarts: int | None = None,
    ) -> None:
        """Moves the app to ``state`` now; the rest of its script is dropped.

        Raises:
            ScriptError: the app is already terminal.
        """
        self.app(app_id)._set(state, msg, num_restarts)

    async def wait_for_submissions(self, count: int, timeout: float = 10.0) -> list[ScriptedApp]:  # noqa: ASYNC109
        """Returns the apps once at least ``count`` were submitted (all of them, in order).

        Raises:
            TimeoutError: fewer were submitted within ``timeout`` real seconds.
        """
        await self.wait_until(lambda: len(self.apps) >= count, timeout)
        return list(self.apps.values())

    async def wait_until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Returns once ``condition()`` holds; it is checked after every call and submission.

        E.g. ``await backend.wait_until(lambda: "app-1" in backend.described)``: the runner has
        seen the app's state.

        Raises:
            TimeoutError: it did not hold within ``timeout`` real seconds.
        """
        with anyio.fail_after(timeout):
            while not condition():
                await self._progress.wait()

    @property
    def described(self) -> set[str]:
        """The ids of the apps that some ``describe`` or ``describe_many`` call asked about."""
        return {
            a
            for c in self.call_log
            if c.operation in ("describe", "describe_many")
            for a in c.app_ids
        }

    # -- for the schedulers ---------------------------------------------------------------------

    def _call(self, operation: str, app_ids: Sequence[str] = ()) -> BaseException | None:
        self.calls[operation] += 1
        self.call_log.append(Call(operation, self.clock.monotonic(), tuple(app_ids)))
        self._poke()
        return self._faults.get((operation, self.calls[operation]))

    def _poke(self) -> None:
        """Wakes ``wait_until``."""
        self._progress.set()
        self._progress = asyncio.Event()

    def _notify(self, app_id: str) -> None:
        for view in self._views:
            view._notify(app_id)

    def _script_for(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppScript:
        script: AppScript | None = None
        if isinstance(self.scripts, Mapping):
            script = self.scripts.get(app.name)
        elif self.scripts is not None:
            script = self.scripts(app, cfg)
            if script is not None and not isinstance(script, AppScript):
                raise ScriptError(
                    f"the scripts function returned {script!r} for app {app.name!r}: "
                    f"expected an AppScript or None"
                )
        script = script or self.default
        script.check_app(app)
        return script

    async def _submit(self, session: str, request: ScriptedRequest) -> str:
        fault = self._call("submit")
        self.in_flight_submits += 1
        self.max_in_flight_submits = max(self.max_in_flight_submits, self.in_flight_submits)
        try:
            if self.submit_latency:
                await self.clock.sleep(self.submit_latency)
            if fault is not None:
                raise fault
            script = self._script_for(request.app, request.cfg)
            self._ids += 1
            app_id = f"{_NAME_CHARS.sub('-', request.app.name)[:40] or 'app'}-{self._ids}"
            app = ScriptedApp(self, app_id, session, request.app, request.cfg, script)
            self.apps[app_id] = app
            app._arm()
        finally:
            self.in_flight_submits -= 1
        self._poke()
        self._notify(app_id)
        return app_id

    def __repr__(self) -> str:
        return f"<ScriptedBackend {self.name!r}: {len(self.apps)} app(s)>"


class ScriptedScheduler(Scheduler[ScriptedRequest]):
    """The view of a ``ScriptedBackend`` that one runner (session) uses; made by the backend."""

    log_cursor_kind = "index"

    def __init__(self, backend: ScriptedBackend, session_name: str) -> None:
        super().__init__(backend.name, session_name)
        self.scripted = backend

    @property
    def pushes_changes(self) -> bool:  # type: ignore[override]
        return self.scripted.push

    @property
    def closed(self) -> bool:
        """True once the runner closed this scheduler."""
        return self._closed

    def _run_opts(self) -> runopts:
        return self.scripted.run_opts

    def _submit_dryrun(
        self, app: AppDef, cfg: Mapping[str, CfgVal]
    ) -> AppDryRunInfo[ScriptedRequest]:
        return AppDryRunInfo(
            ScriptedRequest(app, dict(cfg)), lambda r: f"scripted app {r.app.name!r} cfg={r.cfg}"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the scripted scheduler {self.backend!r} is closed")

    async def schedule(self, dryrun_info: AppDryRunInfo[ScriptedRequest]) -> str:
        self._check_open()
        request = dryrun_info.request
        if not isinstance(request, ScriptedRequest):
            raise TypeError(f"not a dry run of a scripted scheduler: {dryrun_info!r}")
        return await self.scripted._submit(self.session_name, request)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        self._check_open()
        fault = self.scripted._call("describe", (app_id,))
        if fault is not None:
            raise fault
        app = self.scripted.apps.get(app_id)
        return None if app is None else app.describe()

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        self._check_open()
        fault = self.scripted._call("describe_many", app_ids)
        if fault is not None:
            raise fault
        apps = self.scripted.apps
        return {a: (apps[a].describe() if a in apps else None) for a in dict.fromkeys(app_ids)}

    async def exists(self, app_id: str) -> bool:
        """True when the backend holds the app (in memory: no ``describe`` call is counted)."""
        self._check_open()
        return app_id in self.scripted.apps

    async def _cancel_existing(self, app_id: str) -> None:
        self._check_open()
        fault = self.scripted._call("cancel", (app_id,))
        if fault is not None:
            raise fault
        self.scripted.app(app_id)._cancel()

    async def list(self) -> list[ListAppResponse]:
        self._check_open()
        fault = self.scripted._call("list")
        if fault is not None:
            raise fault
        return [
            ListAppResponse(
                app_id=a.app_id,
                state=a.state,
                app_handle=make_app_handle(self.backend, a.session, a.app_id),
                name=a.app.name,
            )
            for a in self.scripted.apps.values()
        ]

    def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        """The script's lines of the replica written so far (a ``log_iter`` fault raises at the
        first iteration, with the unknown app, role and replica errors)."""
        return lines_of(self._log_entries(query))

    async def _log_entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """``_log_iter`` with positions: how many lines of the stream selection were read (the
        index of the next one), after ``query.after`` when set."""
        self._check_open()
        fault = self.scripted._call("log_iter", (query.app_id,))
        if fault is not None:
            raise fault
        app = self.scripted.apps.get(query.app_id)
        if app is None:
            raise UnknownAppException(
                make_app_handle(self.backend, self.session_name, query.app_id),
                f"no scripted app {query.app_id!r}",
            )
        check_replica(query.app_id, role_replica_counts(app.app.roles), query.role, query.k)
        lines = app._read(
            query.role,
            query.k,
            query.stream,
            query.regex,
            query.since,
            query.until,
            query.follow,
            0 if query.after is None else int(query.after.position[0]),
        )
        async for i, line in lines:
            yield (i,), line

    async def close(self) -> None:
        if self in self.scripted._views:
            self.scripted._views.remove(self)
        await super().close()
