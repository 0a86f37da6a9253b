"""Component functions (each returns an ``AppDef``) and how they are found by name.

Builtins (TorchX 0.7's, with its arguments): ``utils.echo``, ``utils.touch``, ``utils.sh``,
``utils.python``, ``utils.binary``, ``utils.copy``, ``utils.booth``, ``dist.ddp``, ``dist.spmd``,
``serve.torchserve`` and ``metrics.tensorboard``. Plugins register more through the entry-point
groups ``asynctorchx.components`` and ``torchx.components``; any file's function is reachable as
``path/to/file.py:fn``. Importing this package does not import the component modules.
"""

from asynctorchx.components._finder import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from asynctorchx.components._finder import TORCHX_ENTRY_POINT_GROUP as TORCHX_ENTRY_POINT_GROUP
from asynctorchx.components._finder import Component as Component
from asynctorchx.components._finder import builtin_module_names as builtin_module_names
from asynctorchx.components._finder import clear_cache as clear_cache
from asynctorchx.components._finder import get_component as get_component
from asynctorchx.components._finder import get_components as get_components
from asynctorchx.specs.errors import ComponentNotFoundException as ComponentNotFoundException
from asynctorchx.specs.errors import ComponentValidationException as ComponentValidationException
from asynctorchx.version import IMAGE as IMAGE
