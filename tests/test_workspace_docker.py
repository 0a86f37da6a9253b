# ruff: noqa: F811 - the fixtures imported from _docker_env are redefined as test parameters
"""Workspaces on local_docker, against the real Docker engine and asynctorchx-test/python:3.11.

Every test runs in a session of its own (its containers are removed after it) and writes
workspaces with a nonce, so each builds images of its own; the workspace images it built are
removed after it (``workspace_images``). The base image exists only locally: a build that tried to
pull it would fail (no registry is reachable), so every successful build here also shows that a
present base image is never pulled.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _docker_env import (  # noqa: F401 - pytest fixtures
    docker_engine,
    docker_session,
    purge_session,
    python_image,
)
from _workspace_env import (  # noqa: F401 - pytest fixtures
    make_workspace,
    run_as_unprivileged_reader,
    workspace_image_ids,
    workspace_images,
)

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers.docker import DockerScheduler
from asynctorchx.schedulers.workspace import (
    WorkspaceBuildError,
    WorkspaceChangedError,
    WorkspaceEvent,
    scan_workspace,
    write_tar,
)
from asynctorchx.specs import AppDef, AppState, InvalidWorkspaceException, Role, Workspace

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture
async def scheduler(docker_engine: None, docker_session: str) -> AsyncIterator[DockerScheduler]:
    """The local_docker scheduler of the test's session (its engine counts the builds)."""
    sched = DockerScheduler(docker_session)
    yield sched
    await sched.close()


@pytest.fixture
async def runner(
    scheduler: DockerScheduler, docker_session: str, workspace_images: set[str]
) -> AsyncIterator[AsyncRunner]:
    """A runner on that scheduler; the session's containers are removed afterwards."""
    factories = {"local_docker": lambda session, **_: scheduler}
    try:
        async with AsyncRunner(name=docker_session, scheduler_factories=factories) as r:
            yield r
    finally:
        await purge_session(docker_session)


def sh_app(image: str, script: str, name: str = "ws") -> AppDef:
    return AppDef(name, [Role("trainer", image=image, entrypoint="sh", args=["-c", script])])


async def run_to_end(
    runner: AsyncRunner, app: AppDef, workspace: Any, **kw: Any
) -> tuple[str, AppState, str]:
    """Runs the app with the workspace; returns its handle, final state and stdout."""
    handle = await runner.run(app, "local_docker", workspace=workspace, **kw)
    status = await runner.wait(handle, timeout=60)
    assert status is not None
    out = "".join([line async for line in runner.log_lines(handle, "trainer")])
    return handle, status.state, out


async def test_a_python_file_and_a_data_file_run_in_the_python_image(
    runner: AsyncRunner, scheduler: DockerScheduler, python_image: str, tmp_path: Path
) -> None:
    """The container runs the workspace's script, which reads the workspace's data file."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "train.py": "print('code v1'); print('data:', open('data/input.txt').read().strip())\n",
            "data/input.txt": "42 samples\n",
        },
    )
    _, state, out = await run_to_end(runner, sh_app(python_image, "python3 train.py"), str(ws))
    assert state == AppState.SUCCEEDED, out
    assert "code v1\n" in out and "data: 42 samples\n" in out
    assert scheduler.engine.builds == 1


async def test_dockerignore_excludes_a_file_and_negation_re_includes_one(
    runner: AsyncRunner, python_image: str, tmp_path: Path
) -> None:
    """Inside the container: the ignored file and directory are absent, the '!' file present."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "keep.py": "",
            "secret.env": "TOKEN=x",
            "logs/a.log": "",
            "logs/important.log": "",
            "pkg/cache.pyc": "",
            ".dockerignore": "secret.env\nlogs\n!logs/important.log\n**/*.pyc\n",
        },
    )
    files = "keep.py secret.env logs/a.log logs/important.log pkg/cache.pyc"
    script = f'for f in {files}; do if [ -e "$f" ]; then echo "present $f"; else echo "absent $f"; fi; done'
    _, state, out = await run_to_end(runner, sh_app(python_image, script), str(ws))
    assert state == AppState.SUCCEEDED, out
    assert out.splitlines() == [
        "present keep.py",
        "absent secret.env",
        "absent logs/a.log",
        "present logs/important.log",
        "absent pkg/cache.pyc",
    ]


async def test_dockerfile_torchx_is_the_recipe_and_gets_the_image_and_workspace_args(
    runner: AsyncRunner, python_image: str, tmp_path: Path
) -> None:
    """A Dockerfile.torchx builds the image, FROM the IMAGE build arg, with WORKSPACE set."""
    ws = make_workspace(
        tmp_path / "ws",
        {
            "Dockerfile.torchx": (
                "ARG IMAGE\nFROM $IMAGE\nARG IMAGE\nARG WORKSPACE\n"
                'RUN echo "base=$IMAGE workspace=$WORKSPACE" > /recipe.txt\n'
                "COPY . /app\nWORKDIR /app\n"
            ),
            "hello.py": "print('hello from /app')\n",
        },
    )
    _, state, out = await run_to_end(
        runner, sh_app(python_image, "cat /recipe.txt; pwd; python3 hello.py"), str(ws)
    )
    assert state == AppState.SUCCEEDED, out
    assert out.splitlines() == [f"base={python_image} workspace={ws}", "/app", "hello from /app"]


async def test_a_second_submit_of_an_unchanged_workspace_builds_nothing(
    runner: AsyncRunner, scheduler: DockerScheduler, python_image: str, tmp_path: Path
) -> None:
    """The second run finds the content-addressed tag: same image id, no second build."""
    ws = make_workspace(tmp_path / "ws", {"a.py": "print(1)\n"})
    app = sh_app(python_image, "python3 a.py")
    first = runner.dryrun(app, "local_docker", workspace=str(ws)).workspace
    await run_to_end(runner, app, str(ws))
    image_id = await scheduler.engine.image_id(first.target)
    assert image_id is not None and scheduler.engine.builds == 1
    events: list[WorkspaceEvent] = []
    _, state, out = await run_to_end(runner, app, str(ws), progress=events.append)
    assert state == AppState.SUCCEEDED and out == "1\n"
    assert scheduler.engine.builds == 1
    assert await scheduler.engine.image_id(first.target) == image_id
    assert [(e.final, e.cached) for e in events] == [(True, True)]


async def test_twenty_concurrent_submits_of_one_workspace_build_once(
    runner: AsyncRunner, scheduler: DockerScheduler, python_image: str, tmp_path: Path
) -> None:
    """20 apps launched at once share one build; every caller hears of it ending."""
    ws = make_workspace(tmp_path / "ws", {"a.py": "print('ok')\n"})
    app = sh_app(python_image, "python3 a.py")
    heard: list[list[WorkspaceEvent]] = [[] for _ in range(20)]
    handles = await asyncio.gather(
        *(
            runner.run(app, "local_docker", workspace=str(ws), progress=heard[i].append)
            for i in range(20)
        )
    )
    assert len(set(handles)) == 20
    assert scheduler.engine.builds == 1
    assert all(events and events[-1].final for events in heard)
    done = await runner.wait_all(handles, timeout=120)
    assert {s.state for s in done.values() if s is not None} == {AppState.SUCCEEDED}


async def test_a_changed_file_changes_the_tag(
    runner: AsyncRunner, python_image: str, tmp_path: Path
) -> None:
    """Another byte, or another mode, of one file gives another content-addressed tag."""
    ws = make_workspace(tmp_path / "ws", {"a.py": "print(1)\n"})
    app = sh_app(python_image, "true")

    def tag() -> str:
        return str(runner.dryrun(app, "local_docker", workspace=str(ws)).workspace.target)

    first = tag()
    (ws / "a.py").write_text("print(2)\n")
    second = tag()
    (ws / "a.py").chmod(0o755)
    third = tag()
    assert len({first, second, third}) == 3
    assert all(t.startswith("asynctorchx/workspace:") for t in (first, second, third))


async def test_a_broken_dockerfile_fails_the_submit_with_its_error_and_leaves_nothing(
    runner: AsyncRunner,
    scheduler: DockerScheduler,
    python_image: str,
    tmp_path: Path,
    docker_session: str,
    workspace_images: set[str],
) -> None:
    """A failing RUN step fails the submit with the step's output; no container, no tag remain."""
    ws = make_workspace(
        tmp_path / "ws",
        {"Dockerfile.torchx": "ARG IMAGE\nFROM $IMAGE\nRUN echo about to fail && exit 7\n"},
    )
    app = sh_app(python_image, "true")
    target = runner.dryrun(app, "local_docker", workspace=str(ws)).workspace.target
    with pytest.raises(WorkspaceBuildError) as err:
        await runner.run(app, "local_docker", workspace=str(ws))
    assert "returned a non-zero code: 7" in str(err.value)
    assert any("about to fail" in line for line in err.value.log_tail)
    assert await scheduler.engine.image_id(target) is None
    assert await workspace_image_ids() == workspace_images
    assert await containers_of_session(docker_session) == []


async def test_a_build_context_cut_off_midway_builds_and_tags_nothing(
    scheduler: DockerScheduler, python_image: str, tmp_path: Path, workspace_images: set[str]
) -> None:
    """If the context stream fails midway (a file changed), that error is raised and no image is
    tagged."""
    ws = make_workspace(tmp_path / "ws", {f"f{i}": os.urandom(64 * 1024) for i in range(16)})
    buf = io.BytesIO()
    write_tar(
        scan_workspace(Workspace({str(ws): ""}), ".dockerignore"),
        buf,
        {"Dockerfile.torchx": b"ARG IMAGE\nFROM $IMAGE\nCOPY . .\n"},
    )
    data = buf.getvalue()

    async def context() -> AsyncIterator[bytes]:
        yield data[: len(data) // 2]
        await asyncio.sleep(0)
        raise WorkspaceChangedError("a file changed")

    tag = f"asynctorchx/workspace:cut-{os.getpid()}"
    with pytest.raises(WorkspaceChangedError, match="a file changed"):
        await scheduler.engine.build(
            context(),
            tag=tag,
            dockerfile="Dockerfile.torchx",
            build_args={"IMAGE": python_image},
            labels={"asynctorchx.io/workspace-hash": "cut"},
        )
    assert await scheduler.engine.image_id(tag) is None
    assert await workspace_image_ids() == workspace_images


async def test_the_dry_run_shows_the_plan_and_builds_nothing(
    runner: AsyncRunner,
    scheduler: DockerScheduler,
    python_image: str,
    tmp_path: Path,
    workspace_images: set[str],
) -> None:
    """The dry run names base image and id, recipe, files, size, hash and tag; nothing is built."""
    ws = make_workspace(tmp_path / "ws", {"a.py": "x" * 1500, "b.txt": "y" * 500}, nonce=False)
    info = runner.dryrun(sh_app(python_image, "true"), "local_docker", workspace=str(ws))
    plan = info.workspace
    base_id = await scheduler.engine.image_id(python_image)
    assert plan.files == 2 and plan.total_bytes == 2000 and plan.base_image_id == base_id
    text = str(info)
    for part in (
        f"workspace: {ws}",
        "files: 2 (2.0 kB), ignore file: .dockerignore",
        f"content hash: {plan.content_hash}",
        f"base image: {python_image} ({base_id})",
        "FROM $IMAGE",
        f"target: asynctorchx/workspace:{plan.content_hash}",
    ):
        assert part in text
    assert info.request.containers[0].config["Image"] == plan.target
    assert info.app.roles[0].image == plan.target
    assert scheduler.engine.builds == 0
    assert await workspace_image_ids() == workspace_images


async def test_the_workspace_is_read_in_a_worker_thread_when_run_is_awaited(
    runner: AsyncRunner, python_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() plans the workspace image (walk and hash) off the event loop's thread."""
    import asynctorchx.schedulers.docker as docker_module

    threads: list[threading.Thread] = []
    real = docker_module.plan_image

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(docker_module, "plan_image", recording)
    ws = make_workspace(tmp_path / "ws", {"a.py": ""})
    await run_to_end(runner, sh_app(python_image, "true"), str(ws))
    assert threads and threading.main_thread() not in threads


@pytest.mark.parametrize("kind", ["missing", "a-file"])
async def test_a_missing_or_file_workspace_fails_before_any_container(
    runner: AsyncRunner,
    scheduler: DockerScheduler,
    python_image: str,
    tmp_path: Path,
    kind: str,
    docker_session: str,
) -> None:
    """A workspace that does not exist, or is a file, is an error naming it; nothing is created."""
    path = tmp_path / "nope"
    if kind == "a-file":
        path.write_text("not a directory")
    with pytest.raises(InvalidWorkspaceException, match=str(path)):
        await runner.run(sh_app(python_image, "true"), "local_docker", workspace=str(path))
    assert await containers_of_session(docker_session) == []
    assert scheduler.engine.builds == 0


def test_an_unreadable_workspace_file_fails_before_any_container(
    docker_engine: None, python_image: str, tmp_path: Path, docker_session: str
) -> None:
    """A file the submitter cannot read is an error naming it; no container or image is made."""
    ws = make_workspace(tmp_path / "ws", {"ok.py": "", "secret.py": "s"})
    (ws / "secret.py").chmod(0o000)
    code = f"""
import asyncio
from asynctorchx.runner import AsyncRunner
from asynctorchx.specs import AppDef, Role, InvalidWorkspaceException

async def main():
    async with AsyncRunner(name={docker_session!r}) as r:
        app = AppDef("ws", [Role("trainer", image={python_image!r}, entrypoint="true")])
        try:
            await r.run(app, "local_docker", workspace={str(ws)!r})
        except InvalidWorkspaceException as e:
            print("ERROR", e)

asyncio.run(main())
"""
    before = asyncio.run(workspace_image_ids())
    out = run_as_unprivileged_reader(code)
    assert (
        f"ERROR workspace file '{ws / 'secret.py'}' cannot be read: Permission denied" in out.stdout
    ), out
    assert asyncio.run(containers_of_session(docker_session)) == []
    assert asyncio.run(workspace_image_ids()) == before


async def containers_of_session(session: str) -> list[str]:
    import aiodocker

    from asynctorchx.schedulers._docker.request import LABEL_SESSION

    async with aiodocker.Docker() as client:
        label = json.dumps({"label": [f"{LABEL_SESSION}={session}"]})
        return [c["Id"] for c in await client.containers.list(all=True, filters=label)]
