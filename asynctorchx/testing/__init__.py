"""Test doubles for code that embeds the runner: a scripted in-memory scheduler and a virtual clock.

A service or a sweep driver built on ``AsyncRunner`` is tested without starting a process, a
container or a cluster job::

    clock = VirtualClock()
    slurm = ScriptedBackend(
        "slurm",
        AppScript(
            states=[(0, AppState.PENDING), (5, AppState.RUNNING), (60, AppState.SUCCEEDED)],
            logs=lines("trainer", ["epoch 1", "epoch 2"], start=10, every=20),
        ),
        clock=clock,
    )
    async with AsyncRunner(scheduler_factories={"slurm": slurm}) as runner:
        ...                # the code under test launches on "slurm"
        clock.advance(60)  # a minute passes at once

The scheduler implements the whole ``Scheduler`` contract (describe, describe_many, list, cancel,
log_iter with regex/since/until/should_tail/streams, log_entries and cursors) and pushes changes, so the runner's waiters
wake as soon as the clock passes a transition. ``Fault`` makes the n-th call of an operation raise.
"""

from asynctorchx.testing._clock import VirtualClock as VirtualClock
from asynctorchx.testing._scheduler import Call as Call
from asynctorchx.testing._scheduler import ScriptedApp as ScriptedApp
from asynctorchx.testing._scheduler import ScriptedBackend as ScriptedBackend
from asynctorchx.testing._scheduler import ScriptedRequest as ScriptedRequest
from asynctorchx.testing._scheduler import ScriptedScheduler as ScriptedScheduler
from asynctorchx.testing._script import AppScript as AppScript
from asynctorchx.testing._script import Fault as Fault
from asynctorchx.testing._script import LogLine as LogLine
from asynctorchx.testing._script import ScriptError as ScriptError
from asynctorchx.testing._script import Transition as Transition
from asynctorchx.testing._script import lines as lines

__all__ = [
    "AppScript",
    "Call",
    "Fault",
    "LogLine",
    "ScriptError",
    "ScriptedApp",
    "ScriptedBackend",
    "ScriptedRequest",
    "ScriptedScheduler",
    "Transition",
    "VirtualClock",
    "lines",
]
