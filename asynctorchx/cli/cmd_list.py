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
    p.set_defaults(handler=execute, is_async=True, command="list")


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the apps of ``args.scheduler``."""
    import json

    from asynctorchx.cli._common import runner_for_session
    from asynctorchx.cli._config import default_scheduler
    from asynctorchx.cli._output import format_table, out_styler

    args.scheduler = args.scheduler or default_scheduler()
    async with runner_for_session(None) as runner:
        apps = await runner.list(args.scheduler)
    if args.json:
        rows = [
            {"handle": a.app_handle, "app_id": a.app_id, "state": a.state.name, "name": a.name}
            for a in apps
        ]
        print(json.dumps(rows, indent=2))
        return 0
    if not apps:
        from asynctorchx.cli._output import info

        info(f"no apps on {args.scheduler}")
        return 0
    table = format_table(
        ("HANDLE", "STATE", "NAME"),
        [(a.app_handle, a.state.name, a.name) for a in apps],
        out_styler(),
        state_col=1,
    )
    print(table)
    return 0
