"""The errors of components: finding one, validating its file, parsing its arguments.

The other spec errors live in ``asynctorchx.specs.api``. Exception tree::

    Exception
     ├── ComponentNotFoundException (LookupError)      no component has that name
     ├── ComponentValidationException (ValueError)     a component fails the linter or cannot load
     └── InvalidComponentArgsException (ValueError)    the arguments do not parse (argparse-style)

    UserWarning
     └── ConfigWarning                                 a config key or section nobody reads
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asynctorchx.specs.file_linter import LinterMessage


class ComponentNotFoundException(LookupError):
    """Raised when no builtin, plugin or file component has the given name.

    The message suggests the closest known names.
    """

    def __init__(self, name: str, reason: str = "", suggestions: Sequence[str] = ()) -> None:
        self.name = name
        self.suggestions = list(suggestions)
        msg = f"unknown component {name!r}"
        if reason:
            msg += f": {reason}"
        if self.suggestions:
            msg += f"; did you mean {' or '.join(repr(s) for s in self.suggestions)}?"
        msg += " (`asynctorchx builtins` lists the available components)"
        super().__init__(msg)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ComponentValidationException(ValueError):
    """Raised when a component does not pass the linter or cannot be loaded.

    Attributes:
        component: the component's name (``module.fn`` or ``path.py:fn``).
        errors: the linter messages, each with its line number.
    """

    def __init__(
        self,
        component: str,
        errors: Sequence[LinterMessage] = (),
        reason: str = "",
    ) -> None:
        self.component = component
        self.errors = list(errors)
        lines = [f"component {component!r} is not valid" + (f": {reason}" if reason else "")]
        lines.extend(f"  {e}" for e in self.errors)
        super().__init__("\n".join(lines))


class InvalidComponentArgsException(ValueError):
    """Raised when a component's arguments do not parse; the message names the argument.

    Attributes:
        component: the component's name.
        usage: the argparse usage line of the component, for a CLI to print.
    """

    def __init__(self, component: str, message: str, usage: str = "") -> None:
        self.component = component
        self.usage = usage
        super().__init__(f"{component}: {message}")


class ConfigWarning(UserWarning):
    """Warned about a ``.torchxconfig`` key or section, or a component default, that nothing reads."""
