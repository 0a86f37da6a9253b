"""Exit codes, the CLI's own error type, and how library errors become one line with a hint.

Library exception classes are matched by name along the MRO, so this module imports nothing heavy and
works for modules that were never imported (an error from a module cannot occur unless it was).
"""

from __future__ import annotations

import errno
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asynctorchx.specs.api import AppState


class ExitCode(IntEnum):
    """The exit status of every ``asynctorchx`` command."""

    SUCCEEDED = 0
    FAILED = 1
    USAGE = 2
    CANCELLED = 3
    UNKNOWN = 4
    TIMEOUT = 124
    INTERRUPTED = 130


class CliError(Exception):
    """Raised by a command to stop with one line on stderr, a hint and an exit code.

    Args:
        message: what went wrong, naming the offending value.
        hint: what to do about it (may be empty).
        code: the exit code.
    """

    def __init__(self, message: str, hint: str = "", code: int = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = int(code)


class StdoutError(OSError):
    """Raised (instead of the OSError the write raised, with its errno and strerror) when the
    command's standard output cannot be written or flushed: a full disk under ``> file`` is then
    told apart from a full state root or log directory, which say ENOSPC too. A closed pipe is not
    one (it stays ``BrokenPipeError``: the reader went away, the command ends quietly)."""


def exit_code_for_state(state: AppState | None) -> int:
    """The exit code of a final app state (None and non-terminal states count as unknown)."""
    name = None if state is None else state.name
    return {
        "SUCCEEDED": ExitCode.SUCCEEDED,
        "FAILED": ExitCode.FAILED,
        "CANCELLED": ExitCode.CANCELLED,
    }.get(name or "", ExitCode.UNKNOWN)


# Severity order for commands that report one code for many apps: the worst one wins.
_SEVERITY = {
    ExitCode.SUCCEEDED: 0,
    ExitCode.CANCELLED: 1,
    ExitCode.FAILED: 2,
    ExitCode.UNKNOWN: 3,
}


def worst_exit_code(codes: list[int]) -> int:
    """The most severe of several app exit codes: UNKNOWN > FAILED > CANCELLED > SUCCEEDED."""
    if not codes:
        return ExitCode.SUCCEEDED
    return max(codes, key=lambda c: _SEVERITY.get(ExitCode(c), 0))


# exception class name -> (exit code, hint); {scheduler} is filled in when known.
_KNOWN: dict[str, tuple[int, str]] = {
    "MalformedAppHandleException": (
        ExitCode.USAGE,
        "a handle looks like local_cwd://SESSION/APP_ID, as printed by 'asynctorchx run'",
    ),
    "UnknownSchedulerException": (
        ExitCode.USAGE,
        "'asynctorchx runopts' lists the schedulers and their options",
    ),
    "UnknownAppException": (
        ExitCode.UNKNOWN,
        "'asynctorchx list -s {scheduler}' lists the apps the scheduler knows",
    ),
    "UnknownRoleException": (
        ExitCode.USAGE,
        "'asynctorchx describe HANDLE' shows the app's roles and replicas",
    ),
    "ComponentNotFoundException": (
        ExitCode.USAGE,
        "a component in a file is named path/to/file.py:function",
    ),
    "InvalidComponentArgsException": (
        ExitCode.USAGE,
        "'asynctorchx run COMPONENT --help' lists the component's arguments",
    ),
    "ComponentValidationException": (
        ExitCode.USAGE,
        "'asynctorchx run COMPONENT --help' shows the component's arguments",
    ),
    "InvalidAppDefException": (
        ExitCode.USAGE,
        "fix the component's arguments; 'asynctorchx run --dryrun ...' shows the app it builds",
    ),
    "InvalidWorkspaceException": (
        ExitCode.USAGE,
        "a workspace is a directory (or DIR:SUBDIR,...); 'asynctorchx run --dryrun --workspace "
        "DIR ...' shows what would be shipped",
    ),
    "WorkspaceNotSupportedException": (
        ExitCode.USAGE,
        "run without --workspace (or --workspace '' to override [cli:run] workspace)",
    ),
    "WorkspaceBuildError": (
        1,
        "the last lines of the output are above; fix the workspace's Dockerfile.torchx, or the "
        "registry, and run again",
    ),
    "WorkspaceCopyError": (
        1,
        "free space where the workspace goes (the job_dir, or the state root of local_dir), or "
        "choose another place, and run again",
    ),
    "UnknownRunError": (
        ExitCode.UNKNOWN,
        "'asynctorchx tracker list runs' lists the runs the tracker knows",
    ),
    "UnknownTrackerError": (
        ExitCode.USAGE,
        "a tracker is a builtin (fsspec), an entry point of asynctorchx.tracker or "
        "torchx.tracker, or module:factory",
    ),
    "TrackerConfigError": (ExitCode.USAGE, "fix the [tracker:NAME] config of .torchxconfig"),
    "InvalidRunConfigException": (
        ExitCode.USAGE,
        "'asynctorchx runopts {scheduler}' lists the scheduler's options (pass them as -cfg k=v,...)",
    ),
    "MissingConfigFile": (
        ExitCode.USAGE,
        "set TORCHXCONFIG to the config file to read, or to '' to read none",
    ),
    "StateRootError": (
        1,
        "run as the user who launched the apps, or set ASYNCTORCHX_LOCAL_ROOT to their state root",
    ),
    "LaunchError": (1, ""),  # (its message says what could not be started, and why)
    "LaunchSpecError": (
        ExitCode.USAGE,
        "'asynctorchx run --dryrun ...' shows each replica's command, working directory and log_dir",
    ),
}


def classify(exc: BaseException, scheduler: str = "") -> tuple[str, str, int]:
    """``(message, hint, exit code)`` for an exception a command let through."""
    if isinstance(exc, CliError):
        return exc.message, exc.hint, exc.code
    message = one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, StdoutError):
        hint = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = "free space where standard output is redirected to, or redirect it elsewhere"
        return f"cannot write standard output: {exc.strerror or message}", hint, 1
    for cls in type(exc).__mro__:
        known = _KNOWN.get(cls.__name__)
        if known is not None:
            code, hint = known
            return message, hint.format(scheduler=scheduler or "SCHEDULER"), code
    if isinstance(exc, ModuleNotFoundError | ImportError):
        return message, "install the extra the message names, or use another scheduler", 1
    if isinstance(exc, ValueError):
        return message, "", ExitCode.USAGE
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {message}", "", 1
    return (
        f"{type(exc).__name__}: {message}",
        "run again with --debug for the traceback",
        1,
    )


def one_line(text: str) -> str:
    """``text`` with its lines stripped and joined by spaces."""
    return " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
