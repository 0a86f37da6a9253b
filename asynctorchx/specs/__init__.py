"""The application data model (pure, synchronous): AppDef, Role, Resource, states, runopts, handles."""

from typing import TYPE_CHECKING, Any

from asynctorchx.specs.api import ALL as ALL
from asynctorchx.specs.api import MISSING as MISSING
from asynctorchx.specs.api import NONE as NONE
from asynctorchx.specs.api import NULL_RESOURCE as NULL_RESOURCE
from asynctorchx.specs.api import AppDef as AppDef
from asynctorchx.specs.api import AppDryRunInfo as AppDryRunInfo
from asynctorchx.specs.api import AppHandle as AppHandle
from asynctorchx.specs.api import AppState as AppState
from asynctorchx.specs.api import AppStatus as AppStatus
from asynctorchx.specs.api import AppStatusError as AppStatusError
from asynctorchx.specs.api import BindMount as BindMount
from asynctorchx.specs.api import CfgVal as CfgVal
from asynctorchx.specs.api import DeviceMount as DeviceMount
from asynctorchx.specs.api import InvalidAppDefException as InvalidAppDefException
from asynctorchx.specs.api import InvalidRunConfigException as InvalidRunConfigException
from asynctorchx.specs.api import MalformedAppHandleException as MalformedAppHandleException
from asynctorchx.specs.api import Mount as Mount
from asynctorchx.specs.api import MountOptionError as MountOptionError
from asynctorchx.specs.api import MountType as MountType
from asynctorchx.specs.api import ParsedAppHandle as ParsedAppHandle
from asynctorchx.specs.api import ReplicaState as ReplicaState
from asynctorchx.specs.api import ReplicaStatus as ReplicaStatus
from asynctorchx.specs.api import Resource as Resource
from asynctorchx.specs.api import RetryPolicy as RetryPolicy
from asynctorchx.specs.api import Role as Role
from asynctorchx.specs.api import RoleStatus as RoleStatus
from asynctorchx.specs.api import RunConfigParseError as RunConfigParseError
from asynctorchx.specs.api import SchedulerBackend as SchedulerBackend
from asynctorchx.specs.api import UnknownAppException as UnknownAppException
from asynctorchx.specs.api import UnknownSchedulerException as UnknownSchedulerException
from asynctorchx.specs.api import VolumeMount as VolumeMount
from asynctorchx.specs.api import get_type_name as get_type_name
from asynctorchx.specs.api import is_started as is_started
from asynctorchx.specs.api import is_terminal as is_terminal
from asynctorchx.specs.api import macros as macros
from asynctorchx.specs.api import make_app_handle as make_app_handle
from asynctorchx.specs.api import make_unique as make_unique
from asynctorchx.specs.api import parse_app_handle as parse_app_handle
from asynctorchx.specs.api import parse_mounts as parse_mounts
from asynctorchx.specs.api import replace_role as replace_role
from asynctorchx.specs.api import runopt as runopt
from asynctorchx.specs.api import runopts as runopts
from asynctorchx.specs.api import validate_app as validate_app
from asynctorchx.specs.errors import ComponentNotFoundException as ComponentNotFoundException
from asynctorchx.specs.errors import ComponentValidationException as ComponentValidationException
from asynctorchx.specs.errors import ConfigWarning as ConfigWarning
from asynctorchx.specs.errors import InvalidComponentArgsException as InvalidComponentArgsException
from asynctorchx.specs.named_resources import NAMED_RESOURCES as NAMED_RESOURCES
from asynctorchx.specs.named_resources import GiB as GiB
from asynctorchx.specs.named_resources import (
    UnknownNamedResourceException as UnknownNamedResourceException,
)
from asynctorchx.specs.named_resources import get_named_resource as get_named_resource
from asynctorchx.specs.named_resources import get_named_resources as get_named_resources
from asynctorchx.specs.named_resources import named_resource_names as named_resource_names
from asynctorchx.specs.named_resources import resource as resource
from asynctorchx.specs.workspace import InvalidWorkspaceException as InvalidWorkspaceException
from asynctorchx.specs.workspace import Workspace as Workspace

named_resources = NAMED_RESOURCES


if TYPE_CHECKING:
    from asynctorchx.specs.builders import materialize_appdef as materialize_appdef


def __getattr__(name: str) -> Any:
    # the component builders (argparse, ast) load on first use, keeping ``import asynctorchx`` cheap
    if name == "materialize_appdef":
        from asynctorchx.specs import builders

        return builders.materialize_appdef
    raise AttributeError(f"module 'asynctorchx.specs' has no attribute {name!r}")
