"""Fixtures shared by the tests (the machinery lives in ``tests.support.helpers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.helpers import Sidecar, serve, short_tmp

__all__ = ["serve", "short_tmp"]


@pytest.fixture
def sidecar(serve: Callable[..., Sidecar],
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Sidecar]:
    """One sidecar serving ``short_tmp/root``; SIDECAR_ENDPOINT points at it, so runs
    started in this process report to it."""
    server = serve()
    monkeypatch.setenv("SIDECAR_ENDPOINT", server.endpoint)
    yield server
