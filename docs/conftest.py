"""pytest collects the pages of docs/ with Sybil: every fenced block of a page is one test,
and a page's blocks share its database and namespace (see tests/test_docs.py)."""

from tests.test_docs import docs_page, pytest_collect_file  # noqa: F401
