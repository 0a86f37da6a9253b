"""Plugin commands: the entry-point group ``asynctorchx.cli.cmds``.

An entry point ``name = pkg.module:Command`` adds ``asynctorchx name``. ``Command()`` must have
``add_arguments(parser)`` (declares its arguments on an ``argparse.ArgumentParser``) and
``run(args)`` (runs with the parsed ``argparse.Namespace``; a plain or an ``async`` function; returns
the exit code, or None for 0): the shape of TorchX's ``SubCommand``, so a TorchX command class
ports by changing what it imports.

TorchX's own group ``torchx.cli.cmds`` is deliberately not read: its commands are written against
TorchX's runner, so they would launch and follow apps through TorchX, not through asynctorchx. A
plugin never replaces a builtin command, and a plugin that fails to load fails only its own
command (with a one-line error); both are warned about.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from asynctorchx.cli._interrupt import Interrupts

ENTRY_POINT_GROUP = "asynctorchx.cli.cmds"


def _warn(message: str) -> None:
    print(f"asynctorchx: warning: {message}", file=sys.stderr, flush=True)


def entry_points(builtins: set[str]) -> dict[str, EntryPoint]:
    """The plugin commands by name; names of builtin commands and repeated names are skipped."""
    from importlib.metadata import entry_points as all_entry_points

    found: dict[str, EntryPoint] = {}
    for ep in all_entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in builtins:
            _warn(
                f"ignoring plugin command {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP!r}): "
                f"{ep.name!r} is a builtin command"
            )
        elif ep.name in found:
            _warn(
                f"ignoring plugin command {ep.name} = {ep.value}: {ep.name!r} is already "
                f"registered as {found[ep.name].value}"
            )
        else:
            found[ep.name] = ep
    return found


def _failing(message: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        from asynctorchx.cli._errors import CliError

        raise CliError(message, "reinstall or fix the plugin, or remove it")

    return handler


def _load(ep: EntryPoint) -> Any:
    """An instance of the command class, checked for ``add_arguments`` and ``run``."""
    command = ep.load()
    instance = command() if isinstance(command, type) else command
    for method in ("add_arguments", "run"):
        if not callable(getattr(instance, method, None)):
            raise TypeError(f"{ep.value} has no {method}() method")
    return instance


def _exit_code(name: str, code: object) -> int:
    """The exit status a plugin's ``run`` returned (None: 0), or a CliError naming the plugin."""
    if code is None:
        return 0
    if isinstance(code, bool) or not isinstance(code, int):
        from asynctorchx.cli._errors import CliError

        raise CliError(
            f"plugin command {name!r} returned {code!r} from run(); an exit status is an int or None",
            "fix the plugin",
        )
    return code


def _handler(name: str, command: Any) -> tuple[Callable[..., Any], bool]:
    """The CLI handler running ``command.run`` and whether it is async."""
    if inspect.iscoroutinefunction(command.run):

        async def run_async(args: argparse.Namespace, interrupts: Interrupts) -> int:
            return _exit_code(name, await command.run(args))

        return run_async, True

    def run(args: argparse.Namespace) -> int:
        return _exit_code(name, command.run(args))

    return run, False


def register(
    sub: argparse._SubParsersAction[Any],
    common: argparse.ArgumentParser,
    found: Mapping[str, EntryPoint],
    load: str | None,
) -> None:
    """Adds the plugin commands; only ``load`` (the command being run) is imported."""
    for name, ep in found.items():
        summary = f"(plugin {ep.value})"
        if name != load:
            sub.add_parser(name, help=summary, add_help=False)
            continue
        try:
            command = _load(ep)
        except Exception as e:
            message = (
                f"plugin command {name!r} ({ep.value}, group {ENTRY_POINT_GROUP!r}) does not "
                f"load: {type(e).__name__}: {e}"
            )
            p = sub.add_parser(name, help=summary, prefix_chars="\0")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(handler=_failing(message), is_async=False, command=name)
            continue
        doc = inspect.getdoc(command) or ""
        p = sub.add_parser(name, help=summary, description=doc or None)
        command.add_arguments(p)
        for action in common._actions:
            if not any(o in p._option_string_actions for o in action.option_strings):
                p._add_action(action)
        handler, is_async = _handler(name, command)
        p.set_defaults(handler=handler, is_async=is_async, command=name)
