"""What a submit reads from files happens in a worker thread, never on the event loop thread:
``.torchxconfig``'s trackers, and component files (``path.py:fn``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from asynctorchx import AsyncRunner
from asynctorchx.runner import config
from asynctorchx.specs import AppDef, Role
from asynctorchx.testing import ScriptedBackend

pytestmark = pytest.mark.timeout(60)


def app() -> AppDef:
    return AppDef("a", [Role("worker", image="img", entrypoint="true")])


async def test_torchxconfig_trackers_are_read_once_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """50 concurrent runs read the trackers' config once, in a worker thread."""
    reads: list[threading.Thread] = []
    real = config.configured_trackers

    def spy() -> list[config.TrackerSetting]:
        reads.append(threading.current_thread())
        return real()

    monkeypatch.setattr(config, "configured_trackers", spy)
    backend = ScriptedBackend("slurm")
    async with AsyncRunner(scheduler_factories={"slurm": backend}) as runner:
        await asyncio.gather(*(runner.run(app(), "slurm") for _ in range(50)))
    assert len(reads) == 1
    assert reads[0] is not threading.main_thread()


async def test_a_bad_tracker_config_fails_every_submit_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A .torchxconfig whose tracker section is broken fails the submits (read off the loop), and
    is read again at the next submit once fixed."""
    conf = tmp_path / ".torchxconfig"
    conf.write_text("[torchx:tracker]\nbad name = x\n")
    monkeypatch.setenv("TORCHXCONFIG", str(conf))
    backend = ScriptedBackend("slurm")
    async with AsyncRunner(scheduler_factories={"slurm": backend}) as runner:
        with pytest.raises(ValueError, match="bad name"):
            await runner.run(app(), "slurm")
        conf.write_text("[torchx:tracker]\n")
        await runner.run(app(), "slurm")


async def test_a_component_file_is_loaded_off_the_loop(tmp_path: Path) -> None:
    """run_component of ``path.py:fn`` reads and runs the file in a worker thread."""
    comp = tmp_path / "comp.py"
    comp.write_text(
        "import threading\n"
        "import asynctorchx.specs as specs\n\n\n"
        "def job() -> specs.AppDef:\n"
        '    """A job.\n    """\n'
        "    return specs.AppDef(\n"
        '        "t",\n'
        "        [\n"
        "            specs.Role(\n"
        '                "w",\n'
        '                image="img",\n'
        '                entrypoint="true",\n'
        '                env={"LOADED_ON": threading.current_thread().name},\n'
        "            )\n"
        "        ],\n"
        "    )\n"
    )
    backend = ScriptedBackend("slurm")
    async with AsyncRunner(scheduler_factories={"slurm": backend}) as runner:
        await runner.run_component(f"{comp}:job", [], "slurm")
    [submitted] = backend.apps.values()
    assert submitted.app.roles[0].env["LOADED_ON"] != threading.main_thread().name
