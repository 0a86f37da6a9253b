"""Shared pytest configuration: test modules import helpers from this folder (``_fake_scheduler``...)."""

from __future__ import annotations

import os

import pytest

REQUIRE_ENGINES = os.environ.get("ASYNCTORCHX_REQUIRE_ENGINES") == "1"


def engine_missing(what: str) -> None:
    """Fails the test in CI (ASYNCTORCHX_REQUIRE_ENGINES=1) or skips it elsewhere: ``what`` is missing."""
    if REQUIRE_ENGINES:
        pytest.fail(f"{what} is required (ASYNCTORCHX_REQUIRE_ENGINES=1) but missing")
    pytest.skip(f"{what} is not available here")
