"""Where a local replica's log lines come from: its log directory, found through its app's record
(in memory for the apps this scheduler launched, read from disk for the others), read by
``logs.iter_log_lines``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import anyio.to_thread

from asynctorchx.logs import LogQuery, iter_query_entries, iter_query_lines
from asynctorchx.logs._cursor import Position
from asynctorchx.schedulers._local.runtime import LocalRuntime
from asynctorchx.schedulers.api import check_replica
from asynctorchx.specs.api import UnknownAppException, is_terminal, make_app_handle


class LocalLogSource:
    """Reads the logs of the apps under one state root.

    Args:
        runtime: the scheduler's apps (and their records' store).
        backend: the scheduler's name (for the app handles of errors).
        session: its session.
    """

    def __init__(self, runtime: LocalRuntime, backend: str, session: str) -> None:
        self._rt = runtime
        self._backend = backend
        self._session = session

    def lines(self, query: LogQuery) -> AsyncIterator[str]:
        """The lines ``query`` asks for: the reader's own generator, with the app looked up at its
        first iteration (no generator layer of our own: each costs as much again per line)."""
        return iter_query_lines(
            functools.partial(self._directory, query),
            query,
            functools.partial(self._is_finished, query.app_id),
        )

    async def entries(self, query: LogQuery) -> AsyncGenerator[tuple[Position, str], None]:
        """``(position, line)`` pairs, after ``query.after`` when set: the position is the file
        read (its stream) and the byte offset just past the line in it."""
        name = query.stream.value
        start = 0
        if query.after is not None:
            file, offset = query.after.position
            if file != name:
                raise ValueError(f"the log cursor's file {file!r} is not the one read ({name!r})")
            start = int(offset)
        entries = iter_query_entries(
            functools.partial(self._directory, query),
            query,
            functools.partial(self._is_finished, query.app_id),
            start=start,
        )
        async with contextlib.aclosing(entries):
            async for offset, line in entries:
                yield (name, offset), line

    async def _directory(self, query: LogQuery) -> Path:
        """The replica's log directory.

        Raises:
            UnknownAppException: no app of that id under the state root.
            UnknownRoleException: no such role, or no replica ``k``.
        """
        app_id = query.app_id
        record = self._rt.record_of(app_id)
        if record is None:
            record = await anyio.to_thread.run_sync(self._rt.store.read, app_id)
        if record is None:
            raise UnknownAppException(
                make_app_handle(self._backend, self._session, app_id),
                f"no local app with id {app_id!r} under {self._rt.root}",
            )
        check_replica(app_id, record.role_counts(), query.role, query.k)
        replica = record.replica(query.role, query.k)
        assert replica is not None
        return Path(replica.log_dir)

    async def _is_finished(self, app_id: str) -> bool:
        state = self._rt.state_of(app_id)
        if state is not None:
            return is_terminal(state)
        record = await anyio.to_thread.run_sync(self._rt.store.read_checked, app_id)
        return record is None or is_terminal(record.state)
