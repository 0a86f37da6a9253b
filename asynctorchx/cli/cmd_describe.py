"""``asynctorchx describe HANDLE [--json]``: the app definition as its scheduler knows it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts
    from asynctorchx.specs.api import AppDef, Role


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``describe`` command."""
    p = sub.add_parser(
        "describe",
        parents=[common],
        formatter_class=HelpFormatter,
        help="show an app's definition (roles, commands, resources)",
        description="Shows the app's roles as its scheduler knows them (some backends cannot "
        "recover every field). Exits 4 when the scheduler does not know the app.",
    )
    p.add_argument("handle", metavar="HANDLE", help="the app handle printed by 'asynctorchx run'")
    p.add_argument("--json", action="store_true", help="print the app as a JSON object")
    p.set_defaults(handler=execute, is_async=True, fast=execute_fast, command="describe")


def execute_fast(args: argparse.Namespace) -> int | None:
    """Prints the AppDef of a local app read from its record; None when the runner must answer."""
    from asynctorchx.cli import _fastpath

    return _fastpath.answer(args, _fastpath.describe, _print)


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the AppDef of ``args.handle``."""
    from asynctorchx.cli._common import runner_for_handle

    runner, handle = runner_for_handle(args.handle)
    args.scheduler = handle.split("://", 1)[0]
    async with runner:
        app = await runner.describe(handle)
        status = await runner.status(handle) if app is not None else None
    return _print(args, handle, app, status.state.name if status is not None else "UNKNOWN")


def _print(args: argparse.Namespace, handle: str, app: AppDef | None, state: str) -> int:
    from asynctorchx.cli._common import unknown_app
    from asynctorchx.cli._output import json_text

    if app is None:
        raise unknown_app(handle)
    if args.json:
        print(json_text(app_to_json(handle, app, state), default=_json_default))
    else:
        print(format_app(handle, app, state))
    return 0


def _json_default(value: Any) -> Any:
    from enum import Enum

    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def role_to_json(role: Role) -> dict[str, Any]:
    """A JSON-ready dict of a role (enums as their values)."""
    import dataclasses

    out = {f.name: getattr(role, f.name) for f in dataclasses.fields(role)}
    out["resource"] = dataclasses.asdict(role.resource)
    out["mounts"] = [
        {"type": type(m).__name__, **dataclasses.asdict(m)} if dataclasses.is_dataclass(m) else m
        for m in role.mounts
    ]
    return out


def app_to_json(handle: str, app: AppDef, state: str) -> dict[str, Any]:
    """A JSON-ready dict of an app as ``describe --json`` prints it."""
    return {
        "handle": handle,
        "name": app.name,
        "state": state,
        "metadata": dict(app.metadata),
        "roles": [role_to_json(r) for r in app.roles],
    }


def format_app(handle: str, app: AppDef, state: str) -> str:
    """A human-readable description of an app."""
    import shlex

    from asynctorchx.cli._output import BOLD, out_styler, shown
    from asynctorchx.specs.api import MISSING

    style = out_styler()
    lines = [
        f"{style(shown(handle), BOLD)}",
        f"  name:  {shown(app.name)}",
        f"  state: {style.state(state)}",
    ]
    for role in app.roles:
        count = f"{role.num_replicas} replica{'s' if role.num_replicas != 1 else ''}"
        lines.append(f"  role {style(shown(role.name), BOLD)} ({count})")
        # a field the scheduler does not keep (MISSING, as -1 in a resource) is left out
        fields: list[tuple[str, str]] = []
        if role.image != MISSING:
            fields.append(("image", role.image))
        if role.entrypoint != MISSING:
            fields.append(("command", shlex.join([role.entrypoint, *role.args])))
        if role.env:
            fields.append(("env", " ".join(f"{k}={shlex.quote(v)}" for k, v in role.env.items())))
        r = role.resource
        if r.cpu >= 0 or r.gpu >= 0 or r.memMB >= 0:
            fields.append(("resource", f"cpu={r.cpu} gpu={r.gpu} memMB={r.memMB}"))
        if role.max_retries:
            fields.append(("retries", f"{role.max_retries} ({role.retry_policy.value})"))
        if role.port_map:
            fields.append(("ports", ", ".join(f"{k}={v}" for k, v in role.port_map.items())))
        for m in role.mounts:
            fields.append(("mount", repr(m)))
        lines.extend(f"    {k + ':':<9} {shown(v)}" for k, v in fields)
    return "\n".join(lines)
