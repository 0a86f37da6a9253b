"""The AsyncRunner and its StatusHub."""

from asynctorchx.logs import LogEntry as LogEntry
from asynctorchx.runner._launch import GangFailedError as GangFailedError
from asynctorchx.runner._launch import LaunchGroup as LaunchGroup
from asynctorchx.runner.api import AppEvent as AppEvent
from asynctorchx.runner.api import AsyncRunner as AsyncRunner
from asynctorchx.runner.api import get_runner as get_runner
from asynctorchx.runner.hub import PollSettings as PollSettings
from asynctorchx.runner.hub import StatusHub as StatusHub
from asynctorchx.runner.limits import LaunchEvent as LaunchEvent
from asynctorchx.runner.limits import LaunchPhase as LaunchPhase
from asynctorchx.runner.limits import Limits as Limits
