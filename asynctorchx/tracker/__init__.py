"""Tracking: a job reports metadata, artifacts and sources of its run; drivers read them back.

In the job (synchronous, no asyncio import)::

    from asynctorchx.tracker import app_run_from_env

    run = app_run_from_env()
    run.add_metadata(lr=0.1, loss=0.25)
    run.add_artifact("checkpoint", "/ckpt/epoch3.pt")

In a driver or service (async)::

    from asynctorchx.tracker import AsyncTrackerReader

    async with AsyncTrackerReader.from_root("/shared/runs") as reader:
        children = await reader.run_ids(parent_run_id="sweep-7")
        async for update in reader.watch_metadata(children):
            print(update.run_id, update.entry)

The job side lives in ``asynctorchx.tracker.api`` (TorchX's names), the file backend in
``asynctorchx.tracker.backend.fsspec``, the async reader in ``asynctorchx.tracker.reader`` (imported
on first use of ``AsyncTrackerReader``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asynctorchx.tracker.api import ENV_TORCHX_JOB_ID as ENV_TORCHX_JOB_ID
from asynctorchx.tracker.api import ENV_TORCHX_PARENT_RUN_ID as ENV_TORCHX_PARENT_RUN_ID
from asynctorchx.tracker.api import ENV_TORCHX_TRACKERS as ENV_TORCHX_TRACKERS
from asynctorchx.tracker.api import AppRun as AppRun
from asynctorchx.tracker.api import AppRunTrackableSource as AppRunTrackableSource
from asynctorchx.tracker.api import InvalidMetadataError as InvalidMetadataError
from asynctorchx.tracker.api import Lineage as Lineage
from asynctorchx.tracker.api import TrackerArtifact as TrackerArtifact
from asynctorchx.tracker.api import TrackerBase as TrackerBase
from asynctorchx.tracker.api import TrackerConfigError as TrackerConfigError
from asynctorchx.tracker.api import TrackerError as TrackerError
from asynctorchx.tracker.api import TrackerSource as TrackerSource
from asynctorchx.tracker.api import TrackerWriteError as TrackerWriteError
from asynctorchx.tracker.api import UnknownRunError as UnknownRunError
from asynctorchx.tracker.api import UnknownTrackerError as UnknownTrackerError
from asynctorchx.tracker.api import app_run_from_env as app_run_from_env
from asynctorchx.tracker.api import build_trackers as build_trackers
from asynctorchx.tracker.api import tracker_config_env_var_name as tracker_config_env_var_name

if TYPE_CHECKING:
    from asynctorchx.tracker.reader import AsyncTrackerReader as AsyncTrackerReader
    from asynctorchx.tracker.reader import MetadataUpdate as MetadataUpdate

_LAZY = ("AsyncTrackerReader", "MetadataUpdate")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from asynctorchx.tracker import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'asynctorchx.tracker' has no attribute {name!r}")
