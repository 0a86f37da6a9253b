"""``asynctorchx configure``: write a ``.torchxconfig`` template of the schedulers' run options.

As TorchX's ``torchx configure``: ``-s/--schedulers`` (comma-separated; default every scheduler),
``-a/--all`` (optional run options too, with their defaults; default only the required ones, as
``#FIXME:(type) help`` placeholders), ``--print`` (to stdout instead of the file). Unlike TorchX it
does not overwrite an existing ``.torchxconfig`` unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
from typing import Any

from asynctorchx.cli._help import HelpFormatter

NAME = "configure"


def register(sub: argparse._SubParsersAction[Any], common: argparse.ArgumentParser) -> None:
    """Adds the ``configure`` command."""
    p = sub.add_parser(
        NAME,
        parents=[common],
        formatter_class=HelpFormatter,
        help="write a .torchxconfig template of the schedulers' run options",
        description="Writes ./.torchxconfig with a [SCHEDULER] section per scheduler: its "
        "required run options as '#FIXME:(type) help' placeholders to fill in, and with --all its "
        "optional ones with their defaults. An existing file is kept unless --force is given.",
        epilog="examples:\n"
        "  asynctorchx configure -s slurm,kubernetes --all\n"
        "  asynctorchx configure --print -s local_cwd -a",
    )
    p.add_argument(
        "-s",
        "--schedulers",
        default=None,
        metavar="NAME,...",
        help="comma-separated schedulers (default: every scheduler)",
    )
    p.add_argument(
        "--print",
        action="store_true",
        help="print the template on stdout instead of writing .torchxconfig",
    )
    p.add_argument(
        "-a",
        "--all",
        action="store_true",
        help="include the optional run options with their defaults (default: required ones only)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing .torchxconfig")
    p.set_defaults(handler=execute, is_async=False, command=NAME)


def execute(args: argparse.Namespace) -> int:
    """Writes (or prints) the template."""
    import io
    import os
    import sys

    from asynctorchx.cli._errors import CliError
    from asynctorchx.cli._output import info
    from asynctorchx.runner.config import CONFIG_FILE, dump
    from asynctorchx.schedulers import scheduler_names
    from asynctorchx.specs.api import UnknownSchedulerException

    known = scheduler_names()
    names = known
    if args.schedulers is not None:
        names = [n.strip() for n in args.schedulers.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise UnknownSchedulerException(", ".join(unknown) or repr(args.schedulers), known)
    text = io.StringIO()
    dump(text, names, required_only=not args.all)
    if args.print:
        sys.stdout.write(text.getvalue())
        return 0
    exists = CliError(
        f"{os.path.abspath(CONFIG_FILE)} exists and is left as it is",
        "pass --force to overwrite it, or --print to see the template",
    )
    if os.path.lexists(CONFIG_FILE) and not args.force:
        raise exists
    tmp = f"{CONFIG_FILE}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text.getvalue())
        if args.force:
            os.replace(tmp, CONFIG_FILE)
        else:
            try:
                os.link(tmp, CONFIG_FILE)  # never clobbers a file made since the check
            except FileExistsError:
                raise exists from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    info(f"wrote {os.path.abspath(CONFIG_FILE)} ({', '.join(names)})")
    return 0
