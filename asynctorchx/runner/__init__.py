"""The AsyncRunner and its StatusHub."""

from asynctorchx.runner.api import AppEvent as AppEvent
from asynctorchx.runner.api import AsyncRunner as AsyncRunner
from asynctorchx.runner.api import get_runner as get_runner
from asynctorchx.runner.hub import PollSettings as PollSettings
from asynctorchx.runner.hub import StatusHub as StatusHub
