"""The ``asynctorchx`` command line: a thin layer over ``AsyncRunner``.

``main.py`` builds the argument parser and runs one command in one ``asyncio.run``; each command lives
in its own ``cmd_*.py`` module. Everything heavy (the runner, backends, components) is imported only
by the command that needs it, so ``asynctorchx --help`` starts in the time Python itself takes.
"""
