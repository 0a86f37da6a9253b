"""The local backends against real child processes: lifecycle, env and macros, images, logs, bad input."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import stat
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from _local_env import GATE, wait_for
from test_local_reliability import token_procs

from asynctorchx.schedulers import create_scheduler
from asynctorchx.schedulers.api import DescribeAppResponse, Stream, UnknownRoleException
from asynctorchx.schedulers.local import LaunchError, LocalScheduler
from asynctorchx.specs import (
    AppDef,
    AppState,
    InvalidAppDefException,
    Resource,
    Role,
    UnknownAppException,
    macros,
)


def sh(script: str, name: str = "main", **kw: Any) -> Role:
    """A role running ``sh -c script``."""
    return Role(name, image="ignored", entrypoint="sh", args=["-c", script], **kw)


def app(*roles: Role, name: str = "app") -> AppDef:
    return AppDef(name, list(roles))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
async def sched(root: Path) -> AsyncIterator[LocalScheduler]:
    s = LocalScheduler("test", local_root=root)
    yield s
    await s.close()


async def lines(
    s: LocalScheduler, app_id: str, role: str = "main", k: int = 0, **kw: Any
) -> list[str]:
    return [line async for line in s.log_iter(app_id, role, k, **kw)]


def replica_exit_codes(desc: DescribeAppResponse) -> dict[str, list[int | None]]:
    return {r.role: [rep.exit_code for rep in r.replicas] for r in desc.roles_statuses}


# -- lifecycle -------------------------------------------------------------------------------------


async def test_app_runs_then_succeeds(sched: LocalScheduler, tmp_path: Path) -> None:
    """An app is RUNNING after submit and SUCCEEDED once its replica exits 0."""
    go = tmp_path / "go"
    app_id = await sched.submit(app(sh(GATE, env={"GO": str(go)})), {})
    desc = await sched.describe(app_id)
    assert desc is not None and desc.state == AppState.RUNNING
    assert desc.roles_statuses[0].replicas[0].pid is not None
    go.touch()
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    assert replica_exit_codes(desc) == {"main": [0]}
    assert desc.num_restarts == 0
    assert desc.name == "app"
    assert desc.roles[0].entrypoint == "sh"


async def test_failed_replica_fails_app_with_exit_code(sched: LocalScheduler) -> None:
    """A replica exiting non-zero fails the app; its exit code and a message say so."""
    app_id = await sched.submit(app(sh("exit 3")), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert replica_exit_codes(desc) == {"main": [3]}
    assert "exit" in desc.msg and "3" in desc.msg


async def test_multi_role_multi_replica_app(sched: LocalScheduler) -> None:
    """Every replica of every role runs once, with its own replica id, and the app succeeds."""
    a = app(
        sh(f"echo trainer {macros.replica_id}", name="trainer", num_replicas=3),
        sh(f"echo ps {macros.replica_id}", name="ps", num_replicas=2),
    )
    app_id = await sched.submit(a, {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    assert replica_exit_codes(desc) == {"trainer": [0, 0, 0], "ps": [0, 0]}
    for role, n in (("trainer", 3), ("ps", 2)):
        for k in range(n):
            assert await lines(sched, app_id, role, k) == [f"{role} {k}\n"]


async def test_cancel_running_app(sched: LocalScheduler) -> None:
    """Cancel returns at once; the app ends CANCELLED and its process is gone."""
    app_id = await sched.submit(app(sh("sleep 30", num_replicas=2)), {})
    desc = await sched.describe(app_id)
    assert desc is not None
    pids = [r.pid for r in desc.roles_statuses[0].replicas]
    with anyio.fail_after(1):
        await sched.cancel(app_id)
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.CANCELLED
    assert all(r.state == AppState.CANCELLED for r in desc.roles_statuses[0].replicas)
    assert not any(pid is not None and _alive(pid) for pid in pids)  # reaped by the scheduler


async def test_cancel_is_idempotent(sched: LocalScheduler) -> None:
    """Cancelling twice, cancelling a finished app and cancelling an unknown app do nothing more."""
    app_id = await sched.submit(app(sh("sleep 30")), {})
    await sched.cancel(app_id)
    await sched.cancel(app_id)
    desc = await wait_for(sched, app_id)
    await sched.cancel(app_id)
    await sched.cancel("no-such-app-123")
    assert desc.state == AppState.CANCELLED
    after = await sched.describe(app_id)
    assert after is not None and after.state == AppState.CANCELLED


async def test_describe_and_exists_of_unknown_app(sched: LocalScheduler) -> None:
    """An unknown id (or one that cannot be an app id) is described as None and does not exist."""
    assert await sched.describe("nope-12345678") is None
    assert await sched.describe("../etc/passwd") is None
    assert not await sched.exists("nope-12345678")
    many = await sched.describe_many(["nope-1", "nope-2"])
    assert many == {"nope-1": None, "nope-2": None}


async def test_changes_are_pushed(sched: LocalScheduler) -> None:
    """The scheduler pushes the app id to subscribers when the app changes, without polling."""
    assert sched.pushes_changes
    seen: list[str] = []
    done = asyncio.Event()

    def on_change(app_id: str) -> None:
        seen.append(app_id)
        done.set()

    unsubscribe = sched.subscribe(on_change)
    app_id = await sched.submit(app(sh("exit 0")), {})
    await wait_for(sched, app_id)
    unsubscribe()
    assert app_id in seen


async def test_list_shows_apps_of_every_session(root: Path, sched: LocalScheduler) -> None:
    """``list`` shows apps of this backend launched by any session, with their handles."""
    mine = await sched.submit(app(sh("exit 0"), name="mine"), {})
    async with LocalScheduler("other", local_root=root) as other:
        theirs = await other.submit(app(sh("exit 1"), name="theirs"), {})
        await wait_for(other, theirs)
    await wait_for(sched, mine)
    listed = {item.app_id: item for item in await sched.list()}
    assert listed[mine].state == AppState.SUCCEEDED
    assert listed[mine].app_handle == f"local_cwd://test/{mine}"
    assert listed[theirs].state == AppState.FAILED
    assert listed[theirs].app_handle == f"local_cwd://other/{theirs}"
    assert listed[theirs].name == "theirs"
    async with LocalScheduler("x", "local_dir", local_root=root) as by_dir:
        assert {i.app_id for i in await by_dir.list()}.isdisjoint({mine, theirs})


async def test_close_stops_owned_apps(root: Path) -> None:
    """Closing the scheduler stops the apps it launched; they end CANCELLED."""
    s = LocalScheduler("closing", local_root=root)
    app_id = await s.submit(app(sh("sleep 30")), {})
    desc = await s.describe(app_id)
    assert desc is not None
    pid = desc.roles_statuses[0].replicas[0].pid
    assert pid is not None
    await s.close()
    await s.close()
    assert not _alive(pid)
    async with LocalScheduler("reader", local_root=root) as reader:
        after = await reader.describe(app_id)
    assert after is not None and after.state == AppState.CANCELLED
    assert "closed" in after.msg
    with pytest.raises(RuntimeError, match="closed"):
        await s.submit(app(sh("exit 0")), {})


async def test_registry_creates_both_backends(root: Path) -> None:
    """The registry builds local_cwd and local_dir and they ignore parameters they do not know."""
    for name in ("local_cwd", "local_dir"):
        s = create_scheduler(name, "reg", local_root=str(root), unknown_param=1)
        assert isinstance(s, LocalScheduler) and s.backend == name
        await s.close()


# -- environment, macros, PATH ---------------------------------------------------------------------


async def test_env_and_macros(sched: LocalScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas inherit the parent env, the role env wins, macros are substituted, TorchX vars are set."""
    monkeypatch.setenv("ATX_PARENT_ONLY", "from-parent")
    monkeypatch.setenv("ATX_BOTH", "from-parent")
    script = (
        'printf "%s\\n" "$ATX_PARENT_ONLY" "$ATX_BOTH" "$ATX_MACROS" "$TORCHX_RANK0_HOST" '
        '"$TORCHELASTIC_ERROR_FILE" "$TORCHX_JOB_ID" "$PWD" "$1" "$2"'
    )
    role = Role(
        "main",
        image="ignored",
        entrypoint="sh",
        args=["-c", script, "sh", macros.img_root, f"{macros.app_id}/{macros.replica_id}"],
        env={
            "ATX_BOTH": "from-role",
            "ATX_MACROS": f"{macros.rank0_env}:{macros.replica_id}",
        },
        num_replicas=2,
    )
    app_id = await sched.submit(app(role), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.SUCCEEDED
    for k in range(2):
        out = [line.rstrip("\n") for line in await lines(sched, app_id, k=k, streams=Stream.STDOUT)]
        parent, both, mac, rank0, err_file, job_id, pwd, img_root, ids = out
        assert parent == "from-parent"
        assert both == "from-role"
        assert mac == f"TORCHX_RANK0_HOST:{k}"
        assert rank0 == "localhost"
        assert err_file.endswith(f"/.errors/{app_id}.main.{k}.error.json")
        assert job_id == f"local_cwd://test/{app_id}"
        assert pwd == img_root == os.getcwd()
        assert ids == f"{app_id}/{k}"


async def test_prepend_cwd_controls_path_precedence(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image dir's programs win over the launcher's PATH (TorchX's effective order: the role's
    PATH, the image dir, the launcher's); with prepend_cwd they win over the role's PATH too."""
    image = tmp_path / "image"
    image.mkdir()
    fake = image / "uname"
    fake.write_text("#!/bin/sh\necho image-uname\n")
    fake.chmod(0o755)
    own = image / "only-in-image"
    own.write_text("#!/bin/sh\necho own-program\n")
    own.chmod(0o755)
    role_bin = tmp_path / "role-bin"
    role_bin.mkdir()
    mine = role_bin / "uname"
    mine.write_text("#!/bin/sh\necho role-uname\n")
    mine.chmod(0o755)
    async with LocalScheduler("p", "local_dir", local_root=root) as s:
        outs = {}
        for prepend, role_path in [
            (False, None),
            (True, None),
            (False, role_bin),
            (True, role_bin),
        ]:
            role = Role(
                "main",
                image=str(image),
                entrypoint="sh",
                args=["-c", "uname; only-in-image"],
                env={"PATH": str(role_path)} if role_path else {},
            )
            app_id = await s.submit(app(role), {"prepend_cwd": prepend})
            assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
            outs[prepend, role_path is not None] = await lines(s, app_id)
    assert outs[False, False] == ["image-uname\n", "own-program\n"]  # before the launcher's PATH
    assert outs[True, False] == ["image-uname\n", "own-program\n"]
    assert outs[False, True] == ["role-uname\n", "own-program\n"]  # after the role's PATH
    assert outs[True, True] == ["image-uname\n", "own-program\n"]


def test_auto_set_cuda_visible_devices_gives_contiguous_slices(root: Path) -> None:
    """Each GPU replica gets its own contiguous CUDA_VISIBLE_DEVICES slice; none when too few GPUs."""
    a = app(
        Role("a", image="x", entrypoint="true", num_replicas=1, resource=Resource(1, 2, 100)),
        Role("b", image="x", entrypoint="true", num_replicas=3, resource=Resource(1, 1, 100)),
        Role("cpu", image="x", entrypoint="true", resource=Resource(1, 0, 100)),
    )
    cfg = {"auto_set_cuda_visible_devices": True}
    s = LocalScheduler("gpu", local_root=root, gpu_count=8)
    envs = {(r.role, r.replica_id): r.env for r in s.submit_dryrun(a, cfg).request.replicas}
    assert envs[("a", 0)]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert [envs[("b", i)]["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2", "3", "4"]
    assert "CUDA_VISIBLE_DEVICES" not in envs[("cpu", 0)]
    few = LocalScheduler("gpu", local_root=root, gpu_count=4)
    assert all(
        "CUDA_VISIBLE_DEVICES" not in r.env for r in few.submit_dryrun(a, cfg).request.replicas
    )
    off = s.submit_dryrun(a, {}).request.replicas
    assert all("CUDA_VISIBLE_DEVICES" not in r.env for r in off)


def test_dryrun_is_pure(root: Path) -> None:
    """A dry run creates nothing and leaves the app unchanged; it shows the command and log dir."""
    a = app(sh("echo hi"))
    s = LocalScheduler("dry", local_root=root)
    info = s.submit_dryrun(a, {})
    assert not root.exists()
    assert a.roles[0].env == {}
    text = str(info)
    assert "sh -c echo hi" in text and info.request.app_dir in text


# -- images ----------------------------------------------------------------------------------------


async def test_local_cwd_ignores_image(sched: LocalScheduler) -> None:
    """local_cwd runs replicas in the current directory whatever Role.image says."""
    role = Role("main", image="/does/not/exist", entrypoint="pwd")
    app_id = await sched.submit(app(role), {})
    assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    assert await lines(sched, app_id) == [os.getcwd() + "\n"]


async def test_local_dir_runs_in_image_dir(root: Path, tmp_path: Path) -> None:
    """local_dir runs replicas in the image directory and resolves relative entrypoints there."""
    image = tmp_path / "img"
    image.mkdir()
    script = image / "run.sh"
    script.write_text("#!/bin/sh\npwd\n")
    script.chmod(0o755)
    async with LocalScheduler("d", "local_dir", local_root=root) as s:
        app_id = await s.submit(app(Role("main", image=str(image), entrypoint="./run.sh")), {})
        assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
        assert await lines(s, app_id) == [f"{image}\n"]


@pytest.mark.parametrize("image", ["relative/dir", "", "/definitely/not/there"])
def test_local_dir_rejects_bad_images(root: Path, image: str) -> None:
    """local_dir rejects a relative or missing image with an error naming the role and the value."""
    s = LocalScheduler("d", "local_dir", local_root=root)
    with pytest.raises(InvalidAppDefException) as info:
        s.submit_dryrun(app(Role("trainer", image=image, entrypoint="true")), {})
    assert "trainer" in str(info.value) and repr(image) in str(info.value)
    assert info.value.field_name == "image"


def test_local_dir_rejects_a_file_as_image(root: Path, tmp_path: Path) -> None:
    """An image that is a file, not a directory, is rejected."""
    f = tmp_path / "file"
    f.write_text("x")
    s = LocalScheduler("d", "local_dir", local_root=root)
    with pytest.raises(InvalidAppDefException, match="not a directory"):
        s.submit_dryrun(app(Role("trainer", image=str(f), entrypoint="true")), {})


def test_more_replicas_than_host_processes_is_rejected(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica count the host can never run is a clear error naming the role, not an OOM."""
    from asynctorchx.schedulers._local import request

    monkeypatch.setattr(request, "max_processes", lambda: 4)
    s = LocalScheduler("d", local_root=root)
    s.submit_dryrun(app(sh("true", "a", num_replicas=2), sh("true", "b", num_replicas=2)), {})
    with pytest.raises(InvalidAppDefException) as info:
        s.submit_dryrun(app(sh("true", "a", num_replicas=3), sh("true", "b", num_replicas=2)), {})
    message = str(info.value)
    assert "role 'a'" in message and "num_replicas 3" in message and "at most 4" in message
    assert "5 replicas in all" in message and info.value.field_name == "num_replicas"


# -- failed submits leave nothing behind -----------------------------------------------------------


async def _assert_no_trace(s: LocalScheduler, token: str) -> None:
    assert token_procs(token) == []
    assert await s.list() == []


async def test_missing_entrypoint_fails_submit(sched: LocalScheduler) -> None:
    """A missing entrypoint in any role fails the submit naming it; no replica starts, no record."""
    token = uuid.uuid4().hex
    a = app(
        sh("sleep 30", name="ok", env={"ATX_TOKEN": token}),
        Role("bad", image="x", entrypoint="no-such-program-xyz", env={"ATX_TOKEN": token}),
    )
    with pytest.raises(LaunchError, match="no-such-program-xyz") as info:
        await sched.submit(a, {})
    assert "'bad'" in str(info.value)
    await _assert_no_trace(sched, token)


async def test_unexecutable_entrypoint_rolls_back_started_replicas(
    sched: LocalScheduler, tmp_path: Path
) -> None:
    """When a later replica cannot be executed, the replicas already started are killed."""
    token = uuid.uuid4().hex
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\x7fELF-not-really")
    bogus.chmod(0o755)
    a = app(
        sh("sleep 30", name="ok", num_replicas=2, env={"ATX_TOKEN": token}),
        Role("bad", image="x", entrypoint=str(bogus), env={"ATX_TOKEN": token}),
    )
    with pytest.raises(LaunchError, match="bogus"):
        await sched.submit(a, {})
    await _assert_no_trace(sched, token)


async def test_unwritable_log_dir_fails_submit(sched: LocalScheduler, tmp_path: Path) -> None:
    """A log_dir that cannot be created fails the submit with an error naming it; nothing starts."""
    token = uuid.uuid4().hex
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(LaunchError, match="log_dir") as info:
        await sched.submit(
            app(sh("sleep 30", env={"ATX_TOKEN": token})), {"log_dir": str(blocker / "logs")}
        )
    assert str(blocker) in str(info.value)
    await _assert_no_trace(sched, token)


async def test_missing_working_directory_fails_submit(root: Path, tmp_path: Path) -> None:
    """An image directory that disappeared between dry run and schedule fails the submit."""
    image = tmp_path / "img"
    image.mkdir()
    async with LocalScheduler("d", "local_dir", local_root=root) as s:
        info = s.submit_dryrun(app(Role("main", image=str(image), entrypoint="true")), {})
        image.rmdir()
        with pytest.raises(LaunchError, match="does not exist"):
            await s.schedule(info)
        assert await s.list() == []


async def test_log_dir_option_moves_logs(sched: LocalScheduler, tmp_path: Path) -> None:
    """With log_dir the replica logs go to {log_dir}/{session}/{app_id}/{role}/{k}/."""
    logs = tmp_path / "elsewhere"
    app_id = await sched.submit(app(sh("echo out; echo err >&2")), {"log_dir": str(logs)})
    await wait_for(sched, app_id)
    rep_dir = logs / "test" / app_id / "main" / "0"
    assert (rep_dir / "stdout.log").read_text() == "out\n"
    assert (rep_dir / "stderr.log").read_text() == "err\n"
    assert await lines(sched, app_id, streams=Stream.STDERR) == ["err\n"]


# -- logs and structured errors --------------------------------------------------------------------


async def test_log_streams(sched: LocalScheduler) -> None:
    """log_iter reads stdout, stderr or both (the default), lines keeping their newline."""
    app_id = await sched.submit(app(sh("echo out1; echo err1 >&2; sleep 0.05; echo out2")), {})
    await wait_for(sched, app_id)
    assert await lines(sched, app_id, streams=Stream.STDOUT) == ["out1\n", "out2\n"]
    assert await lines(sched, app_id, streams=Stream.STDERR) == ["err1\n"]
    combined = await lines(sched, app_id)
    assert sorted(combined) == ["err1\n", "out1\n", "out2\n"] and combined[-1] == "out2\n"
    assert await lines(sched, app_id, regex="^out") == ["out1\n", "out2\n"]


async def test_log_tail_follows_until_terminal(sched: LocalScheduler, tmp_path: Path) -> None:
    """should_tail follows the log while the app runs and stops once it is terminal."""
    go = tmp_path / "go"
    app_id = await sched.submit(app(sh(f"echo first; {GATE}; echo last", env={"GO": str(go)})), {})
    got: list[str] = []
    with anyio.fail_after(15):
        async for line in sched.log_iter(app_id, "main", should_tail=True):
            got.append(line)
            if line == "first\n":
                go.touch()
    assert got == ["first\n", "last\n"]


async def test_log_iter_bad_input(sched: LocalScheduler) -> None:
    """Unknown app, role or replica raise at the first iteration; a negative replica index, an
    unsupported stream, since > until and bad regexes raise at the call."""
    app_id = await sched.submit(app(sh("echo hi", num_replicas=2)), {})
    await wait_for(sched, app_id)
    with pytest.raises(UnknownAppException):
        await lines(sched, "no-such-app-1")
    with pytest.raises(UnknownAppException):
        await lines(sched, "no-such-app-1", should_tail=True)
    with pytest.raises(UnknownRoleException, match="nope"):
        await lines(sched, app_id, "nope")
    with pytest.raises(UnknownRoleException, match="k=2"):
        await lines(sched, app_id, "main", 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        sched.log_iter(app_id, "main", -1)
    with pytest.raises(ValueError, match="stream"):
        sched.log_iter(app_id, "main", streams="journal")  # type: ignore[arg-type]
    now = datetime.now()
    with pytest.raises(ValueError, match="since"):
        sched.log_iter(app_id, "main", since=now, until=now - timedelta(seconds=1))
    with pytest.raises(ValueError, match="regex"):
        sched.log_iter(app_id, "main", regex="(unclosed")


async def test_log_iter_of_app_from_another_scheduler(root: Path, sched: LocalScheduler) -> None:
    """Another scheduler object on the same root reads the logs (and validates roles) of an app."""
    app_id = await sched.submit(app(sh("echo hello")), {})
    await wait_for(sched, app_id)
    async with LocalScheduler("reader", local_root=root) as reader:
        assert await lines(reader, app_id) == ["hello\n"]
        assert await lines(reader, app_id, should_tail=True) == ["hello\n"]
        with pytest.raises(UnknownRoleException):
            await lines(reader, app_id, "nope")
        with pytest.raises(UnknownRoleException):
            await lines(reader, app_id, "main", 1)


async def test_structured_error_from_error_file(sched: LocalScheduler) -> None:
    """A replica's torchelastic error file becomes the structured error of the replica and the app."""
    error = {"message": {"message": "boom", "extraInfo": {"timestamp": "1700000000"}}}
    script = f"printf '%s' '{json.dumps(error)}' > \"$TORCHELASTIC_ERROR_FILE\"; exit 1"
    app_id = await sched.submit(app(sh(script)), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert json.loads(desc.structured_error_msg) == error
    assert json.loads(desc.roles_statuses[0].replicas[0].structured_error_msg) == error
    assert "boom" in desc.to_status().format()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("script", "said"),
    [
        ('mkfifo "$TORCHELASTIC_ERROR_FILE"', "is not a regular file"),
        ('head -c 2000000 /dev/zero > "$TORCHELASTIC_ERROR_FILE"', "holds more than 1048576 bytes"),
    ],
    ids=["fifo", "2MB"],
)
async def test_an_error_file_that_cannot_be_kept_is_said_not_read(
    sched: LocalScheduler, script: str, said: str
) -> None:
    """A replica that makes its error file a FIFO, or writes megabytes into it, fails as usual:
    the structured error says why the file was not read (a FIFO blocked the app's end, and the
    scheduler's close, for ever; a huge file went whole into every version of the record)."""
    app_id = await sched.submit(app(sh(f"{script}; exit 1")), {})
    desc = await wait_for(sched, app_id)
    assert desc.state == AppState.FAILED
    assert said in desc.structured_error_msg, desc.structured_error_msg


def _alive(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return data.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_state_root_is_private(root: Path) -> None:
    """The state root is created private to the user (mode 0700)."""
    from asynctorchx.schedulers._local.records import RecordStore

    RecordStore(root).ensure()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


async def test_running_apps_need_no_thread_each(sched: LocalScheduler, tmp_path: Path) -> None:
    """100 running apps are watched through pidfds on the event loop: no watcher thread per child."""
    lock = tmp_path / "gate.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # each app blocks (without spinning) until this is released
    try:
        before = len(os.listdir("/proc/self/task"))
        gated = app(Role("main", image=".", entrypoint="flock", args=["-s", str(lock), "true"]))
        ids = [await sched.submit(gated, {}) for _ in range(100)]
        for app_id in ids:
            await wait_for(sched, app_id, lambda d: d.state == AppState.RUNNING)
        during = len(os.listdir("/proc/self/task"))
    finally:
        os.close(fd)  # releases the lock
    for app_id in ids:
        assert (await wait_for(sched, app_id)).state == AppState.SUCCEEDED
    # a handful of worker threads (record writing, file reads) at most, not one per child
    assert during - before < 10, (before, during)
