"""Helpers for the workspace tests: workspaces on disk, the workspace images a test built, and the
test registry of ``scripts/engines/registry.sh``.

- ``make_workspace`` writes a directory of files; each gets a nonce file of its own, so that no two
  tests (or two runs of one test) share a content hash, hence an image or a snapshot.
- ``workspace_images`` removes, after the test, every workspace image (label
  ``asynctorchx.io/workspace-hash``) that did not exist before it, with the repository tags it got.
- ``registry`` checks that the registry answers on ``ASYNCTORCHX_REGISTRY`` (default
  127.0.0.1:5000); without it the test skips, or fails when ``ASYNCTORCHX_REQUIRE_ENGINES=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from conftest import engine_missing

LABEL = "asynctorchx.io/workspace-hash"
REGISTRY = os.environ.get("ASYNCTORCHX_REGISTRY", "127.0.0.1:5000")
REGISTRY_HINT = "run `bash scripts/engines/registry.sh`"


def drop_file_capabilities() -> None:
    """In a child before exec: root loses the right to read files whose mode forbids it
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a mode-000 file is unreadable as for anyone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def run_as_unprivileged_reader(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``python -c code`` unable to read files whose mode forbids it, even as root."""
    preexec = drop_file_capabilities if os.getuid() == 0 else None
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        preexec_fn=preexec,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def make_workspace(root: Path, files: Mapping[str, str | bytes], *, nonce: bool = True) -> Path:
    """Writes ``files`` ({relative path: content}) under ``root`` (plus ``.nonce``); returns it."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if nonce:
        (root / ".nonce").write_text(uuid.uuid4().hex)
    return root


async def workspace_image_ids() -> set[str]:
    """The ids of every workspace image the engine has."""
    import aiodocker

    async with aiodocker.Docker() as client:
        images = await client.images.list(filters={"label": [LABEL]})
    return {str(i["Id"]) for i in images}


async def remove_images(ids: set[str]) -> None:
    """Removes the images ``ids`` with all their tags (errors ignored)."""
    import aiodocker
    from aiodocker.exceptions import DockerError

    async with aiodocker.Docker() as client:
        for image_id in ids:
            with contextlib.suppress(DockerError):
                await client.images.delete(image_id, force=True)


@pytest.fixture
async def workspace_images(docker_engine: None) -> AsyncIterator[set[str]]:
    """The workspace images present before the test; those built during it are removed after."""
    before = await workspace_image_ids()
    yield before
    await remove_images(await workspace_image_ids() - before)


def registry_answers() -> bool:
    """True when the test registry answers ``GET /v2/``."""
    try:
        with urllib.request.urlopen(f"http://{REGISTRY}/v2/", timeout=3) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.fixture
def registry(docker_engine: None) -> str:
    """The test registry's address (host:port) on 127.0.0.1."""
    if not registry_answers():
        engine_missing(f"a container registry on {REGISTRY} ({REGISTRY_HINT})")
    return REGISTRY


def registry_tags(registry: str, repository: str) -> list[str]:
    """The tags the registry has for ``repository`` (the path after the registry's address)."""
    try:
        with urllib.request.urlopen(f"http://{registry}/v2/{repository}/tags/list", timeout=5) as r:
            return list(json.load(r).get("tags") or [])
    except OSError:
        return []
