"""Component functions (each returns an ``AppDef``) and how they are found by name.

Builtins: ``utils.echo``, ``utils.touch``, ``utils.sh``, ``utils.python``, ``utils.binary``,
``utils.copy``, ``dist.ddp`` and ``dist.spmd``. Plugins register more through the entry-point
group ``asynctorchx.components``; any file's function is reachable as ``path/to/file.py:fn``.
Importing this package does not import the component modules.
"""

from asynctorchx.components._finder import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from asynctorchx.components._finder import Component as Component
from asynctorchx.components._finder import builtin_module_names as builtin_module_names
from asynctorchx.components._finder import clear_cache as clear_cache
from asynctorchx.components._finder import get_component as get_component
from asynctorchx.components._finder import get_components as get_components
from asynctorchx.specs.errors import ComponentNotFoundException as ComponentNotFoundException
from asynctorchx.specs.errors import ComponentValidationException as ComponentValidationException

IMAGE = "ghcr.io/pytorch/torchx:0.7.0"
"""The default container image of the builtin components (backends that run containers use it;
``local_cwd`` runs in the current directory instead). Override it with ``--image``."""
