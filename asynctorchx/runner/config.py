"""``.torchxconfig``: per-project and per-user defaults, in TorchX's INI format.

Sections::

    [local_cwd]                 # a scheduler's run options (``asynctorchx runopts local_cwd``)
    log_dir = /tmp/logs

    [component:dist.ddp]        # default arguments of a component
    j = 2x2
    env = LOGLEVEL=INFO

    [cli:run]                   # default options of a CLI command
    scheduler = local_cwd

    [torchx:tracker]            # the trackers of every job: NAME = factory (empty: NAME itself)
    fsspec =

    [tracker:fsspec]            # a tracker's config string, passed to its factory in the job
    config = /shared/tracker.conf

    [limits:slurm]              # launch limits of a backend (``asynctorchx.runner.limits``)
    max_concurrent_submits = 8
    max_calls_per_second = 5

Where the files are read from, highest precedence first:

1. the file named by the ``TORCHXCONFIG`` environment variable, alone (an empty value reads none);
2. otherwise ``./.torchxconfig`` (the project), then ``$HOME/.torchxconfig`` (the user): a key set in
   both takes the project's value. (TorchX gives the user's file precedence; here the project wins.)

Functions that take ``dirs`` read ``DIR/.torchxconfig`` for each directory instead, the first
directory taking precedence. Overall precedence is explicit argument > config file > default:
``apply`` only fills the run options a cfg does not set, and component defaults only fill the
arguments not given on the command line.

The file is read as TorchX reads it (``configparser.ConfigParser()``): ``%%`` is a literal ``%``,
``%(key)s`` is replaced by the value of ``key`` in the same section or in ``[DEFAULT]``, a lone
``%`` is an error naming the file and the key; ``[DEFAULT]``'s keys are also keys of every scheduler
section and every ``[component:NAME]`` (in the other prefixed sections they only serve ``%(key)s``);
one that is not a run option of a scheduler is ignored there without a warning.

Values are strings cast by the run option's type exactly like ``-cfg`` values (``true``/``false``,
``a;b`` lists, ``k:v;k2:v2`` dicts); ``None`` unsets a run option. Keys are case-sensitive. A key
that is not a run option of its scheduler, or a section nobody reads, is reported with a
``ConfigWarning`` (a ``UserWarning``) and otherwise ignored.
"""

from __future__ import annotations

import configparser
import difflib
import logging
import os
import re
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, TextIO

from asynctorchx.specs.api import (
    CfgVal,
    InvalidRunConfigException,
    UnknownSchedulerException,
    _cast,
    _is_dict_str,
    _is_list_str,
    _type_name,
    runopts,
)
from asynctorchx.specs.errors import ConfigWarning
from asynctorchx.tracker.api import (
    ENV_TORCHX_TRACKERS,
    TrackerSetting,
    tracker_config_env_var_name,
    tracker_names_from_environ,
)

logger = logging.getLogger(__name__)

CONFIG_FILE = ".torchxconfig"
ENV_TORCHXCONFIG = "TORCHXCONFIG"
CONFIG_PREFIX_DELIM = ":"
NONE_VALUE = "None"
KNOWN_PREFIXES = ("component", "cli", "torchx", "tracker", "limits")
TRACKER_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class ConfigFileError(ValueError):
    """Raised when a config file is not valid INI (a duplicate key, a line outside a section...)."""


class MissingConfigFile(FileNotFoundError):
    """Raised when ``TORCHXCONFIG`` names a file that does not exist (or is not a file)."""


class _ConfigParser(configparser.ConfigParser):
    """TorchX's reading of ``.torchxconfig``: ``configparser.ConfigParser()`` defaults (``%``
    interpolation, a ``[DEFAULT]`` section), keys kept in their case (run options are
    case-sensitive)."""

    def optionxform(self, optionstr: str) -> str:
        """Keys as written: ``configparser`` would lowercase them (TorchX overrides it too)."""
        return optionstr

    def own_items(self, section: str) -> list[tuple[str, str]]:
        """The (interpolated) items written in ``section`` itself, without ``[DEFAULT]``'s."""
        return [(key, self.get(section, key)) for key in self._sections.get(section, {})]  # type: ignore[attr-defined]


def _parser() -> _ConfigParser:
    return _ConfigParser()


#: The prefixed sections that get ``[DEFAULT]``'s keys as TorchX's do (the scheduler sections get
#: them too): in the others (``[cli:run]``, ``[torchx:tracker]``, ``[tracker:NAME]``,
#: ``[limits:NAME]``) each ``[DEFAULT]`` key would be an unknown option, a tracker or an error, so
#: there ``[DEFAULT]`` only serves ``%(key)s`` references.
_INHERITING_PREFIXES = ("component",)


def _section_items(parser: _ConfigParser, section: str) -> list[tuple[str, str]]:
    """The items of ``section``; ``[DEFAULT]``'s keys included where TorchX's reading gives them."""
    prefix, delim, _ = section.partition(CONFIG_PREFIX_DELIM)
    if not delim or prefix in _INHERITING_PREFIXES:
        return parser.items(section)
    return parser.own_items(section)


def _interpolation_problem(e: configparser.InterpolationError) -> str:
    """What is wrong with a value that does not interpolate, in words."""
    if isinstance(e, configparser.InterpolationMissingOptionError):
        return f"'%({e.reference})s' names no key of [{e.section}] nor of [DEFAULT]"
    if isinstance(e, configparser.InterpolationDepthError):
        return "its %(key)s references nest too deep (do they refer to each other?)"
    return (
        "a '%' must be written '%%' (a literal %) or start a reference to another key, "
        "'%(key)s' (values are interpolated, as TorchX reads them)"
    )


def _check_interpolation(parser: _ConfigParser, name: str) -> None:
    """Interpolates every value once, so that a bad one is an error naming the file and the key
    when the file is read, not a traceback wherever the value is first used.

    Raises:
        ConfigFileError: a value holds a lone ``%`` or a reference that does not resolve.
    """
    for section in parser.sections():
        for key in parser.options(section):
            try:
                parser.get(section, key)
            except configparser.InterpolationError as e:
                raw = parser.get(section, key, raw=True)
                raise ConfigFileError(
                    f"invalid config file {name!r}: [{section}] {key} = {raw}: "
                    f"{_interpolation_problem(e)}"
                ) from None


def default_config_dirs() -> list[Path]:
    """The directories searched when no ``dirs`` are given, highest precedence first: CWD, HOME."""
    return [Path.cwd(), Path.home()]


def find_configs(dirs: Iterable[str | os.PathLike[str]] | None = None) -> list[Path]:
    """The config files to read, highest precedence first.

    Args:
        dirs: directories holding a ``.torchxconfig`` (default: ``default_config_dirs()``);
            ignored when ``TORCHXCONFIG`` is set.

    Raises:
        FileNotFoundError: ``TORCHXCONFIG`` names a file that does not exist.
    """
    env_value = os.environ.get(ENV_TORCHXCONFIG)
    if env_value is not None:
        if not env_value:
            return []
        path = Path(env_value).expanduser()
        if not path.is_file():
            raise MissingConfigFile(
                f"{ENV_TORCHXCONFIG}={env_value!r} does not exist or is not a file"
            )
        return [path]
    found: list[Path] = []
    seen: set[Path] = set()
    for d in default_config_dirs() if dirs is None else [Path(d) for d in dirs]:
        path = Path(d).expanduser() / CONFIG_FILE
        try:
            key = path.resolve()
        except (OSError, RuntimeError):  # a symbolic link loop: not a file, skipped below
            key = path
        if key in seen:
            continue
        seen.add(key)
        if path.is_file() and os.access(path, os.R_OK):
            found.append(path)
    return found


def read_config(source: str | os.PathLike[str] | TextIO) -> _ConfigParser:
    """Parses one config file (a path or an open text file), as TorchX does: ``%%`` is ``%``,
    ``%(key)s`` is the value of ``key`` (of the same section or ``[DEFAULT]``), keys keep their
    case.

    Raises:
        ConfigFileError: the file is not valid INI, or not UTF-8, or a value does not interpolate
            (a lone ``%``, a ``%(key)s`` naming no key); the message names the file and the line
            or the key.
    """
    parser = _parser()
    try:
        if isinstance(source, (str, os.PathLike)):
            with open(source, encoding="utf-8") as f:
                parser.read_file(f, source=str(source))
        else:
            parser.read_file(source)
    except configparser.Error as e:
        raise ConfigFileError(f"invalid config file: {e}") from None
    except UnicodeDecodeError as e:
        if not isinstance(source, (str, os.PathLike)):
            name = getattr(source, "name", "<config>")
            raise ConfigFileError(f"invalid config file {name!r}: not UTF-8 ({e})") from None
        raise ConfigFileError(f"invalid config file: {_not_utf8(source)}") from None
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
    else:
        name = str(getattr(source, "name", "<config>"))
    _check_interpolation(parser, name)
    return parser


def _not_utf8(path: str | os.PathLike[str]) -> str:
    """Where the file ``path`` stops being UTF-8 (its name, line and the byte)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return (
            f"{os.fspath(path)!r} line {line} is not UTF-8 (byte {data[e.start : e.start + 1]!r})"
        )
    return f"{os.fspath(path)!r} is not UTF-8"


def _scheduler_run_opts(scheduler: str) -> runopts:
    from asynctorchx.schedulers import create_scheduler

    return create_scheduler(scheduler, "asynctorchx-config").run_opts()


def _known_schedulers() -> list[str]:
    from asynctorchx.schedulers import scheduler_names

    return scheduler_names()


def _warn(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=3)


def _cast_value(key: str, value: str, opts: runopts, section: str, source: str) -> CfgVal:
    opt = opts.get(key)
    if opt is None or value == NONE_VALUE:
        return None
    if value.startswith(FIXME):
        raise InvalidRunConfigException(
            f"{source} [{section}]: run option {key!r} is still the placeholder {value!r} written "
            "by 'asynctorchx configure': give it a value",
            key,
            {key: value},
        )
    try:
        return _cast(key, value, opt.opt_type, value)
    except InvalidRunConfigException:
        raise InvalidRunConfigException(
            f"{source} [{section}]: run option {key!r} must be of type "
            f"{_type_name(opt.opt_type)}, got {value!r}",
            key,
            {key: value},
        ) from None


def load(
    scheduler: str,
    source: str | os.PathLike[str] | TextIO,
    cfg: MutableMapping[str, CfgVal],
    run_opts: runopts | None = None,
) -> MutableMapping[str, CfgVal]:
    """Fills ``cfg`` with the ``[scheduler]`` run options of one file, keeping the keys it has.

    Args:
        scheduler: the section to read.
        source: the file (a path or an open text file).
        cfg: the run options so far; it is updated in place and returned.
        run_opts: the scheduler's run options (default: asked of the scheduler).

    Raises:
        ConfigFileError: the file is not valid INI.
        InvalidRunConfigException: a value does not cast to its run option's type (names the
            file, section, key and expected type).
    """
    parser = read_config(source)
    if not parser.has_section(scheduler):
        return cfg
    opts = _scheduler_run_opts(scheduler) if run_opts is None else run_opts
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
    else:
        name = str(getattr(source, "name", "<config>"))
    known = [k for k, _ in opts]
    own = {k for k, _ in parser.own_items(scheduler)}
    for key, value in parser.items(scheduler):
        if opts.get(key) is None and key not in own:
            continue  # a [DEFAULT] key serves several sections (or %(key)s): not a typo here
        if opts.get(key) is None:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            _warn(
                f"{name}: [{scheduler}] {key} = {value} is not a run option of scheduler "
                f"{scheduler!r} and is ignored{hint}; its run options: {', '.join(known) or 'none'}"
            )
            continue
        if key in cfg:
            continue
        cfg[key] = _cast_value(key, value, opts, scheduler, name)
    return cfg


def _check_sections(paths: Iterable[Path]) -> None:
    schedulers: list[str] | None = None
    for path in paths:
        for section in read_config(path).sections():
            prefix, delim, rest = section.partition(CONFIG_PREFIX_DELIM)
            if delim:
                if (
                    prefix not in KNOWN_PREFIXES
                    or not rest
                    or (section.startswith("torchx:") and rest != "tracker")
                ):
                    _warn(
                        f"{path}: section [{section}] is ignored: a prefixed section is "
                        f"[component:NAME], [cli:COMMAND], [torchx:tracker], [tracker:NAME] "
                        f"or [limits:SCHEDULER]"
                    )
                continue
            if schedulers is None:
                schedulers = _known_schedulers()
            if section not in schedulers:
                close = difflib.get_close_matches(section, schedulers, n=1)
                hint = f" (did you mean [{close[0]}]?)" if close else ""
                _warn(
                    f"{path}: section [{section}] is not a scheduler and is ignored{hint}; "
                    f"schedulers: {', '.join(schedulers)}"
                )


def apply(
    scheduler: str,
    cfg: MutableMapping[str, CfgVal],
    dirs: Iterable[str | os.PathLike[str]] | None = None,
    run_opts: runopts | None = None,
) -> MutableMapping[str, CfgVal]:
    """Fills ``cfg`` with the ``[scheduler]`` run options of the config files.

    Keys already in ``cfg`` are kept (explicit beats config); between files, the one of higher
    precedence wins (see ``find_configs``). Defaults are not filled in: ``runopts.resolve`` does.

    Args:
        scheduler: the scheduler whose section is read.
        cfg: the explicit run options; updated in place and returned.
        dirs: directories to read ``.torchxconfig`` from, first wins (default: CWD, then HOME).
        run_opts: the scheduler's run options (default: asked of the scheduler).

    Raises:
        UnknownSchedulerException: ``scheduler`` is not registered (when ``run_opts`` is not given).
        ConfigFileError: a file is not valid INI.
        InvalidRunConfigException: a value does not cast to its run option's type.
    """
    paths = find_configs(dirs)
    if not paths:
        return cfg
    opts = run_opts
    if opts is None:
        if scheduler not in _known_schedulers():
            raise UnknownSchedulerException(scheduler, _known_schedulers())
        opts = _scheduler_run_opts(scheduler)
    _check_sections(paths)
    for path in paths:
        load(scheduler, path, cfg, opts)
        logger.debug("applied [%s] of %s", scheduler, path)
    return cfg


def _strip_prefix(section: str, prefix: str) -> str | None:
    head, delim, rest = section.partition(CONFIG_PREFIX_DELIM)
    if delim and head == prefix and rest:
        return rest
    return None


def load_sections(
    prefix: str, dirs: Iterable[str | os.PathLike[str]] | None = None
) -> dict[str, dict[str, str]]:
    """The ``[prefix:NAME]`` sections of the config files, by ``NAME``, values as strings.

    E.g. ``load_sections("component")`` gives ``{"dist.ddp": {"j": "2x2"}}`` for a
    ``[component:dist.ddp]`` section. A key set in several files takes the value of the file
    of highest precedence.

    Raises:
        ConfigFileError: a file is not valid INI.
    """
    sections: dict[str, dict[str, str]] = {}
    for path in find_configs(dirs):
        parser = read_config(path)
        for section in parser.sections():
            name = _strip_prefix(section, prefix)
            if name is None:
                continue
            values = sections.setdefault(name, {})
            for key, value in _section_items(parser, section):
                values.setdefault(key, value)
    return sections


def get_configs(
    prefix: str, name: str, dirs: Iterable[str | os.PathLike[str]] | None = None
) -> dict[str, str]:
    """The contents of section ``[prefix:name]`` (empty when there is none)."""
    return load_sections(prefix, dirs).get(name, {})


def get_config(
    prefix: str, name: str, key: str, dirs: Iterable[str | os.PathLike[str]] | None = None
) -> str | None:
    """The value of ``key`` in section ``[prefix:name]``, or None."""
    return get_configs(prefix, name, dirs).get(key)


def _format_default(opt_type: Any, default: CfgVal) -> str:
    if default is None:
        return NONE_VALUE
    if _is_list_str(opt_type) and isinstance(default, list):
        return ";".join(default) if default else NONE_VALUE
    if _is_dict_str(opt_type) and isinstance(default, dict):
        return ";".join(f"{k}:{v}" for k, v in default.items()) if default else NONE_VALUE
    return str(default)


FIXME = "#FIXME"
_FIXME_MAX_LEN = 60


def fixme_placeholder(opt_type: Any, help: str) -> str:
    """The value ``dump`` gives a required run option, as TorchX writes it: ``#FIXME:(str) help``.

    Cut after 60 characters (with ``...``), as TorchX does.
    """
    text = f"{FIXME}:({_type_name(opt_type)}) {help}"
    return text if len(text) <= _FIXME_MAX_LEN else f"{text[:_FIXME_MAX_LEN]}..."


def dump(
    f: TextIO,
    schedulers: Iterable[str] | None = None,
    required_only: bool = False,
    run_opts: dict[str, runopts] | None = None,
) -> None:
    """Writes a config template with each scheduler's run options and their defaults.

    Required options get a ``#FIXME:(type) help`` placeholder, optional ones (unless
    ``required_only``) their default; the format is TorchX's ``torchx configure``'s.

    Args:
        f: where to write.
        schedulers: which schedulers (default: every registered one whose module loads).
        required_only: only write the required options.
        run_opts: the run options by scheduler (default: asked of each scheduler).
    """
    parser = _parser()
    for name in _known_schedulers() if schedulers is None else schedulers:
        if run_opts is not None and name in run_opts:
            opts = run_opts[name]
        else:
            try:
                opts = _scheduler_run_opts(name)
            except ImportError as e:
                logger.warning("skipping scheduler %r: its module does not load: %s", name, e)
                continue
        parser.add_section(name)
        for key, opt in opts:
            # ``%%``: the file is read with interpolation, where a lone % is an error
            if opt.is_required:
                parser.set(name, key, fixme_placeholder(opt.opt_type, opt.help).replace("%", "%%"))
            elif not required_only:
                parser.set(name, key, _format_default(opt.opt_type, opt.default).replace("%", "%%"))
    parser.write(f, space_around_delimiters=True)


def configured_trackers(
    dirs: Iterable[str | os.PathLike[str]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[TrackerSetting]:
    """The trackers of ``[torchx:tracker]``, each with the ``config`` of its ``[tracker:NAME]``.

    As TorchX's launcher: ``$TORCHX_TRACKERS`` (comma-separated names), when set, replaces the names
    of the files, and ``$TORCHX_TRACKER_<NAME>_CONFIG`` replaces a tracker's ``config``. The value of
    a name in ``[torchx:tracker]`` is the factory the job resolves instead of the name (an entry
    point or ``module:factory``); empty or equal to the name, the name itself is resolved.

    Raises:
        ConfigFileError: a file is not valid INI, or a tracker name cannot be an environment
            variable's part (letters, digits, ``_``, ``.``, ``-`` only).
    """
    env = os.environ if environ is None else environ
    names: dict[str, str] = {}
    configs: dict[str, str] = {}
    for path in find_configs(dirs):
        parser = read_config(path)
        for section in parser.sections():
            prefix, _, rest = section.partition(CONFIG_PREFIX_DELIM)
            if section == "torchx:tracker":
                for key, value in _section_items(parser, section):
                    if not TRACKER_NAME.fullmatch(key):
                        raise ConfigFileError(
                            f"{path}: [torchx:tracker] {key!r} is not a valid tracker name "
                            "(letters, digits, '_', '.' and '-' only)"
                        )
                    names.setdefault(key, value.strip())
            elif prefix == "tracker" and rest:
                for key, value in _section_items(parser, section):
                    if key != "config":
                        _warn(
                            f"{path}: [{section}] {key} = {value} is ignored: a tracker section has "
                            "only 'config'"
                        )
                        continue
                    configs.setdefault(rest, value.strip())
    if ENV_TORCHX_TRACKERS in env:
        order = tracker_names_from_environ(env)
        logger.info("tracker names from %s: %s", ENV_TORCHX_TRACKERS, order)
    else:
        order = list(names)
    unused = sorted(set(configs) - set(order))
    if unused:
        _warn(
            f"[tracker:{unused[0]}] is ignored: {unused[0]!r} is not a tracker of "
            f"[torchx:tracker] ({', '.join(order) or 'none configured'})"
        )
    settings = []
    for name in order:
        config = env.get(tracker_config_env_var_name(name)) or configs.get(name) or None
        factory = names.get(name) or None
        settings.append(TrackerSetting(name, config, None if factory == name else factory))
    return settings


def get_configured_trackers(
    dirs: Iterable[str | os.PathLike[str]] | None = None,
) -> dict[str, str | None]:
    """``{tracker name: config}`` of the config files and environment (TorchX's function)."""
    return {t.name: t.config for t in configured_trackers(dirs)}
