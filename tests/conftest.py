"""Fixtures shared by the tests (the machinery lives in ``tests.support.helpers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.helpers import Sidecar, serve, short_tmp

__all__ = ["serve", "short_tmp"]


@pytest.fixture
def sidecar(serve: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch) -> Iterator[Sidecar]:
    """One sidecar serving ``short_tmp/root``; SIDECAR_ENDPOINT points at it, so runs
    started in this process report to it."""
    server = serve()
    monkeypatch.setenv("SIDECAR_ENDPOINT", server.endpoint)
    yield server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e as ``e2e``, so ``-m 'not e2e'`` runs the unit loop."""
    for item in items:
        if "/e2e/" in item.path.as_posix():
            item.add_marker(pytest.mark.e2e)
