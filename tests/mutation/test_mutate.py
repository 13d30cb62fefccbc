"""The mutation tool's own bookkeeping: which lines ``--lines`` selects, how a report's records follow a target file
that changed since (``--resume``), and which tests the baseline's measurement finds executing each line."""
import argparse
import importlib.util
import os
import sys

import pytest

_SPEC = importlib.util.spec_from_file_location("mutate", os.path.join(os.path.dirname(__file__), "mutate.py"))
mutate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mutate)

BEFORE = '''
class Run:
    def interrupted(self):
        point = self.at
        return point is not None and point > 0

    def step(self, count):
        self.total += count
        return self.total > 1
'''

# A method added above (with a statement equal to one of interrupted's), and step's comparison changed.
AFTER = '''
class Run:
    def continuation(self):
        point = self.at
        return point is not None

    def interrupted(self):
        point = self.at
        return point is not None and point > 0

    def step(self, count):
        self.total += count
        return self.total >= 1
'''


def test_lines_take_ranges_and_line_numbers_and_name_a_bad_part():
    assert mutate._line_ranges("168,178, 302-307") == [(168, 168), (178, 178), (302, 307)]
    with pytest.raises(argparse.ArgumentTypeError, match="'3x' is not FIRST-LAST"):
        mutate._line_ranges("1-2,3x")
    with pytest.raises(argparse.ArgumentTypeError, match="in '9-4' the first line is after the last"):
        mutate._line_ranges("9-4")


def _write(root, source: str) -> None:
    os.makedirs(root / "pkg", exist_ok=True)
    (root / "pkg" / "run.py").write_text(source)


def test_a_record_follows_its_statement_and_a_changed_statements_records_are_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "REPOSITORY", str(tmp_path))
    path = "pkg/run.py"
    _write(tmp_path, BEFORE)
    before, _ = mutate.mutants_of(path)
    for number, mutant in enumerate(before):
        mutant.status, mutant.killed_by = "killed", f"test {number}"
    other = mutate.Mutant("pkg/other.py", 3, "statement dropped", 0, status="survived")  # a file not planned
    recorded = {mutate._key(mutant): mutant for mutant in before + [other]}

    _write(tmp_path, AFTER)
    after, _ = mutate.mutants_of(path)
    records, moved, dropped = mutate._carry_over(recorded, [path])

    by_key = {mutate._key(record): record for record in records}
    assert by_key[mutate._key(other)] is other
    carried = [mutant for mutant in after if mutate._key(mutant) in by_key]
    # interrupted's mutants moved down with it and kept their outcome, one by one
    in_interrupted = [mutant for mutant in before if mutant.statement.startswith("Run.interrupted:")]
    assert [by_key[mutate._key(mutant)].killed_by for mutant in after if mutant.statement.startswith(
        "Run.interrupted:")] == [mutant.killed_by for mutant in in_interrupted]
    assert moved == len(in_interrupted) + sum(mutant.statement.startswith("Run.step:") for mutant in carried)
    # the new method's equal statement is another place: its mutants run
    assert not [mutant for mutant in carried if mutant.statement.startswith("Run.continuation:")]
    # step's changed comparison: its records are dropped (its mutants run again); its unchanged statement is kept
    changed = [mutant for mutant in before if "self.total > 1" in mutant.statement]
    assert dropped == len(changed) > 0
    assert not [mutant for mutant in carried if "self.total >= 1" in mutant.statement]
    assert [mutant for mutant in carried if "self.total += count" in mutant.statement]


def test_a_record_of_an_older_report_matches_by_index_and_line_and_takes_its_statement(tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "REPOSITORY", str(tmp_path))
    path = "pkg/run.py"
    _write(tmp_path, BEFORE)
    current, _ = mutate.mutants_of(path)
    old = mutate.Mutant(path, current[1].line, current[1].description, current[1].index, status="survived")
    stale = mutate.Mutant(path, 99, "statement dropped", 40, status="killed")  # no such mutant now
    records, moved, dropped = mutate._carry_over({mutate._key(old): old, mutate._key(stale): stale}, [path])
    assert (moved, dropped) == (0, 1)
    assert [(record.status, record.statement) for record in records] == [("survived", current[1].statement)]


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_a_test_that_clears_the_trace_function_leaves_the_later_tests_measured(tmp_path):
    """Mutation run mut50: test_step_transactions.py's Ctrl-C-at-any-statement test traced with its own function and
    then cleared it (sys.settrace(None)): coverage measured none of the ~220 tests after it, whose mutants then ran
    against too few tests or were reported not covered. The plugin puts coverage's trace function back after each
    test and names the test that removed it."""
    coverage = pytest.importorskip("coverage")
    (tmp_path / "measured_module.py").write_text("def first():\n    return 1\n\n\ndef second():\n    return 2\n")
    spec = importlib.util.spec_from_file_location("measured_module", tmp_path / "measured_module.py")
    module = importlib.util.module_from_spec(spec)
    measured = coverage.Coverage(include=[str(tmp_path / "measured_module.py")], data_file=None)
    contexts = mutate._TestContexts(measured)
    previous_trace = sys.gettrace()  # (this test's own measurement, if any, is back after it)
    measured.start()
    try:
        spec.loader.exec_module(module)
        contexts.pytest_runtest_setup(_Item("clearing"))
        module.first()
        sys.settrace(None)  # as the Ctrl-C test did
        contexts.pytest_runtest_logfinish("clearing", None)
        contexts.pytest_runtest_setup(_Item("later"))
        module.second()
        contexts.pytest_runtest_logfinish("later", None)
    finally:
        measured.stop()
        sys.settrace(previous_trace)
    by_line = measured.get_data().contexts_by_lineno(str(tmp_path / "measured_module.py"))
    assert by_line[2] == ["clearing"] and by_line[6] == ["later"]
    assert contexts.trace_put_back_after == ["clearing"]
