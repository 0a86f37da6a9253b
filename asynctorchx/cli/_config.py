"""The CLI's view of ``.torchxconfig``: ``[cli:run]`` defaults and scheduler cfg sections."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asynctorchx.specs.api import CfgVal, runopts


#: The keys of ``[cli:run]`` that ``run`` reads.
RUN_KEYS = ("scheduler", "component", "workspace")


def run_defaults() -> dict[str, str]:
    """The ``[cli:run]`` section (``scheduler``, ``component``, ``workspace``), or an empty dict.

    Any other key (a typo such as ``worksapce``) is warned about (a ``ConfigWarning``), as unknown
    keys of the other sections are, and ignored.
    """
    import difflib
    import warnings

    from asynctorchx.runner.config import get_configs
    from asynctorchx.specs.errors import ConfigWarning

    values = get_configs("cli", "run")
    for key, value in values.items():
        if key not in RUN_KEYS:
            close = difflib.get_close_matches(key, RUN_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.warn(
                f".torchxconfig: [cli:run] {key} = {value} is not an option of run and is "
                f"ignored{hint}; its options: {', '.join(RUN_KEYS)}",
                ConfigWarning,
                stacklevel=1,  # one place: shown once, however many times the section is read
            )
    return {k: v for k, v in values.items() if k in RUN_KEYS}


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
