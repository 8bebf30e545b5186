"""Fixtures shared by the tests (the machinery lives in ``tests.support.helpers``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from _pytest.nodeid import NodeId

from tests.support import machine_share
from tests.support.helpers import Sidecar, serve, short_tmp

__all__ = ["serve", "short_tmp"]


@pytest.fixture
def sidecar(serve: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch) -> Iterator[Sidecar]:
    """One sidecar serving ``short_tmp/root``; SIDECAR_ENDPOINT points at it, so runs
    started in this process report to it."""
    server = serve()
    monkeypatch.setenv("SIDECAR_ENDPOINT", server.endpoint)
    yield server


SHARED_SCOPES = frozenset({"class", "module", "package"})


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups from the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/e2e as ``e2e``, so ``-m 'not e2e'`` runs the unit loop.

    A test that uses a fixture shared by its module (one run, many assertions) joins its
    module's xdist_group: the module's tests then share one worker, which sets the fixture
    up once, instead of once on every worker that drew one of them."""
    for item in items:
        if "/e2e/" in item.path.as_posix():
            item.add_marker(pytest.mark.e2e)
        # pytest has no public accessor for an item's resolved fixture definitions
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is not None and any(
            definitions[-1].scope in SHARED_SCOPES
            for definitions in fixtures.name2fixturedefs.values()
            if definitions
        ):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@pytest.hookimpl(tryfirst=True)  # before xdist sends the ids to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup``, end each grouped test's id with ``@group``, as
    pytest-xdist 3.8 means to: it writes the suffix into an attribute pytest 9 no longer
    reads the id from, so its groups were silently ignored. The controller schedules by
    that suffix."""
    if not getattr(session.config, "workerinput", None) or not session.config.getvalue("loadgroup"):
        return
    for item in session.items:
        groups = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def pytest_configure(config: pytest.Config) -> None:
    """Fix the xdist run's id early, for the ``alone`` tests' lock folder."""
    machine_share.name_the_run(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Under xdist, a test marked ``alone`` runs (setup to teardown) with no other test
    beside it on any worker; the others share the machine (tests.support.machine_share)."""
    folder = machine_share.lock_folder(item.config)
    if folder is None:
        return (yield)
    with machine_share.share(folder, alone=item.get_closest_marker(machine_share.MARK) is not None):
        return (yield)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Delete the run's lock folder once the workers ended."""
    machine_share.remove(session.config)
