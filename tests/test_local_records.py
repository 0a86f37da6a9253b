"""App records of the local backends: serialisation, the store, and what readers make of stale records."""

from __future__ import annotations

import json
import os
from pathlib import Path

from _local_env import dead_pid

from asynctorchx.schedulers._local import watchdog
from asynctorchx.schedulers._local.procs import proc_start_ticks
from asynctorchx.schedulers._local.records import (
    AppRecord,
    Owner,
    RecordStore,
    ReplicaRecord,
    appdef_from_json,
    appdef_to_json,
)
from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    BindMount,
    DeviceMount,
    Resource,
    RetryPolicy,
    Role,
    VolumeMount,
)


def full_app() -> AppDef:
    return AppDef(
        "full",
        [
            Role(
                "trainer",
                image="/img",
                entrypoint="python",
                args=["-m", "train", "${app_id}"],
                env={"A": "1"},
                num_replicas=2,
                min_replicas=1,
                max_retries=3,
                retry_policy=RetryPolicy.ROLE,
                resource=Resource(
                    cpu=2, gpu=1, memMB=1024, capabilities={"x": "y"}, devices={"d": 1}
                ),
                port_map={"http": 8080},
                metadata={"k": {"nested": [1, 2]}},
                mounts=[
                    BindMount("/a", "/b", read_only=True),
                    VolumeMount("vol", "/c"),
                    DeviceMount("/dev/fuse", "/dev/fuse", "rw"),
                ],
                base_image="base",
            ),
            Role("ps", image="/img", entrypoint="ps"),
        ],
        metadata={"m": "v"},
    )


def record(app_id: str, owner: Owner, state: AppState = AppState.RUNNING) -> AppRecord:
    return AppRecord(
        app_id=app_id,
        name="n",
        backend="local_cwd",
        session="s",
        state=state,
        msg="",
        structured_error_msg="<NONE>",
        num_restarts=0,
        submitted_at=1.0,
        ended_at=None,
        app_dir="/nowhere",
        grace_period=1.0,
        owner=owner,
        replicas=(ReplicaRecord("main", 0, state, pid=dead_pid(), start_ticks=1),),
        app=appdef_to_json(AppDef("n", [Role("main", image="x", entrypoint="true")])),
    )


def test_appdef_round_trips_through_json() -> None:
    """An AppDef survives the JSON of its record, mounts, resources and retry policy included."""
    app = full_app()
    assert appdef_from_json(json.loads(json.dumps(appdef_to_json(app)))) == app


def test_record_round_trips_through_json(tmp_path: Path) -> None:
    """A record written by the store reads back equal."""
    store = RecordStore(tmp_path / "root")
    store.ensure()
    rec = record("app-1", Owner(pid=1, start_ticks=2, watchdog_pid=3, watchdog_start_ticks=4))
    assert store.write_many({"app-1": rec.to_json()}) == {}
    assert store.read("app-1") == rec
    assert store.list_ids() == ["app-1"]


def test_corrupt_or_missing_records_read_as_none(tmp_path: Path) -> None:
    """A missing, corrupt or badly named record reads as None, not an exception."""
    store = RecordStore(tmp_path / "root")
    store.ensure()
    (store.records_dir / "bad-1.json").write_text("{not json")
    assert store.read("bad-1") is None
    assert store.read("missing-1") is None
    assert store.read("../../etc/passwd") is None


async def test_record_of_a_vanished_launcher_reads_as_lost(tmp_path: Path) -> None:
    """A running record whose launcher, watchdog and replicas are all gone is described as FAILED (lost)."""
    root = tmp_path / "root"
    store = RecordStore(root)
    store.ensure()
    store.write_many({"lost-1": record("lost-1", Owner(pid=dead_pid(), start_ticks=1)).to_json()})
    async with LocalScheduler("reader", local_root=root) as s:
        desc = await s.describe("lost-1")
        listed = await s.list()
    assert desc is not None and desc.state == AppState.FAILED
    assert "lost" in desc.msg
    assert [(a.app_id, a.state) for a in listed] == [("lost-1", AppState.FAILED)]


async def test_record_of_a_live_launcher_is_trusted(tmp_path: Path) -> None:
    """A running record whose launcher is alive is reported as recorded."""
    root = tmp_path / "root"
    store = RecordStore(root)
    store.ensure()
    me = Owner(pid=os.getpid(), start_ticks=proc_start_ticks(os.getpid()))
    store.write_many({"live-1": record("live-1", me).to_json()})
    async with LocalScheduler("reader", local_root=root) as s:
        desc = await s.describe("live-1")
    assert desc is not None and desc.state == AppState.RUNNING


def test_watchdog_never_overwrites_a_terminal_record(tmp_path: Path) -> None:
    """The watchdog's record update leaves terminal records alone and marks others CANCELLED."""
    store = RecordStore(tmp_path / "root")
    store.ensure()
    owner = Owner(pid=dead_pid(), start_ticks=1)
    store.write_many(
        {
            "done-1": record("done-1", owner, AppState.SUCCEEDED).to_json(),
            "run-1": record("run-1", owner).to_json(),
        }
    )
    for app_id in ("done-1", "run-1"):
        watchdog.finish_record(str(store.records_dir), app_id, "why", only_if_owner_gone=True)
    done, run = store.read("done-1"), store.read("run-1")
    assert done is not None and done.state == AppState.SUCCEEDED
    assert run is not None and run.state == AppState.CANCELLED and run.msg == "why"
    assert run.replicas[0].state == AppState.CANCELLED
