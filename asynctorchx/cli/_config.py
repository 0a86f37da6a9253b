"""The CLI's view of ``.torchxconfig``: ``[cli:run]`` defaults and scheduler cfg sections."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asynctorchx.specs.api import CfgVal, runopts


def run_defaults() -> dict[str, str]:
    """The ``[cli:run]`` section (e.g. ``scheduler``, ``component``), or an empty dict."""
    from asynctorchx.runner.config import get_configs

    return get_configs("cli", "run")


def default_scheduler() -> str:
    """The scheduler used when ``-s`` is not given: ``[cli:run] scheduler``, else the registry's."""
    from asynctorchx.schedulers import get_default_scheduler_name

    return run_defaults().get("scheduler") or get_default_scheduler_name()


def apply_scheduler_defaults(
    scheduler: str, cfg: dict[str, CfgVal], run_opts: runopts
) -> dict[str, CfgVal]:
    """``cfg`` with the ``[SCHEDULER]`` section's values added for the keys it does not set.

    Raises:
        ConfigFileError: a config file is not valid INI.
        InvalidRunConfigException: a config value does not have its option's type.
    """
    from asynctorchx.runner.config import apply

    merged = dict(cfg)
    apply(scheduler, merged, run_opts=run_opts)
    return merged
