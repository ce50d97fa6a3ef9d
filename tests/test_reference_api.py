"""docs/reference.md cannot drift from the code: every public name of the package root and
of the contract kit, every signal, every metric the app exposes and every system check id
is named on the page, in backticks, in its own section; and every metric and check id the
page names exists."""

from __future__ import annotations

import re

import pytest
from django.dispatch import Signal

import events_ledger
from events_ledger import checks, signals, testing
from tests.test_docs import DOCS, exposed_metrics

PAGE = DOCS / "reference.md"
CHECK_ID = re.compile(r"events_ledger\.[EW]\d{3}")
METRIC = re.compile(r"`(events_ledger_[a-z0-9_]+)`")


def section(title: str) -> str:
    """The text of the page's ``## title`` section, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", PAGE.read_text(), re.M | re.S)
    assert found, f"docs/reference.md has no section {title!r}"
    return found[1]


def unnamed(names: set[str], title: str) -> list[str]:
    """The names no code span of the section starts with (`run_steps(...)` names
    run_steps)."""
    text = section(title)
    return sorted(name for name in names if not re.search(rf"`{re.escape(name)}\b", text))


def app_metrics() -> set[str]:
    """Every metric the app exposes, as the page names it: gauges, counters with
    ``_total``, a histogram by its own name (not its ``_bucket``/``_count``/``_sum``)."""
    pytest.importorskip("prometheus_client")
    exposed = set(exposed_metrics())
    histograms = {n.removesuffix("_bucket") for n in exposed if n.endswith("_bucket")}
    return {n for n in exposed if re.sub(r"_(bucket|count|sum)$", "", n) not in histograms} | (
        histograms
    )


def check_ids() -> set[str]:
    return {v for v in vars(checks).values() if isinstance(v, str) and CHECK_ID.fullmatch(v)}


def test_the_python_api_names_every_export_of_the_package():  # docs
    assert unnamed(set(events_ledger.__all__), "The Python API") == []


def test_the_python_api_names_the_contract_kit():  # docs
    assert unnamed(set(testing.__all__), "The Python API") == []


def test_every_signal_is_in_the_signals_section():  # docs
    sent = {name for name, value in vars(signals).items() if isinstance(value, Signal)}
    assert sent, "events_ledger.signals defines no signal"
    assert unnamed(sent, "Signals") == []


def test_every_metric_is_in_the_metrics_section_and_no_other():  # docs
    names = app_metrics()
    assert unnamed(names, "Metrics") == []
    assert set(METRIC.findall(section("Metrics"))) <= names, "the page names a metric gone"


def test_every_check_id_is_in_the_system_checks_section_and_no_other():  # docs
    ids = check_ids()
    assert {"events_ledger.E001", "events_ledger.W001"} <= ids
    assert unnamed(ids, "System checks") == []
    named = set(CHECK_ID.findall(PAGE.read_text()))
    assert named <= ids, f"the page names check ids that do not exist: {named - ids}"
