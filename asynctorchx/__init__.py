"""asynctorchx: an asyncio-native job launcher for distributed PyTorch applications.

``import asynctorchx`` stays cheap: the runner (and through it the schedulers) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asynctorchx.version import IMAGE as IMAGE
from asynctorchx.version import __version__ as __version__

if TYPE_CHECKING:
    from asynctorchx.runner import AppEvent as AppEvent
    from asynctorchx.runner import AsyncRunner as AsyncRunner
    from asynctorchx.runner import get_runner as get_runner

__all__ = ["IMAGE", "AppEvent", "AsyncRunner", "__version__", "get_runner"]


def __getattr__(name: str) -> Any:
    if name in ("AsyncRunner", "get_runner", "AppEvent"):
        from asynctorchx import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'asynctorchx' has no attribute {name!r}")
