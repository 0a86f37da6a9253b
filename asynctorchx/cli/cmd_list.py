"""``asynctorchx list [-s SCHEDULER] [--json]``: the apps a scheduler knows."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``list`` command."""
    p = sub.add_parser(
        "list",
        parents=[common],
        formatter_class=HelpFormatter,
        help="list the apps a scheduler knows",
        description="Lists the apps the scheduler knows (for local schedulers: every app recorded "
        "under the state directory, whichever process launched it).",
    )
    p.add_argument(
        "-s",
        "--scheduler",
        default=None,
        help="the scheduler (default: [cli:run] scheduler in .torchxconfig, else local_cwd)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON array of apps")
    p.set_defaults(handler=execute, is_async=True, fast=execute_fast, command="list")


def execute_fast(args: argparse.Namespace) -> int | None:
    """Prints the apps of a local scheduler read from their records; None when the runner must
    answer."""
    from asynctorchx.cli import _fastpath

    scheduler = args.scheduler
    if not scheduler:
        if not _fastpath.usable(_fastpath.DEFAULT_SCHEDULER):
            return None  # the default may come from [cli:run] of a config file
        scheduler = _fastpath.DEFAULT_SCHEDULER
    rows = _fastpath.list_apps(scheduler)
    if rows is None:
        return None
    args.scheduler = scheduler
    return _print(args, rows)


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the apps of ``args.scheduler``."""
    from asynctorchx.cli._common import runner_for_session
    from asynctorchx.cli._config import default_scheduler

    args.scheduler = args.scheduler or default_scheduler()
    async with runner_for_session(None) as runner:
        apps = await runner.list(args.scheduler)
    return _print(args, [(a.app_handle, a.app_id, a.state.name, a.name) for a in apps])


def _print(args: argparse.Namespace, apps: list[tuple[str, str, str, str]]) -> int:
    """Prints ``(handle, app_id, state, name)`` rows as a table or a JSON array."""

    from asynctorchx.cli._output import format_table, json_text, out_styler

    if args.json:
        rows = [
            {"handle": handle, "app_id": app_id, "state": state, "name": name}
            for handle, app_id, state, name in apps
        ]
        print(json_text(rows))
        return 0
    if not apps:
        from asynctorchx.cli._output import info

        info(f"no apps on {args.scheduler}")
        return 0
    table = format_table(
        ("HANDLE", "STATE", "NAME"),
        [(handle, state, name) for handle, _, state, name in apps],
        out_styler(),
        state_col=1,
    )
    print(table)
    return 0
