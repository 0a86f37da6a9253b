"""Small programs that builtin components run inside their replicas (where TorchX runs ``torchx.apps``).

Each module is a standalone script that needs only the standard library (and ``fsspec`` for remote
URLs, when installed): the components pass its source to ``python -c``, so it runs in any image
with a Python 3.8+, whether or not asynctorchx is installed there. ``source(name)`` gives that text.
The modules are also importable (``main(argv)``), which is how their tests run them.
"""

from __future__ import annotations

from importlib import resources


def source(name: str) -> str:
    """The source of the app module ``name`` (``booth``, ``serve``, ``process_monitor``)."""
    return resources.files(__name__).joinpath(f"{name}.py").read_text(encoding="utf-8")
