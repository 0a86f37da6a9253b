"""``asynctorchx builtins [--print NAME]``: the components ``run`` knows by name."""

from __future__ import annotations

import argparse
from typing import Any

from asynctorchx.cli._help import HelpFormatter


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``builtins`` command."""
    p = sub.add_parser(
        "builtins",
        parents=[common],
        formatter_class=HelpFormatter,
        help="list the builtin and plugin components",
        description="Lists the components 'asynctorchx run' finds by name (builtins and plugins "
        "of the 'asynctorchx.components' entry-point group). A component in a file is run as "
        "path/to/file.py:function.",
    )
    p.add_argument(
        "--print",
        dest="print_name",
        metavar="NAME",
        default=None,
        help="print the source code of the module defining this component, imports and helpers "
        "included, as TorchX does: saved as a file, it runs as FILE:FUNCTION (to copy and adapt)",
    )
    p.set_defaults(handler=execute, is_async=False, command="builtins")


def execute(args: argparse.Namespace) -> int:
    """Lists the components, or prints one's source."""
    from asynctorchx.cli._output import BOLD, format_table, info, out_styler
    from asynctorchx.components import get_component, get_components

    if args.print_name:
        import inspect

        component = get_component(args.print_name)
        # the function alone does not run once saved: it needs its module's imports and helpers
        module = inspect.getmodule(component.fn)
        try:
            source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            source = ""
        print(source or inspect.getsource(component.fn), end="")
        return 0
    components = get_components()
    info(f"found {len(components)} components")
    style = out_styler()
    rows = [(name, c.description) for name, c in sorted(components.items())]
    table = format_table(("NAME", "DESCRIPTION"), rows, style)
    lines = table.splitlines()
    if style.enabled:
        lines = [lines[0]] + [
            style(name, BOLD) + line[len(name) :]
            for (name, _), line in zip(rows, lines[1:], strict=True)
        ]
    print("\n".join(lines))
    return 0
