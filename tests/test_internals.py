"""docs/internals.md stays the map of the code: every rule id has a heading, and every
function and test it names exists (so the map cannot rot silently)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INTERNALS = ROOT / "docs" / "internals.md"
PACKAGE = ROOT / "events_ledger"

#: A rule id as comments write it: R0-R11, W1-W6, C1-C7, S1-S5. Not a check id
#: (``events_ledger.W001``: a zero after the letter is followed by more digits).
RULE_ID = re.compile(r"\b([RWCS](?:0|[1-9][0-9]?))\b")
HEADING = re.compile(r"^###\s+([RWCS](?:0|[1-9][0-9]?))\s+—\s+\S", re.MULTILINE)
#: `test_file.py::test_name`
TEST_REF = re.compile(r"`(test_[a-z0-9_]+\.py)::(test_[a-z0-9_]+)`")
#: `module.name` or `module.Class.method`, where module is one of events_ledger's.
CODE_REF = re.compile(r"`([a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
#: `tests/test_x.py`, `management/commands/x.py`, `project/settings.py`
PATH_REF = re.compile(r"`((?:tests|management|project)/[a-z0-9_/]+\.py)`")


def rule_ids(text: str) -> set[str]:
    return set(RULE_ID.findall(text))


def used_rule_ids() -> dict[str, str]:
    """Each rule id named in the app or the tests, with one file that names it."""
    used: dict[str, str] = {}
    for top in ("events_ledger", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for rule in rule_ids(path.read_text()):
                used.setdefault(rule, str(path.relative_to(ROOT)))
    return used


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Every class, function and top-level variable a module defines, at any depth."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def module_file(dotted: str) -> tuple[Path, list[str]] | None:
    """The events_ledger module a dotted reference starts with, and the names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        candidate = PACKAGE.joinpath(*parts[:n]).with_suffix(".py")
        if candidate.is_file():
            return candidate, parts[n:]
    return None


def test_the_rule_id_pattern_finds_rules_and_not_check_ids():
    assert rule_ids("# R5, C4 and W2; R11; events_ledger.W001; E001; S12x") == {
        "R5",
        "C4",
        "W2",
        "R11",
    }
    assert HEADING.findall("### R5 — a claim\n## W2 — too shallow\n### C4 —\n") == ["R5"]


def test_a_name_that_is_gone_is_told_apart_from_one_that_is_there():
    path, names = module_file("querysets.EventRunResourceQuerySet.claim_revert") or (None, [])
    assert path == PACKAGE / "querysets.py"
    assert names == ["EventRunResourceQuerySet", "claim_revert"]
    assert set(names) <= defined_names(path)
    assert "claim_revert_forever" not in defined_names(path)
    assert module_file("nowhere.thing") is None


def test_every_rule_id_used_in_the_code_or_tests_has_a_heading():
    headed = set(HEADING.findall(INTERNALS.read_text()))
    missing = {rule: where for rule, where in used_rule_ids().items() if rule not in headed}
    assert not missing, (
        f"rule ids without a '### <id> — ...' heading in docs/internals.md: {missing}"
    )


def test_no_rule_has_two_headings():
    headings = HEADING.findall(INTERNALS.read_text())
    assert len(headings) == len(set(headings)), sorted(headings)


def test_every_test_the_map_names_exists():
    refs = TEST_REF.findall(INTERNALS.read_text())
    assert len(refs) > 30, "the map names the tests that hold each rule"
    gone = [
        f"{file}::{name}"
        for file, name in refs
        if not (ROOT / "tests" / file).is_file() or name not in defined_names(ROOT / "tests" / file)
    ]
    assert not gone, f"docs/internals.md names tests that no longer exist: {gone}"


def test_every_function_the_map_names_exists():
    text = INTERNALS.read_text()
    checked, gone = 0, []
    for dotted in CODE_REF.findall(text):
        found = None if dotted.endswith(".py") else module_file(dotted)
        if found is None:
            continue  # not a reference into the app (`EVENTS_LEDGER`, `ok: True`, ...)
        path, names = found
        checked += 1
        if not all(name in defined_names(path) for name in names):
            gone.append(dotted)
    assert checked > 30, "the map names the code that holds each rule"
    assert not gone, f"docs/internals.md names code that no longer exists: {gone}"


@pytest.mark.parametrize("ref", sorted(set(PATH_REF.findall(INTERNALS.read_text()))))
def test_every_file_the_map_names_exists(ref):
    assert (ROOT / ref).is_file() or (PACKAGE / ref).is_file(), ref
