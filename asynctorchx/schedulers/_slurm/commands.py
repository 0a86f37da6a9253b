"""The seam between the slurm backend and the Slurm commands: an injectable async command runner.

``SlurmScheduler`` never starts a process itself; it calls a ``CommandRunner``. The default one
runs the command as an asyncio subprocess (the event loop keeps running while it does); unit tests
pass a fake that returns recorded outputs, and the counting tests wrap the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

#: Who answers a command that talks to another daemon than the controller (slurmctld).
_SERVER = {
    "sacct": "the Slurm accounting daemon (slurmdbd)",
    "sacctmgr": "the Slurm accounting daemon (slurmdbd)",
    "sreport": "the Slurm accounting daemon (slurmdbd)",
}


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left behind.

    Args:
        argv: the command line that ran.
        returncode: its exit status.
        stdout: what it printed on stdout (decoded, invalid UTF-8 replaced).
        stderr: what it printed on stderr.
    """

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs one command to completion without blocking the event loop.

    Raises ``FileNotFoundError`` when the program does not exist.
    """

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult: ...


class SubprocessRunner:
    """The real ``CommandRunner``: an asyncio subprocess per command.

    Args:
        env: extra environment variables for every command (e.g. ``SLURM_CONF``).
        timeout: seconds after which a command (and every process it started) is killed and
            ``TimeoutError`` raised, naming the command (None: never).
    """

    def __init__(self, env: dict[str, str] | None = None, timeout: float | None = 120.0) -> None:
        self._env = {**os.environ, **env} if env else None
        self._timeout = timeout

    @property
    def environ(self) -> Mapping[str, str]:
        """The environment the commands run with (``sbatch`` reads options from it too)."""
        return os.environ if self._env is None else self._env

    async def __call__(self, argv: Sequence[str], *, stdin: str | None = None) -> CommandResult:
        # A session of its own, so that a command that is a wrapper script is killed with what it
        # started: a child left holding the pipes would keep communicate() waiting past the timeout.
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(None if stdin is None else stdin.encode()), self._timeout
            )
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.shield(proc.wait())
            if isinstance(e, TimeoutError):
                raise TimeoutError(
                    f"{argv[0]} did not finish within {self._timeout:g} s (killed): "
                    f"is {_SERVER.get(os.path.basename(argv[0]), 'the Slurm controller')} answering?"
                ) from None
            raise
        assert proc.returncode is not None
        return CommandResult(
            argv=tuple(argv),
            returncode=proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
        )
