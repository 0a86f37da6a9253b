"""Shared pytest configuration: test modules import helpers from this folder (``_fake_scheduler``...).

The suite runs on several workers (``pytest-xdist``, ``--dist loadgroup``: see ``scripts/test.sh``).
A module's tests stay on one worker, and the modules that use a real engine (Docker, Slurm) all share
one: their tests check an engine's state as a whole (no image or container left behind, the queue
drained) and must not see another module's work meanwhile; a few modules use both engines.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ENGINES = os.environ.get("ASYNCTORCHX_REQUIRE_ENGINES") == "1"

#: the helper modules whose fixtures mean "this test uses that engine"
ENGINE_OF_HELPER = {"_docker_env": "docker", "_slurm_env": "slurm"}


def engine_missing(what: str) -> None:
    """Fails the test in CI (ASYNCTORCHX_REQUIRE_ENGINES=1) or skips it elsewhere: ``what`` is missing."""
    if REQUIRE_ENGINES:
        pytest.fail(f"{what} is required (ASYNCTORCHX_REQUIRE_ENGINES=1) but missing")
    pytest.skip(f"{what} is not available here")


def _engine_of(item: pytest.Item) -> str | None:
    for engine in ENGINE_OF_HELPER.values():
        if item.get_closest_marker(engine) is not None:
            return engine
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for definition in defs:
            engine = ENGINE_OF_HELPER.get(getattr(definition.func, "__module__", ""))
            if engine is not None:
                return engine
    module = getattr(item, "module", None)
    for helper, engine in ENGINE_OF_HELPER.items():
        if module is not None and any(
            getattr(value, "__module__", None) == helper for value in vars(module).values()
        ):
            return engine
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's ``xdist_group``: ``engines`` when its module uses one, else its module's path."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    with_engine = {item.nodeid.split("::", 1)[0] for item in items if _engine_of(item) is not None}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group("engines" if path in with_engine else path))
