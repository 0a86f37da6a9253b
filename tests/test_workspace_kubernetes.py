# ruff: noqa: F811 - the fixtures imported from _docker_env/_workspace_env are redefined as parameters
"""Workspaces on kubernetes: built by the real Docker engine, pushed to the real test registry of
``scripts/engines/registry.sh`` (127.0.0.1 only), submitted to the in-repo fake API server.

Every test pushes to a repository of its own; the workspace images it built (and pulled) are
removed after it.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _docker_env import docker_engine, python_image  # noqa: F401 - pytest fixtures
from _workspace_env import (  # noqa: F401 - pytest fixtures
    make_workspace,
    registry,
    registry_tags,
    remove_images,
    workspace_image_ids,
    workspace_images,
)
from k8s_fake import FakeKubeApiServer
from k8s_fake.testing import fake_k8s  # noqa: F401 - pytest fixture

from asynctorchx.runner import AsyncRunner
from asynctorchx.schedulers._docker.engine import DockerEngine
from asynctorchx.schedulers.kubernetes import KubernetesScheduler
from asynctorchx.schedulers.workspace import WorkspaceBuildError, WorkspaceEvent
from asynctorchx.specs import AppDef, InvalidRunConfigException, Role

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture
async def k8s(
    fake_k8s: FakeKubeApiServer, docker_engine: None, workspace_images: set[str]
) -> AsyncIterator[KubernetesScheduler]:
    """The kubernetes scheduler on the fake API server, building with the real Docker engine."""
    sched = KubernetesScheduler("test", k8s_configuration=fake_k8s.configuration())
    yield sched
    await sched.close()


@pytest.fixture
async def runner(k8s: KubernetesScheduler) -> AsyncIterator[AsyncRunner]:
    """A runner whose kubernetes backend is ``k8s``."""
    async with AsyncRunner(
        name="test", scheduler_factories={"kubernetes": lambda s, **_: k8s}
    ) as r:
        yield r


def repository(registry: str) -> tuple[str, str]:
    """A repository of the test's own on ``registry``: (full name, path in the registry)."""
    path = f"asynctorchx-test/ws-{uuid.uuid4().hex[:10]}"
    return f"{registry}/{path}", path


def trainer(image: str) -> AppDef:
    return AppDef("wsk", [Role("trainer", image=image, entrypoint="python3", args=["train.py"])])


def job_images(srv: FakeKubeApiServer) -> list[str]:
    return [
        c["image"]
        for job in srv.store.list("jobs", "default")
        for c in job["spec"]["template"]["spec"]["containers"]
    ]


async def run_app(
    runner: AsyncRunner, image: str, repo: str, ws: Path, events: list[WorkspaceEvent]
) -> None:
    """Runs the trainer app on kubernetes with ``ws`` pushed to ``repo``; events go to ``events``."""
    await runner.run(
        trainer(image),
        "kubernetes",
        {"image_repo": repo},
        workspace=str(ws),
        progress=events.append,
    )


def created(srv: FakeKubeApiServer) -> list[str]:
    """The paths of every POST the API server received (objects it was asked to create)."""
    return [r.path for r in srv.requests if r.method == "POST"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_dry_run_names_the_pushed_image_and_builds_and_pushes_nothing(
    k8s: KubernetesScheduler,
    registry: str,
    python_image: str,
    tmp_path: Path,
    fake_k8s: FakeKubeApiServer,
    workspace_images: set[str],
) -> None:
    """The manifests reference {image_repo}:{hash}; nothing is built, pushed or created."""
    ws = make_workspace(tmp_path / "ws", {"train.py": "print('hi')\n"})
    repo, path = repository(registry)
    info = k8s.submit_dryrun(trainer(python_image), {"image_repo": repo}, workspace=str(ws))
    plan = info.workspace
    assert plan.target == f"{repo}:{plan.content_hash}" and plan.push_to == plan.target
    images = [
        c["image"]
        for job in info.request.jobs
        for c in job["spec"]["template"]["spec"]["containers"]
    ]
    assert images == [plan.target]
    assert f"pushed to: {plan.target}" in str(info)
    assert await workspace_image_ids() == workspace_images
    assert registry_tags(registry, path) == []
    assert created(fake_k8s) == []


async def test_schedule_pushes_the_image_which_pulls_back_from_a_clean_store(
    runner: AsyncRunner,
    registry: str,
    python_image: str,
    tmp_path: Path,
    fake_k8s: FakeKubeApiServer,
) -> None:
    """run() builds, pushes (progress streamed) and submits; the image comes back by its name."""
    import aiodocker

    ws = make_workspace(tmp_path / "ws", {"train.py": "print('hi')\n"})
    repo, path = repository(registry)
    events: list[WorkspaceEvent] = []
    await run_app(runner, python_image, repo, ws, events)
    [target] = job_images(fake_k8s)
    tag = target.rsplit(":", 1)[1]
    assert target == f"{repo}:{tag}" and registry_tags(registry, path) == [tag]
    pushes = [e for e in events if e.stage == "push"]
    assert pushes and pushes[-1].final and any("Pushed" in e.message for e in pushes)
    engine = DockerEngine()
    try:
        image_id = await engine.image_id(target)
        assert image_id is not None
        await remove_images({image_id})
        assert await engine.image_id(target) is None
        async with aiodocker.Docker() as client:
            await client.images.pull(target)
        assert await engine.image_id(target) == image_id
    finally:
        await engine.close()


async def test_a_registry_that_is_down_fails_the_submit_before_any_object_is_created(
    runner: AsyncRunner, python_image: str, tmp_path: Path, fake_k8s: FakeKubeApiServer
) -> None:
    """A push to a closed port fails clearly, naming the image; the API server sees no create."""
    ws = make_workspace(tmp_path / "ws", {"train.py": ""})
    repo = f"127.0.0.1:{free_port()}/team/app"
    with pytest.raises(WorkspaceBuildError, match=rf"pushing image {repo}:\w+ failed: .*refused"):
        await runner.run(
            trainer(python_image), "kubernetes", {"image_repo": repo}, workspace=str(ws)
        )
    assert created(fake_k8s) == []


@pytest.fixture
def refusing_registry(tmp_path: Path, docker_engine: None) -> Iterator[str]:
    """A second docker-registry, read-only (it refuses every push), on a free 127.0.0.1 port."""
    binary = shutil.which("docker-registry")
    if binary is None:
        from conftest import engine_missing

        engine_missing("Debian's docker-registry (run `bash scripts/engines/registry.sh`)")
    addr = f"127.0.0.1:{free_port()}"
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        "  maintenance:\n    readonly:\n      enabled: true\n"
        f"http:\n  addr: {addr}\n"
    )
    proc = subprocess.Popen([str(binary), "serve", str(config)], stderr=subprocess.DEVNULL)
    try:
        import time
        import urllib.request

        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://{addr}/v2/", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the read-only registry did not start") from None
                time.sleep(0.1)
        yield addr
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_registry_that_refuses_the_push_fails_the_submit_and_keeps_no_secret(
    runner: AsyncRunner,
    refusing_registry: str,
    python_image: str,
    tmp_path: Path,
    fake_k8s: FakeKubeApiServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused push fails the submit with the registry's words, before any object is created;
    the repository tag is removed again, and the Docker config's password appears nowhere."""
    secret = f"s3cret-{uuid.uuid4().hex}"
    config_dir = tmp_path / "docker-config"
    config_dir.mkdir()
    auth = base64.b64encode(f"ci:{secret}".encode()).decode()
    (config_dir / "config.json").write_text(
        json.dumps({"auths": {refusing_registry: {"auth": auth}}})
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(config_dir))
    caplog.set_level(logging.DEBUG)
    ws = make_workspace(tmp_path / "ws", {"train.py": ""})
    repo = f"{refusing_registry}/team/app"
    events: list[WorkspaceEvent] = []
    with pytest.raises(WorkspaceBuildError, match=rf"pushing image {repo}:\w+ failed") as err:
        await run_app(runner, python_image, repo, ws, events)
    assert created(fake_k8s) == []
    target = str(err.value).split()[2]
    engine = DockerEngine()
    try:
        assert await engine.image_id(target) is None
        local = f"asynctorchx/workspace:{target.rsplit(':', 1)[1]}"
        assert await engine.image_id(local) is not None  # the build itself is kept (cached)
    finally:
        await engine.close()
    everything = str(err.value) + " ".join(err.value.log_tail) + caplog.text
    assert any(e.stage == "push" for e in events)
    everything += " ".join(e.message for e in events)
    assert secret not in everything and auth not in everything


async def test_without_image_repo_a_workspace_is_an_error_that_says_to_set_it(
    k8s: KubernetesScheduler,
    python_image: str,
    tmp_path: Path,
    fake_k8s: FakeKubeApiServer,
    workspace_images: set[str],
) -> None:
    """A workspace with no image_repo fails the dry run, saying to set image_repo."""
    ws = make_workspace(tmp_path / "ws", {"train.py": ""})
    with pytest.raises(InvalidRunConfigException, match="set the image_repo run option"):
        await k8s.submit_dryrun_async(trainer(python_image), {}, workspace=str(ws))
    assert await workspace_image_ids() == workspace_images
    assert created(fake_k8s) == []


@pytest.mark.parametrize(
    "repo",
    [
        "Registry.Example.com:x/app",
        "registry.example.com/Team/app",
        "reg.io/app:v1",
        "reg.io//app",
        "a@sha256:00",
    ],
)
async def test_an_invalid_image_repo_is_rejected_naming_it(
    runner: AsyncRunner,
    python_image: str,
    tmp_path: Path,
    fake_k8s: FakeKubeApiServer,
    workspace_images: set[str],
    repo: str,
) -> None:
    """An image_repo that is not a repository reference fails before any build or object."""
    ws = make_workspace(tmp_path / "ws", {"train.py": ""})
    with pytest.raises(
        InvalidRunConfigException, match=rf"image_repo must be .*{re.escape(repr(repo))}"
    ):
        await runner.run(
            trainer(python_image), "kubernetes", {"image_repo": repo}, workspace=str(ws)
        )
    assert await workspace_image_ids() == workspace_images
    assert created(fake_k8s) == []
