"""The service tests' shared fixtures (the live servers themselves: `server` and `tiny_live` in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def name(server):
    """The default model's name as the live server serves it (what clients pass as `model`)."""
    return server.app.state.server.model_name
