"""Faults found by probing the claim of a local app's id: hand-made app ids too long for the files
named after them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from _local_env import GATE, wait_for

from asynctorchx.schedulers._local import protocol
from asynctorchx.schedulers._local.recordfile import MAX_APP_ID
from asynctorchx.specs import AppDef, AppState, Role


def _claims_and_records(records: str) -> list[str]:
    """The claims (``claim:ID``) and record files in the records directory ``records``."""
    claims_dir = os.path.join(records, protocol.CLAIMS_DIR)
    claims = os.listdir(claims_dir) if os.path.isdir(claims_dir) else []
    found = [f"claim:{n}" for n in claims if not n.startswith(".")]  # (not the holder files)
    return sorted(found + [n for n in os.listdir(records) if n.endswith(".json")])


def _gated_app(go: Path) -> AppDef:
    """An app whose replica runs until ``go`` exists."""
    role = Role("main", image="x", entrypoint="sh", args=["-c", GATE], env={"GO": str(go)})
    return AppDef("long", [role])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("length", [MAX_APP_ID + 1, 240, 254])
async def test_a_dry_run_whose_app_id_is_too_long_for_its_files_is_refused(
    tmp_path: Path, length: int
) -> None:
    """A hand-made app id longer than ``MAX_APP_ID`` (its record, lock or cancel marker would not
    fit in a file name) is refused with a ValueError naming its length before any claim, file or
    process."""
    from asynctorchx.schedulers.local import LocalScheduler

    root, go = tmp_path / "root", tmp_path / "go"
    async with LocalScheduler("long", local_root=root) as s:
        info = s.submit_dryrun(_gated_app(go), {})
        info.request = dataclasses.replace(info.request, app_id="a" * length)
        with pytest.raises(ValueError, match=f"not a local app id .*at most {MAX_APP_ID}"):
            await s.schedule(info)
        assert s._runtime.apps == {}
    assert _claims_and_records(str(root / ".apps")) == []


CANCEL = textwrap.dedent(
    """
    import asyncio, sys
    from asynctorchx.schedulers.local import LocalScheduler

    async def main(root, app_id):
        async with LocalScheduler("other", local_root=root) as s:
            await s.cancel(app_id)

    asyncio.run(main(*sys.argv[1:3]))
    """
)


@pytest.mark.timeout(60)
async def test_an_app_id_of_the_longest_length_runs_and_is_cancelled_by_another_process(
    tmp_path: Path,
) -> None:
    """An app id of ``MAX_APP_ID`` characters is launched, recorded and cancelled from another
    process (its lock file and cancel marker fit in file names): it ends CANCELLED."""
    from asynctorchx.schedulers.local import LocalScheduler

    root, go = tmp_path / "root", tmp_path / "go"
    async with LocalScheduler("long", local_root=root) as s:
        info = s.submit_dryrun(_gated_app(go), {})
        app_id = "a" * MAX_APP_ID
        info.request = dataclasses.replace(info.request, app_id=app_id)
        assert await s.schedule(info) == app_id
        cancel = [sys.executable, "-c", CANCEL, str(root), app_id]
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(cancel, capture_output=True, text=True, timeout=40)
        )
        assert done.returncode == 0, done.stderr
        desc = await wait_for(s, app_id)
        assert desc.state == AppState.CANCELLED, desc
