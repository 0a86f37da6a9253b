"""``python -m asynctorchx``: the same as the ``asynctorchx`` command."""

import sys

from asynctorchx.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
