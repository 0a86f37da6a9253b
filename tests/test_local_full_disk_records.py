"""local: an app that ends while its state root is full keeps its true end for other processes.

Found by a full-disk review: the terminal version of an app's record is appended to its record
file; on a full file system that append fails, and it was rewritten in place only when it fitted
in the blocks the file already held. A record holding only its first (RUNNING) version had no room
to spare: a terminal version one exit code or one error file larger did not fit, the launcher's
retries at its close failed too, and other processes read the app RUNNING for as long as its
launcher lived, then FAILED "lost" — for good, even after the space came back. A file holding one
version now holds it padded to twice its size (``protocol._with_room``), and a version whose long
texts (a torchelastic error file) do not fit even so is written with them cut.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import anyio
import pytest
from _local_env import tiny_tmpfs, wait_for
from test_local_reliability import fill, read_elsewhere

from asynctorchx.schedulers.local import LocalScheduler
from asynctorchx.specs import AppDef, AppState, Role

pytestmark = pytest.mark.timeout(120)

GATE = 'while [ ! -e "$GO" ]; do sleep 0.01; done'
PAGE = 4096


async def first_document_size(root: Path, app_id: str) -> int:
    """The size of the app's RUNNING version (its replica started), without any padding."""
    record = root / ".apps" / f"{app_id}.json"
    with anyio.fail_after(30):
        while True:
            if record.exists():
                lines = [ln.strip() for ln in record.read_bytes().split(b"\n") if ln.strip()]
                docs = [json.loads(ln) for ln in lines]
                if docs and docs[-1]["state"] == "RUNNING" and docs[-1]["replicas"][0]["pid"]:
                    return len(lines[-1])
            await asyncio.sleep(0.01)


def gated(go: Path, pad: int, script: str = GATE) -> AppDef:
    return AppDef(
        "big",
        [
            Role(
                "main",
                image="x",
                entrypoint="sh",
                args=["-c", script],
                env={"GO": str(go), "PAD": "p" * pad},
            )
        ],
    )


async def test_a_success_whose_terminal_version_is_larger_than_the_page_is_read_elsewhere(
    tmp_path: Path,
) -> None:
    """The first version of the record is a few bytes short of a page (the file's only block,
    before); the state root fills; the app succeeds; its launcher closes and the space comes
    back: another process reads SUCCEEDED (it read RUNNING, then FAILED "lost")."""
    logs = str(tmp_path / "logs")
    with tiny_tmpfs(tmp_path / "state", "2m") as state:
        root = state / "root"
        s = LocalScheduler("full", local_root=root)
        try:
            go0 = tmp_path / "go0"
            probe = await s.submit(gated(go0, 1000), {"log_dir": logs})
            size0 = await first_document_size(root, probe)
            go0.touch()
            await wait_for(s, probe)
            go = tmp_path / "go"
            app_id = await s.submit(gated(go, 1000 + PAGE - 8 - size0), {"log_dir": logs})
            size = await first_document_size(root, app_id)
            assert PAGE - 16 <= size <= PAGE - 2, size  # (the pid's digits may differ)
            filler = fill(state)
            go.touch()
            assert (await wait_for(s, app_id)).state == AppState.SUCCEEDED
        finally:
            await s.close()
        filler.unlink()
        seen = await read_elsewhere(root, app_id)
        assert seen["describe"] == seen["list"] == "SUCCEEDED", seen


ERROR_FILE = (
    GATE + "; python3 -c \"import json,os; json.dump({'message': {'message': "
    "'boom ' + 'x' * 6000, 'extraInfo': {'timestamp': '0'}}}, "
    "open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w'))\"; exit 3"
)


async def test_a_failure_with_a_long_error_file_on_a_full_state_root_is_read_failed_elsewhere(
    tmp_path: Path,
) -> None:
    """An ordinary app fails leaving a 6 KB torchelastic error file (a traceback) while the state
    root is full: its terminal version holds that error twice and fits nowhere whole. Once its
    launcher has closed and the space is back, another process reads FAILED with the start of the
    error and a note that it was cut (it read RUNNING, then FAILED "lost")."""
    go = tmp_path / "go"
    with tiny_tmpfs(tmp_path / "state", "2m") as state:
        root = state / "root"
        s = LocalScheduler("full", local_root=root)
        try:
            app_id = await s.submit(gated(go, 0, ERROR_FILE), {"log_dir": str(tmp_path / "logs")})
            await first_document_size(root, app_id)
            filler = fill(state)
            go.touch()
            desc = await wait_for(s, app_id)
            assert desc.state == AppState.FAILED and "boom" in desc.structured_error_msg
        finally:
            await s.close()
        filler.unlink()
        seen = await read_elsewhere(root, app_id)
        assert seen["describe"] == seen["list"] == "FAILED", seen
        assert "lost" not in seen["msg"], seen
        record = (root / ".apps" / f"{app_id}.json").read_bytes()
        assert b"boom xxx" in record and b"cut: the state root" in record
        assert os.path.getsize(root / ".apps" / f"{app_id}.json") < 3 * PAGE
