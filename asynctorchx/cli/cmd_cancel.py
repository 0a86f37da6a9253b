"""``asynctorchx cancel HANDLE [--wait]``: stop an app."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``cancel`` command."""
    p = sub.add_parser(
        "cancel",
        parents=[common],
        formatter_class=HelpFormatter,
        help="cancel an app",
        description="Asks the app's scheduler to stop it (local apps: SIGTERM to each replica's "
        "process group, then SIGKILL after a grace period). Cancelling an app that has ended only "
        "stops what it left running, if anything (a local_docker app's surviving replicas). Exits "
        "4 when the scheduler does not know the app.",
    )
    p.add_argument("handle", metavar="HANDLE", help="the app handle printed by 'asynctorchx run'")
    p.add_argument(
        "--wait", action="store_true", help="wait until the app has ended before returning"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --wait: give up after this long (exit 124)",
    )
    p.set_defaults(handler=execute, is_async=True, command="cancel")


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Cancels ``args.handle``."""
    from asynctorchx.cli._common import runner_for_handle, unknown_app
    from asynctorchx.cli._errors import CliError, ExitCode
    from asynctorchx.cli._output import err_styler, info

    if args.timeout is not None:  # checked before anything is cancelled
        if not args.wait:
            raise CliError(f"--timeout {args.timeout:g} is given without --wait", "add --wait")
        if not args.timeout >= 0:  # also rejects nan
            raise CliError(
                f"--timeout {args.timeout:g} is not >= 0", "give a number of seconds >= 0"
            )
    runner, handle = runner_for_handle(args.handle)
    args.scheduler = handle.split("://", 1)[0]
    style = err_styler()
    async with runner:
        status = await runner.status(handle)
        if status is None:
            raise unknown_app(handle)
        try:
            # An app that has ended may still owe a stop of what it left running (a local_docker
            # app's surviving replicas when nothing followed it as it failed): the cancel does it.
            await runner.cancel(handle)
        except OSError as e:
            raise _as_state_root_error(e, args.scheduler) from None
        if status.is_terminal():
            info(f"{handle} has already ended: {style.state(status.state.name)}")
            return 0
        if not args.wait:
            info(f"cancel requested for {handle}")
            return 0
        try:
            final = await runner.wait(handle, timeout=args.timeout)
        except TimeoutError:
            raise CliError(
                f"{handle} was still running {args.timeout:g}s after the cancel request",
                f"'asynctorchx status {handle}' shows where it is",
                ExitCode.TIMEOUT,
            ) from None
    state = final.state.name if final is not None else "UNKNOWN"
    info(f"{handle} {style.state(state)}")
    return 0


def _as_state_root_error(e: OSError, scheduler: str) -> OSError:
    """``e`` as the error ``status`` and ``list`` give for an unusable state root when it names a
    file of a local app's record (the lock a cancel takes, its marker: a read-only state root);
    else ``e`` as it is."""
    from asynctorchx.schedulers._local import recordfile

    name = e.filename
    if (
        scheduler in ("local_cwd", "local_dir")
        and not isinstance(e, recordfile.StateRootError)
        and isinstance(name, str)
        and os.path.basename(os.path.dirname(name)) == ".apps"
    ):
        return recordfile.state_root_error(name, e, "write")
    return e
