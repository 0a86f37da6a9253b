"""``asynctorchx runopts [SCHEDULER]``: the run options (``-cfg`` keys) of the schedulers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from asynctorchx.cli._help import HelpFormatter

if TYPE_CHECKING:
    from asynctorchx.cli._interrupt import Interrupts


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``runopts`` command."""
    p = sub.add_parser(
        "runopts",
        parents=[common],
        formatter_class=HelpFormatter,
        help="list the schedulers and their run options (-cfg keys)",
        description="Shows the run options each scheduler accepts; pass them to 'asynctorchx run' "
        "as -cfg key=value,... or put them in a [SCHEDULER] section of .torchxconfig.",
    )
    p.add_argument("scheduler", nargs="?", metavar="SCHEDULER", help="only this scheduler")
    p.set_defaults(handler=execute, is_async=True, command="runopts")


async def execute(args: argparse.Namespace, interrupts: Interrupts) -> int:
    """Prints the run options of one or every scheduler."""
    from asynctorchx.cli._common import runner_for_session
    from asynctorchx.cli._errors import one_line
    from asynctorchx.cli._output import BOLD, DIM, out_styler

    style = out_styler()
    async with runner_for_session(None) as runner:
        if args.scheduler:
            names = [args.scheduler]
            opts = {args.scheduler: repr(runner.scheduler_run_opts(args.scheduler))}
        else:
            names = runner.scheduler_backends()
            opts = {}
            for name in names:
                try:
                    opts[name] = repr(runner.scheduler_run_opts(name))
                except Exception as e:
                    opts[name] = style(f"    (unavailable here: {one_line(str(e))})", DIM)
    blocks = [f"{style(name, BOLD)}:\n{opts[name] or '    (no options)'}" for name in names]
    print("\n\n".join(blocks))
    return 0
