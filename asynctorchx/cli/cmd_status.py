"""``asynctorchx status HANDLE [--json]``: the app's state and its replicas."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``status`` command."""
    p = sub.add_parser(
        "status",
        parents=[common],
        formatter_class=HelpFormatter,
        help="show an app's status",
        description="Shows the state of an app and of each of its replicas. Exits 4 when the "
        "scheduler does not know the app.",
    )
    p.add_argument("handle", metavar="HANDLE", help="the app handle printed by 'asynctorchx run'")
    p.add_argument("--json", action="store_true", help="print the status as a JSON object")
    p.set_defaults(handler=execute, is_async=True, command="status")


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the status of ``args.handle``."""
    import json

    from asynctorchx.cli._common import runner_for_handle, unknown_app
    from asynctorchx.cli._output import out_styler

    runner, handle = runner_for_handle(args.handle)
    args.scheduler = handle.split("://", 1)[0]
    async with runner:
        status = await runner.status(handle)
    if status is None:
        raise unknown_app(handle)
    if args.json:
        print(json.dumps({"handle": handle, **status.to_json()}, indent=2))
        return 0
    style = out_styler()
    lines = [handle]
    for line in status.format().splitlines():
        key, sep, value = line.partition("State: ")
        if sep and not key.strip():
            line = f"{key}{sep}{style.state(value)}"
        lines.append(line)
    print("\n".join(lines))
    return 0
