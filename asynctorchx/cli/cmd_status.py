"""``asynctorchx status HANDLE [--json]``: the app's state and its replicas."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.specs.api import AppStatus


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
    p.add_argument(
        "--roles",
        default="",
        metavar="ROLE,...",
        help="only show these roles (comma-separated); an unknown role is an error",
    )
    p.set_defaults(handler=execute, is_async=True, fast=execute_fast, command="status")


def execute_fast(args: argparse.Namespace) -> int | None:
    """Prints the status of a local app read from its record; None when the runner must answer."""
    from asynctorchx.cli import _fastpath

    return _fastpath.answer(args, _fastpath.status, _print)


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the status of ``args.handle``."""
    from asynctorchx.cli._common import runner_for_handle

    runner, handle = runner_for_handle(args.handle)
    args.scheduler = handle.split("://", 1)[0]
    async with runner:
        status = await runner.status(handle)
    return _print(args, handle, status)


def _print(args: argparse.Namespace, handle: str, status: AppStatus | None) -> int:

    from asynctorchx.cli._common import unknown_app
    from asynctorchx.cli._output import json_text, out_styler

    if status is None:
        raise unknown_app(handle)
    roles = _roles(args.roles, [r.role for r in status.roles], handle)
    if args.json:
        out = {"handle": handle, **status.to_json()}
        if roles is not None:
            out["roles"] = [r for r in out["roles"] if r["role"] in roles]
        print(json_text(out))
        return 0
    style = out_styler()
    lines = [handle]
    for line in status.format(roles).splitlines():
        key, sep, value = line.partition("State: ")
        if sep and not key.strip():
            line = f"{key}{sep}{style.state(value)}"
        lines.append(line)
    print("\n".join(lines))
    return 0


def _roles(spec: str, known: list[str], handle: str) -> list[str] | None:
    """The roles of ``--roles`` (None: all).

    Raises:
        CliError: a role the app does not have (names it and lists the app's roles).
    """
    from asynctorchx.cli._errors import CliError

    wanted = [r.strip() for r in spec.split(",") if r.strip()]
    if not wanted:
        return None
    unknown = [r for r in wanted if r not in known]
    if unknown:
        raise CliError(
            f"--roles: app {handle!r} has no role {', '.join(map(repr, unknown))} "
            f"(its roles: {', '.join(known) or 'none reported'})",
            "give roles of the app, comma-separated",
        )
    return wanted
