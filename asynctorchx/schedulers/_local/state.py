"""What happened to a local app's processes, and what it means: its states and the launcher's next
steps. Pure: no I/O, no clock.

The launcher (``_local/supervise.py``) hands each replica exit, each cancel and each failed restart
to these functions and carries out what they return, the way ``_docker/state.assess`` turns
containers into a description and follow-up actions. Every state of a local app and of its replicas
is decided here:

- a replica that exits 0 SUCCEEDED; the app SUCCEEDED once all of them did;
- a replica that fails while it has retries left (under REPLICA its own, else its role's) is
  restarted, with the replicas its role's ``RetryPolicy`` names (REPLICA: itself, ROLE: its
  role's, APPLICATION: all), the running ones stopped first; they read PENDING until they start
  again;
- a replica that fails with no retry left fails the app (with its message and structured error);
  the replicas still running are stopped and end CANCELLED;
- a cancel stops every replica (CANCELLED, or SUCCEEDED for one that exits 0 while it stops) and
  ends the app CANCELLED; a restart that cannot start fails the app.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import NamedTuple

from asynctorchx.specs.api import AppState, RetryPolicy, is_terminal


class Exit(NamedTuple):
    """A replica whose main process exited.

    Args:
        position: its index in the app (role order).
        role: its role.
        label: ``role[replica]``, for messages.
        code: its exit code (negative: killed by that signal; None: unknown).
    """

    position: int
    role: str
    label: str
    code: int | None


class Progress(NamedTuple):
    """Where the app stands when an exit is judged.

    Args:
        replicas: how many replicas it has.
        succeeded: how many of them succeeded already.
        retries_left: the retries left to the exited replica's role.
        policy: that role's retry policy.
        num_restarts: the restarts so far.
    """

    replicas: int
    succeeded: int
    retries_left: int
    policy: RetryPolicy
    num_restarts: int


class Verdict(NamedTuple):
    """What an exit (or a cancel, or a failed restart) means.

    Args:
        replica: the exited replica's new state (None: no replica is concerned).
        restart: restart the replicas of this scope (with the failed one); None: no restart.
        stop_others: stop every replica still running; they end CANCELLED.
        app: the app's final state, when this ends it; None: it goes on.
        msg: the app's new message (None: unchanged).
        takes_error: the app takes the replica's structured error.
    """

    replica: AppState | None
    restart: RetryPolicy | None = None
    stop_others: bool = False
    app: AppState | None = None
    msg: str | None = None
    takes_error: bool = False

    @property
    def uses_retry(self) -> bool:
        """True when this verdict spends one of the role's retries."""
        return self.restart is not None


def judge_exit(exit: Exit, progress: Progress) -> Verdict:
    """What one replica's exit means for its app (see the module docstring)."""
    if exit.code == 0:
        done = progress.succeeded + 1 >= progress.replicas
        return Verdict(AppState.SUCCEEDED, app=AppState.SUCCEEDED if done else None)
    if progress.retries_left > 0:
        msg = f"restart {progress.num_restarts + 1} after {exit.label} {describe_exit(exit.code)}"
        return Verdict(AppState.FAILED, restart=progress.policy, msg=msg)
    return Verdict(
        AppState.FAILED,
        stop_others=True,
        app=AppState.FAILED,
        msg=f"{exit.label} {describe_exit(exit.code)}",
        takes_error=True,
    )


def judge_cancel(reason: str) -> Verdict:
    """A cancel (by a user, another process or the scheduler's close): stop everything."""
    return Verdict(None, stop_others=True, app=AppState.CANCELLED, msg=reason)


def judge_restart_failure(error: str) -> Verdict:
    """A restart whose replicas could not start fails the app (the failed replica's error)."""
    return Verdict(
        None,
        stop_others=True,
        app=AppState.FAILED,
        msg=f"restart failed: {error}",
        takes_error=True,
    )


def stopped_by_cancel(code: int | None) -> AppState:
    """The state of a replica that exited while a cancel stopped its app (0: it finished first)."""
    return AppState.SUCCEEDED if code == 0 else AppState.CANCELLED


def final_state(app: AppState, replica: AppState, code: int | None, unjudged: bool) -> AppState:
    """The state a replica ends with when its app ends ``app``.

    A terminal replica keeps its state. One whose exit was not judged yet (``unjudged``) succeeded
    if it exited 0, else it shares the app's end (CANCELLED for a cancelled app, FAILED otherwise);
    any other (stopped, or waiting to be restarted) is CANCELLED.
    """
    if is_terminal(replica):
        return replica
    if not unjudged:
        return AppState.CANCELLED
    if code == 0:
        return AppState.SUCCEEDED
    return AppState.CANCELLED if app == AppState.CANCELLED else AppState.FAILED


def restart_scope(policy: RetryPolicy, failed: int, roles: Sequence[str]) -> list[int]:
    """The indexes of the replicas a failure of replica ``failed`` restarts.

    Args:
        policy: the failed replica's role's retry policy.
        failed: its index.
        roles: the role of every replica, by index.
    """
    if policy == RetryPolicy.REPLICA:
        return [failed]
    if policy == RetryPolicy.ROLE:
        return [i for i, role in enumerate(roles) if role == roles[failed]]
    return list(range(len(roles)))


def describe_exit(code: int | None) -> str:
    """``exited with code 3``, ``was killed by SIGKILL``, or ``ended`` (unknown code)."""
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
