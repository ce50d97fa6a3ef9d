"""pytest collects the pages of docs/ with Sybil: every fenced block of a page is one test,
and a page's blocks share its database and namespace (see tests/test_docs.py)."""

from pathlib import Path

import pytest

from tests.test_docs import docs_page, pytest_collect_file  # noqa: F401

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A page's blocks spawn processes (slow) and use a transactional test database, which
    ``docs_page`` gives them: the marker tells pytest-django to create it."""
    for item in items:
        if item.path.parent == HERE and item.path.suffix == ".md":
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.django_db(transaction=True, reset_sequences=True))
