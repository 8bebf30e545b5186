"""Fixtures shared by the tests (defined in ``tests.helpers``)."""

from tests.helpers import serve, short_tmp

__all__ = ["serve", "short_tmp"]
