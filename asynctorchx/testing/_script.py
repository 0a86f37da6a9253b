"""What a scripted app does over time: its states, its log lines, its exit codes, and injected faults.

Times are seconds after the app was submitted, on the backend's clock. Every script is checked when
it is made (times, order, states) and again against the app it is given to (roles, replicas), so an
inconsistent script fails the test at once with a message naming the offending value.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asynctorchx.schedulers.api import Stream
from asynctorchx.specs.api import AppDef, AppState, is_terminal
from asynctorchx.testing._clock import _seconds


class ScriptError(ValueError):
    """Raised when a script of the testing scheduler is inconsistent (names the offending value)."""


def _time(value: object, what: str) -> float:
    return _seconds(value, what, ScriptError)


@dataclass(frozen=True)
class Transition:
    """The app enters ``state`` at ``at`` seconds after its submission.

    Args:
        at: seconds after submission.
        state: the new state (not UNSUBMITTED: the app exists from its submission on).
        msg: the scheduler's message from then on (None: keep the previous one).
        num_restarts: the restart count from then on (None: keep the previous one).
    """

    at: float
    state: AppState
    msg: str | None = None
    num_restarts: int | None = None

    def __post_init__(self) -> None:
        _time(self.at, "Transition.at")
        if not isinstance(self.state, AppState):
            raise ScriptError(f"Transition.state must be an AppState, got {self.state!r}")
        if self.state == AppState.UNSUBMITTED:
            raise ScriptError(
                f"Transition at {self.at!r}: a submitted app cannot become UNSUBMITTED"
            )
        if self.msg is not None and not isinstance(self.msg, str):
            raise ScriptError(f"Transition.msg must be a string, got {self.msg!r}")
        n = self.num_restarts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ScriptError(f"Transition.num_restarts must be an integer >= 0, got {n!r}")


@dataclass(frozen=True)
class LogLine:
    """Replica ``replica`` of role ``role`` writes ``text`` to ``stream`` at ``at`` seconds.

    Args:
        at: seconds after submission.
        role: the role's name.
        text: the line; a missing final ``\\n`` is added (a text with several lines is split).
        replica: the replica's index.
        stream: ``Stream.STDOUT`` or ``Stream.STDERR`` (``COMBINED`` is what readers ask for).
    """

    at: float
    role: str
    text: str
    replica: int = 0
    stream: Stream = Stream.STDOUT

    def __post_init__(self) -> None:
        _time(self.at, "LogLine.at")
        if not isinstance(self.role, str) or not self.role:
            raise ScriptError(f"LogLine.role must be a role name, got {self.role!r}")
        if not isinstance(self.text, str):
            raise ScriptError(f"LogLine.text must be a string, got {self.text!r}")
        k = self.replica
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ScriptError(f"LogLine.replica must be an integer >= 0, got {k!r}")
        if self.stream not in (Stream.STDOUT, Stream.STDERR):
            raise ScriptError(
                f"LogLine.stream must be Stream.STDOUT or Stream.STDERR, got {self.stream!r}"
            )


def lines(
    role: str,
    texts: Sequence[str],
    *,
    start: float = 0.0,
    every: float = 0.0,
    replica: int = 0,
    stream: Stream = Stream.STDOUT,
) -> list[LogLine]:
    """``LogLine``s of ``texts`` for one replica: the first at ``start``, then one every ``every`` s."""
    return [
        LogLine(start + i * every, role, text, replica=replica, stream=stream)
        for i, text in enumerate(texts)
    ]


StateSpec = Transition | tuple[float, AppState]


def _transition(i: int, spec: object) -> Transition:
    if isinstance(spec, Transition):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        try:
            return Transition(spec[0], spec[1])
        except ScriptError as e:
            raise ScriptError(f"states[{i}]: {e}") from None
    raise ScriptError(f"states[{i}] must be a Transition or an (at, AppState) pair, got {spec!r}")


@dataclass(frozen=True)
class AppScript:
    """What an app of a ``ScriptedBackend`` does, second by second after its submission.

    Before its first transition the app is SUBMITTED. ``cancel`` makes it CANCELLED after
    ``stop_delay`` seconds, unless the script ends it before.

    Args:
        states: transitions, ``Transition``s or ``(at, AppState)`` pairs, at strictly increasing
            times; nothing may follow a terminal state (SUCCEEDED, FAILED, CANCELLED).
        logs: the log lines; none after the terminal state.
        exit_codes: per role, one exit code for every replica or a list of one per replica,
            reported once the app is terminal (default: 0 when SUCCEEDED, 1 when FAILED, none
            when CANCELLED).
        stop_delay: seconds between ``cancel`` and the app being CANCELLED.

    Raises:
        ScriptError: the script is inconsistent (names the offending value).
    """

    states: Sequence[StateSpec] = ((0.0, AppState.RUNNING),)
    logs: Sequence[LogLine] = ()
    exit_codes: Mapping[str, int | Sequence[int | None]] = field(default_factory=dict)
    stop_delay: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.states, (str, bytes)) or not isinstance(self.states, Sequence):
            raise ScriptError(f"states must be a sequence of transitions, got {self.states!r}")
        transitions = tuple(_transition(i, s) for i, s in enumerate(self.states))
        for i, (prev, cur) in enumerate(itertools.pairwise(transitions), start=1):
            if is_terminal(prev.state):
                raise ScriptError(
                    f"states[{i}]: a transition to {cur.state.name} at {cur.at!r} s follows the "
                    f"terminal state {prev.state.name} at {prev.at!r} s"
                )
            if cur.at <= prev.at:
                raise ScriptError(
                    f"states[{i}]: times must increase, got {cur.at!r} s after {prev.at!r} s"
                )
        object.__setattr__(self, "states", transitions)
        if isinstance(self.logs, (str, bytes)) or not isinstance(self.logs, Sequence):
            raise ScriptError(f"logs must be a sequence of LogLine, got {self.logs!r}")
        for i, line in enumerate(self.logs):
            if not isinstance(line, LogLine):
                raise ScriptError(f"logs[{i}] must be a LogLine, got {line!r}")
        end = self.end
        if end is not None:
            for i, line in enumerate(self.logs):
                if line.at > end:
                    raise ScriptError(
                        f"logs[{i}] at {line.at!r} s comes after the app ended "
                        f"({self.transitions[-1].state.name} at {end!r} s): {line.text!r}"
                    )
        object.__setattr__(self, "logs", tuple(self.logs))
        if not isinstance(self.exit_codes, Mapping):
            raise ScriptError(
                f"exit_codes must be a mapping of role names, got {self.exit_codes!r}"
            )
        for role, codes in self.exit_codes.items():
            values = codes if isinstance(codes, Sequence) else [codes]
            for code in values:
                if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
                    raise ScriptError(
                        f"exit_codes[{role!r}]: an exit code must be an integer or None, got {code!r}"
                    )
        _time(self.stop_delay, "stop_delay")

    @property
    def transitions(self) -> tuple[Transition, ...]:
        """The states as ``Transition``s."""
        return self.states  # type: ignore[return-value]  # normalised in __post_init__

    @property
    def end(self) -> float | None:
        """When the script ends the app (its terminal transition), or None."""
        ts = self.transitions
        return ts[-1].at if ts and is_terminal(ts[-1].state) else None

    def check_app(self, app: AppDef) -> None:
        """Checks the script against the app it is given to (roles, replica indices, exit codes).

        Raises:
            ScriptError: a log line or an exit code names a role or replica the app does not have.
        """
        replicas = {r.name: r.num_replicas for r in app.roles}
        known = ", ".join(sorted(replicas)) or "none"
        for i, line in enumerate(self.logs):
            if line.role not in replicas:
                raise ScriptError(
                    f"script of app {app.name!r}: logs[{i}] names role {line.role!r}, which the "
                    f"app does not have (roles: {known})"
                )
            if line.replica >= replicas[line.role]:
                raise ScriptError(
                    f"script of app {app.name!r}: logs[{i}] names replica {line.replica} of role "
                    f"{line.role!r}, which has {replicas[line.role]} replica(s)"
                )
        for role, codes in self.exit_codes.items():
            if role not in replicas:
                raise ScriptError(
                    f"script of app {app.name!r}: exit_codes names role {role!r}, which the app "
                    f"does not have (roles: {known})"
                )
            if isinstance(codes, Sequence) and len(codes) != replicas[role]:
                raise ScriptError(
                    f"script of app {app.name!r}: exit_codes[{role!r}] has {len(codes)} code(s) "
                    f"for {replicas[role]} replica(s)"
                )


Operation = Literal["submit", "describe", "describe_many", "cancel", "list", "log_iter"]
OPERATIONS: tuple[str, ...] = ("submit", "describe", "describe_many", "cancel", "list", "log_iter")


@dataclass(frozen=True)
class Fault:
    """Makes the ``call``-th call of ``operation`` on the backend raise ``error``.

    Calls are counted per operation over the whole backend, from 1. A failing submit creates no
    app; ``describe`` counts ``status`` and ``describe``; ``describe_many`` counts the runner's
    status rounds; ``cancel`` counts the cancels of apps the backend holds (cancelling an unknown
    app does nothing, as on every backend); ``log_iter`` counts the log reads, and its fault
    raises when the first line is asked for.

    Args:
        operation: one of submit, describe, describe_many, cancel, list, log_iter.
        call: which call (1 is the first).
        error: the exception to raise.
    """

    operation: Operation
    call: int
    error: BaseException

    def __post_init__(self) -> None:
        if self.operation not in OPERATIONS:
            raise ScriptError(
                f"Fault.operation must be one of {', '.join(OPERATIONS)}, got {self.operation!r}"
            )
        n: Any = self.call
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScriptError(f"Fault.call must be an integer >= 1, got {n!r}")
        if not isinstance(self.error, BaseException):
            raise ScriptError(f"Fault.error must be an exception instance, got {self.error!r}")
