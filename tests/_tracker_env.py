"""Helpers shared by the tracker tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from asynctorchx.tracker import AsyncTrackerReader, MetadataUpdate


@contextlib.asynccontextmanager
async def watching(
    reader: AsyncTrackerReader, *args: Any, **kwargs: Any
) -> AsyncIterator[MemoryObjectReceiveStream[MetadataUpdate]]:
    """The updates of ``reader.watch_metadata(...)``, followed in a task until the body ends (an
    error of the watch fails the test)."""
    send, receive = anyio.create_memory_object_stream[MetadataUpdate](100)

    async def follow() -> None:
        async with send, contextlib.aclosing(reader.watch_metadata(*args, **kwargs)) as updates:
            async for update in updates:
                await send.send(update)

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        with receive:
            yield receive
        tg.cancel_scope.cancel()
