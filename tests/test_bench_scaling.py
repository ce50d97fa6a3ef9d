"""#27's "how cost grows": the scaling bench's sweepers are real OS processes on the test
database, released together on one backlog. Its figures are printed, never asserted;
what is asserted is what it checks: every resource given back exactly once."""

from __future__ import annotations

import pytest

from events_ledger.models import EventRun, EventRunLog, EventRunResource, EventRunStep
from project.bench import scaling

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.mark.parametrize("sweepers", [1, 3])
def test_a_backlog_swept_by_several_processes_is_given_back_once(sweepers):  # bench, #27
    # SQLite too: its writers take the lock when a transaction begins (IMMEDIATE) and
    # wait up to 20 s for it, so three processes queue rather than fail.
    result = scaling.sweep_backlog(40, sweepers, builders=2)
    check = result["check"]
    assert check["wrong"] == [], check
    assert check["unresolved"] == check["runs_not_complete"] == 0
    assert check["resources"] == check["reverted_rows"] == 40
    assert check["reverted_log_entries"] == check["revert_calls"] == 40
    assert check["reverted_by_sweepers"] == 40
    assert len(result["passes_per_process"]) == sweepers
    assert result["passes"] >= 4  # a batch is 10 runs
    # It removes what it made.
    assert not EventRun.objects.exists() and not EventRunResource.objects.exists()
    assert not EventRunStep.objects.exists() and not EventRunLog.objects.exists()


def test_the_check_tells_a_double_give_back():  # bench, #27
    answers = [
        {"reverted": 40, "revert_calls": 41, "errors": []},
    ]
    wrong = scaling._check(40, answers)["wrong"]
    # Nothing in the database: every count is off, and the extra revert is named.
    assert "revert_calls = 41, not 40" in wrong
