"""An in-memory scheduler for unit tests of the runner's control flow (hub pacing, error paths).

The real-process behaviour is covered by the tests that run the local backend; this fake lets a test
set an app's state at an exact moment and count the backend round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio

from asynctorchx.logs import LogQuery
from asynctorchx.schedulers.api import (
    DescribeAppResponse,
    ListAppResponse,
    Scheduler,
    check_replica,
    role_replica_counts,
)
from asynctorchx.specs.api import (
    AppDef,
    AppDryRunInfo,
    AppState,
    CfgVal,
    UnknownAppException,
    make_app_handle,
    runopts,
)


class FakeScheduler(Scheduler[AppDef]):
    """Apps live in a dict; tests move them between states with ``set_state``."""

    def __init__(self, session_name: str, *, push: bool = False, **_: Any) -> None:
        super().__init__("fake", session_name)
        self.apps: dict[str, DescribeAppResponse] = {}
        self.describe_many_calls: list[list[str]] = []
        self.describe_calls = 0
        self._described = asyncio.Condition()  # notified after every describe_many round
        self.closed = False
        self._ids = itertools.count()
        self._push = push

    @property  # type: ignore[misc]
    def pushes_changes(self) -> bool:  # type: ignore[override]
        return self._push

    def _run_opts(self) -> runopts:
        opts = runopts()
        opts.add("speed", int, "how fast", default=1)
        return opts

    def _submit_dryrun(self, app: AppDef, cfg: Mapping[str, CfgVal]) -> AppDryRunInfo[AppDef]:
        return AppDryRunInfo(app, repr)

    async def schedule(self, dryrun_info: AppDryRunInfo[AppDef]) -> str:
        app_id = f"fake-{next(self._ids)}"
        self.apps[app_id] = DescribeAppResponse(
            app_id=app_id, state=AppState.RUNNING, num_restarts=0, roles=dryrun_info.request.roles
        )
        return app_id

    def set_state(self, app_id: str, state: AppState, num_restarts: int | None = None) -> None:
        resp = self.apps[app_id]
        resp.state = state
        if num_restarts is not None:
            resp.num_restarts = num_restarts
        self._notify(app_id)

    async def describe(self, app_id: str) -> DescribeAppResponse | None:
        self.describe_calls += 1
        resp = self.apps.get(app_id)
        if resp is None:
            return None
        return DescribeAppResponse(
            app_id=resp.app_id, state=resp.state, num_restarts=resp.num_restarts, roles=resp.roles
        )

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        self.describe_many_calls.append(list(app_ids))
        result = {a: await self.describe(a) for a in app_ids}
        async with self._described:
            self._described.notify_all()
        return result

    async def wait_described(self, *app_ids: str, timeout: float = 5) -> None:
        """Returns once every one of ``app_ids`` was in some ``describe_many`` round (the runner's hub
        has seen its state then); raises TimeoutError after ``timeout`` seconds."""

        def all_described() -> bool:
            seen = {a for call in self.describe_many_calls for a in call}
            return seen.issuperset(app_ids)

        with anyio.fail_after(timeout):
            async with self._described:
                await self._described.wait_for(all_described)

    async def _cancel_existing(self, app_id: str) -> None:
        self.set_state(app_id, AppState.CANCELLED)

    async def list(self) -> list[ListAppResponse]:
        return [ListAppResponse(app_id=a, state=r.state) for a, r in self.apps.items()]

    async def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        app = self.apps.get(query.app_id)
        if app is None:
            raise UnknownAppException(
                make_app_handle(self.backend, self.session_name, query.app_id)
            )
        check_replica(query.app_id, role_replica_counts(app.roles), query.role, query.k)
        for i in range(3):
            yield f"{query.role}/{query.k} line {i}\n"

    async def close(self) -> None:
        self.closed = True
        await super().close()


class TailingFakeScheduler(FakeScheduler):
    """A FakeScheduler whose tail (``should_tail=True``) never ends by itself, like a tail of a
    Slurm or Docker app that the runner's close does not stop: it yields one line, then waits
    for lines that never come. It counts the tails it opened and those whose iterator ended
    (closed or raised): a tail still open is one that would go on reading."""

    def __init__(self, session_name: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.tails_opened = 0
        self.tails_ended = 0
        self.tail_waiting = asyncio.Event()  # set while a tail waits for its next line
        self.tails_waiting = 0  # how many tails wait for their next line now
        self.hanging_closes: set[int] = set()  # replicas whose tail's close hangs (until cancelled)

    async def _log_iter(self, query: LogQuery) -> AsyncIterator[str]:
        if not query.follow:
            async for line in super()._log_iter(query):
                yield line
            return
        self.tails_opened += 1
        waiting = False
        try:
            yield f"{query.role}/{query.k} first\n"
            waiting = True
            self.tails_waiting += 1
            while True:
                self.tail_waiting.set()
                await asyncio.Event().wait()  # the next line never comes
        finally:
            self.tails_waiting -= waiting
            self.tail_waiting.clear()
            try:
                if query.k in self.hanging_closes:
                    await asyncio.Event().wait()
            finally:
                self.tails_ended += 1


class ClosingFakeScheduler(FakeScheduler):
    """A FakeScheduler of backend ``backend`` whose ``close()`` hangs (``close="hang"``: until
    cancelled; ``close="stubborn"``: until ``release`` is set, whatever cancels it), raises
    (``close="raise"``) or returns (``close="ok"``)."""

    def __init__(self, session_name: str, *, backend: str, close: str = "ok", **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.backend = backend
        self._close_mode = close
        self.close_cancelled = False  # a hung close was cancelled
        self.close_ended = False  # close() has returned or raised
        self.release = asyncio.Event()  # ends a stubborn close

    async def close(self) -> None:
        try:
            if self._close_mode == "hang":
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.close_cancelled = True
                    raise
            if self._close_mode == "stubborn":
                while not self.release.is_set():
                    try:
                        await self.release.wait()
                    except asyncio.CancelledError:
                        self.close_cancelled = True
            if self._close_mode == "raise":
                raise OSError(f"{self.backend}: the engine went away")
            await super().close()
        finally:
            self.close_ended = True


class DeafFakeScheduler(FakeScheduler):
    """A FakeScheduler whose status round (``describe_many``) waits until ``release`` is set,
    ignoring every cancellation meanwhile (a backend call that swallows CancelledError)."""

    def __init__(self, session_name: str, **kw: Any) -> None:
        super().__init__(session_name, **kw)
        self.in_round = asyncio.Event()
        self.release = asyncio.Event()

    async def describe_many(self, app_ids: Sequence[str]) -> dict[str, DescribeAppResponse | None]:
        self.in_round.set()
        while not self.release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await self.release.wait()
        return await super().describe_many(app_ids)
