"""Mutation testing of the loop's core: does the test suite notice a wrong line in what decides what is trained?

Each *mutant* is a copy of the package with one small change in one of :data:`TARGETS` (a comparison flipped, an
off-by-one constant, ``and``/``or`` swapped, a ``not`` dropped, an arithmetic operator swapped, a statement
dropped). The tests of :data:`TESTS` run against each mutant; a mutant is *killed* when they fail (or hang past the
timeout), *survives* when they pass. A surviving mutant is a change the selected tests cannot see: either a missing
test or an equivalent mutant (a change that computes the same), to be told apart by reading it.

Usage (from the repository root; one command, the test selection is :data:`TESTS` below)::

    python tests/mutation/mutate.py                     # every mutant of every target
    python tests/mutation/mutate.py --target step_runner --limit 20 --report mutants.json
    python tests/mutation/mutate.py --list              # the mutants, without running anything
    python tests/mutation/mutate.py --target step_runner,run_state --jobs 2 --resume mutants.json
                                                        # resumable: run again to go on where it stopped

The package is copied to a temporary folder; the mutated file is written there only (the working tree is never
changed). Mutants on lines the selected tests never execute (measured once, with coverage, in the test process)
are reported as *not covered* without running. Each mutant runs the tests of the selection that execute its
statement (recorded per test by the same measurement; the whole selection for a line executed at import, or with
``--whole-selection``), in a process forked from one that imported torch and pytest already, stopping at the first
failure; ``--jobs N`` runs N at once, each in its own copy.

The report is rewritten after every mutant. ``--resume REPORT`` skips the mutants it decided and reuses its
unmutated run (time and coverage) while the package and the tests are unchanged; ``--retry survived`` runs a
status again (after new tests). ``kill PID`` (SIGTERM) stops a run as Ctrl-C does: the mutants in flight stay
pending, the report is kept.
"""
import argparse
import ast
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Dict, List, Optional, Set, Tuple

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What is mutated: what decides what is trained (the step, precision, the run's state, the data position).
TARGETS = ["aitoolbox/torchtrain/train_loop/step_runner.py", "aitoolbox/torchtrain/precision/*.py",
           "aitoolbox/torchtrain/train_loop/run_state.py", "aitoolbox/torchtrain/train_loop/data_position.py",
           "aitoolbox/torchtrain/train_loop/sampler_replay.py"]

# The tests run against each mutant, fastest and most telling first (the run stops at the first failure). Edit this
# list to change the selection; ``-m "not slow"`` applies.
TESTS = [
    "tests/torchtrain/precision/test_loss_scaler.py",
    "tests/torchtrain/precision/test_loss_scaler_defaults.py",
    "tests/torchtrain/precision/test_master_weights_kinds.py",
    "tests/torchtrain/precision/test_cast_floating.py",
    "tests/torchtrain/precision/test_sparse_gradients.py",
    "tests/torchtrain/precision/test_cpu_fallback.py::test_a_torch_without_onednn_counts_as_without_native_bfloat16",
    "tests/torchtrain/precision/test_cpu_fallback.py::test_the_check_reads_the_cpu_unless_overridden",
    "tests/torchtrain/train_loop/test_data_position.py",
    "tests/torchtrain/train_loop/test_loader_own_state.py",
    "tests/torchtrain/train_loop/test_stateful_loader_samplers.py",
    "tests/torchtrain/data/test_persistent_workers.py",
    "tests/torchtrain/train_loop/test_step_conditions.py",
    "tests/torchtrain/train_loop/test_step_transactions.py",
    "tests/torchtrain/train_loop/test_per_optimizer_accumulation.py",
    "tests/torchtrain/train_loop/test_direct_batches.py",
    "tests/torchtrain/train_loop/test_epoch_loss_sum.py",
    "tests/combinations/test_property_regressions.py",
    "tests/torchtrain/precision/test_precision_parity.py",
    "tests/torchtrain/train_loop/test_run_snapshot.py",
    "tests/torchtrain/train_loop/test_resume.py",
    # (run_state.py's position_in_epoch: the refusal at a loaded mid-epoch checkpoint's position before fit)
    "tests/torchtrain/train_loop/test_checkpoint_position.py::"
    "test_an_epoch_end_checkpoint_at_a_loaded_mid_epoch_checkpoints_position_is_refused_before_and_in_fit",
    "tests/torchtrain/train_loop/test_train_loop.py",
    "tests/torchtrain/amp/test_scale_loss.py",
    "tests/torchtrain/amp/test_checkpoint.py",
    "tests/torchtrain/amp/test_initialize.py::test_o1_autocast_is_left_when_forward_raises",
    "tests/torchtrain/amp/test_initialize.py::"
    "test_o1_an_exception_in_a_forward_pre_hook_before_amps_reaches_the_caller",
    "tests/torchtrain/compiling/test_train_loop_compile.py::"
    "test_compiled_training_equals_eager_and_compiles_only_in_the_first_epoch[fp32]",
    "tests/combinations/test_defects.py::test_get_num_training_steps_counts_the_epoch_end_steps",
    "tests/combinations/test_defects.py::test_the_epoch_end_step_of_a_loader_without_len_is_clipped",
    "tests/combinations/test_defects.py::test_an_exception_between_unscale_and_step_does_not_leak_into_the_next_fit",
    "tests/combinations/test_defects.py::test_an_unscale_by_hand_between_two_fits_does_not_leak_into_the_next_fit",
    "tests/combinations/test_defects.py::test_an_exception_between_two_optimizers_steps_is_finished_by_the_next_fit",
    "tests/combinations/test_defects.py::"
    "test_an_interrupted_step_of_two_optimizers_keeps_the_model_gradients_under_master_weights",
    "tests/combinations/test_defects.py::"
    "test_a_checkpoint_loaded_after_an_interrupted_two_optimizer_step_is_where_the_run_goes_on",
    "tests/combinations/test_defects.py::"
    "test_an_exception_after_clipping_between_two_optimizers_does_not_unscale_twice",
    "tests/combinations/test_defects.py::"
    "test_an_exception_between_batches_of_two_optimizers_stepped_in_turn_continues_after_the_last_step",
    "tests/combinations/test_defects.py::"
    "test_an_exception_after_a_step_of_two_optimizers_stepped_together_is_finished_for_both",
    "tests/combinations/test_defects.py::test_training_with_a_frozen_batchnorm_equals_a_hand_loop",
    "tests/combinations/test_defects.py::test_o3_resumes_from_a_checkpoint_loaded_before_the_model_is_cast",
    "tests/combinations/test_defects.py::"
    "test_o2_dynamic_scaling_two_optimizers_accumulation_skips_only_the_overflowing_optimizer",
    "tests/torchtrain/schedulers/test_basic.py::"
    "test_per_step_schedulers_of_optimizers_stepped_one_after_another_match_a_hand_loop",
    "tests/torchtrain/train_loop/test_compat_1x.py::"
    "test_multi_optimizer_under_grad_scaler_arguments_updates_the_scale_once_per_iteration",
    "tests/torchtrain/train_loop/test_compat_1x.py::"
    "test_a_multi_loss_with_one_plain_optimizer_steps_on_the_sum_of_the_losses",
    "tests/torchtrain/train_loop/test_compat_1x.py::test_multi_loss_with_multi_optimizer_trains_in_1x_order",
    "tests/torchtrain/train_loop/test_compat_1x.py::test_a_multi_optimizer_subclass_is_called_as_in_1x",
    "tests/torchtrain/train_loop/test_compat_1x.py::"
    "test_a_multi_optimizer_subclass_overriding_one_method_has_it_called",
    "tests/torchtrain/train_loop/test_compat_1x.py::test_a_multi_loss_subclass_backward_is_called_as_in_1x",
    "tests/torchtrain/train_loop/test_compat_1x.py::"
    "test_a_multi_loss_without_a_loss_for_an_optimizer_is_refused_naming_it",
    "tests/torchtrain/train_loop/test_compat_1x.py::"
    "test_a_grad_scaler_state_loaded_before_fit_is_where_the_scaling_goes_on",
    "tests/torchtrain/train_loop/test_compat_1x.py::test_a_state_without_a_scale_is_refused",
    "tests/torchtrain/train_loop/test_compat_1x.py::test_should_execute_optimizer_update_outside_training_follows_1x",
    "tests/torchtrain/callbacks/test_throughput.py::test_training_is_bitwise_the_same_with_the_monitor",
    "tests/torchtrain/callbacks/test_throughput.py::"
    "test_data_wait_counts_only_the_time_spent_getting_batches_from_the_loader",
    "tests/torchtrain/callbacks/test_throughput.py::"
    "test_data_wait_counts_starting_the_loaders_iteration_and_the_next_that_finds_its_end",
    "tests/torchtrain/train_loop/test_lr_finder.py::"
    "test_a_window_an_unsized_loaders_end_cuts_short_is_a_step_of_the_search",
    "tests/torchtrain/train_loop/test_lr_finder.py::"
    "test_an_unsized_loaders_end_on_a_window_boundary_adds_no_step_to_the_search",
    "tests/combinations/test_matrix.py::test_representative_cells[single]",
    "tests/combinations/test_properties.py",
]
# Tests of the selection left out: slow for what they add here (test_cpu_fallback.py is, but for the two tests named
# in TESTS).
DESELECTED: List[str] = []

# The baseline's coverage: the lines executed, and the tests executing each (a baseline of another format is run
# again rather than reused). 3: coverage's trace function put back after a test that cleared it (the baselines of
# format 2 since test_step_transactions.py's Ctrl-C-at-any-statement test measured none of the tests after it).
COVERAGE_FORMAT = 3

# Function names whose bodies are not mutated: what only describes an object.
SKIPPED_FUNCTIONS = {"__repr__", "__str__"}


@dataclasses.dataclass
class Mutant:
    path: str  # relative to the repository
    line: int
    description: str
    index: int  # which mutation of the file's mutation list
    status: str = "pending"  # killed, survived, timeout, not covered, error
    seconds: float = 0.0
    killed_by: str = ""  # the first failing test
    # Where it is, independent of line numbers: its function and the text of the innermost statement holding it,
    # and how many earlier mutants of the file have the same description in the same statement of that function.
    # A report's record is carried over to a changed file by these (see _carry_over); one without them, by path,
    # index and line.
    statement: str = ""
    occurrence: int = 0

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}: {self.description}"


# --- the mutations ----------------------------------------------------------------------------------------------
_COMPARE_SWAPS = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
                  ast.GtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_BINARY_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
                 ast.Mod: ast.FloorDiv}
_SYMBOLS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
            ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
            ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.And: "and", ast.Or: "or"}


def _is_docstring(node: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_logging(node: ast.AST) -> bool:
    """A call of ``logger.<level>(...)`` or ``warnings.warn(...)``: output, not behaviour."""
    call = node.value if isinstance(node, ast.Expr) else node
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    owner = call.func.value
    return isinstance(owner, ast.Name) and owner.id in ("logger", "logging", "warnings")


class _Sites(ast.NodeVisitor):
    """Every place a mutation applies, in a fixed order: ``(node path, kind, description, line)``."""

    def __init__(self):
        self.sites: List[Tuple[Tuple, str, str, int]] = []
        self._path: List = []
        self._in_function = 0
        self._quiet = 0  # inside a logging call, a raise's message, an annotation

    def generic_visit(self, node: ast.AST) -> None:
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns", "decorator_list"):
                continue
            if isinstance(value, list):
                for index, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        self._path.append((field, index))
                        self.visit(item)
                        self._path.pop()
            elif isinstance(value, ast.AST):
                self._path.append((field, None))
                self.visit(value)
                self._path.pop()

    def _add(self, kind: str, description: str, node: ast.AST) -> None:
        if self._in_function and not self._quiet:
            self.sites.append((tuple(self._path), kind, description, node.lineno))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name in SKIPPED_FUNCTIONS:
            return
        self._in_function += 1
        self.generic_visit(node)
        self._in_function -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if _is_logging(node):
            return
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._add("drop", "raise dropped", node)
        self._quiet += 1  # the message of an error is not behaviour
        self.generic_visit(node)
        self._quiet -= 1

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # an f-string: text

    def visit_Compare(self, node: ast.Compare) -> None:
        for index, op in enumerate(node.ops):
            swapped = _COMPARE_SWAPS.get(type(op))
            if swapped is not None:
                self._add(f"compare:{index}", f"{_SYMBOLS[type(op)]} -> {_SYMBOLS[swapped]}", node)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        other = "or" if isinstance(node.op, ast.And) else "and"
        self._add("boolop", f"{_SYMBOLS[type(node.op)]} -> {other}", node)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add("not", "not x -> x", node)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swapped = _BINARY_SWAPS.get(type(node.op))
        if swapped is not None:
            self._add("binop", f"{_SYMBOLS[type(node.op)]} -> {_SYMBOLS[swapped]}", node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swapped = _BINARY_SWAPS.get(type(node.op))
        if swapped is not None:
            self._add("augop", f"{_SYMBOLS[type(node.op)]}= -> {_SYMBOLS[swapped]}=", node)
        self._add("drop", "statement dropped", node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self._add("bool", f"{value} -> {not value}", node)
        elif isinstance(value, int):
            self._add("int+1", f"{value} -> {value + 1}", node)
            self._add("int-1", f"{value} -> {value - 1}", node)
        elif isinstance(value, float):
            self._add("float", f"{value} -> {value * 2 if value else 1.0}", node)

    def _statement(self, node: ast.AST) -> None:
        if _is_docstring(node) or _is_logging(node):
            return
        self._add("drop", "statement dropped", node)
        self.generic_visit(node)

    visit_Expr = visit_Assign = visit_AnnAssign = _statement


def _node_at(tree: ast.AST, path: Tuple) -> Tuple[ast.AST, str, Optional[int]]:
    """The parent of the node at ``path``, the field and index the node is in."""
    parent = tree
    for field, index in path[:-1]:
        value = getattr(parent, field)
        parent = value[index] if index is not None else value
    field, index = path[-1]
    return parent, field, index


def mutated_source(source: str, site: Tuple[Tuple, str, str, int]) -> str:
    """``source`` with the mutation ``site`` applied."""
    tree = ast.parse(source)
    path, kind, _, _ = site
    parent, field, index = _node_at(tree, path)
    node = getattr(parent, field)[index] if index is not None else getattr(parent, field)

    def replace(new: ast.AST) -> None:
        if index is None:
            setattr(parent, field, new)
        else:
            getattr(parent, field)[index] = new

    if kind.startswith("compare:"):
        position = int(kind.split(":")[1])
        node.ops[position] = _COMPARE_SWAPS[type(node.ops[position])]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "not":
        replace(node.operand)
    elif kind in ("binop", "augop"):
        node.op = _BINARY_SWAPS[type(node.op)]()
    elif kind == "bool":
        node.value = not node.value
    elif kind == "int+1":
        node.value = node.value + 1
    elif kind == "int-1":
        node.value = node.value - 1
    elif kind == "float":
        node.value = node.value * 2 if node.value else 1.0
    elif kind == "drop":
        replace(ast.Pass())
    else:  # pragma: no cover
        raise ValueError(kind)
    return ast.unparse(ast.fix_missing_locations(tree))


def target_files(selected: Optional[str]) -> List[str]:
    files = sorted({path for pattern in TARGETS for path in glob.glob(os.path.join(REPOSITORY, pattern))})
    files = [os.path.relpath(path, REPOSITORY) for path in files if not path.endswith("__init__.py")]
    return [path for path in files if selected is None or selected in path]


def _statement_texts(source: str) -> Dict[int, str]:
    """For each line, the innermost statement that holds it: the qualified name of its function (two equal
    statements of two functions are two places) and its text, each line stripped (indentation, as a block moved
    into another, does not make it another statement)."""
    lines = source.splitlines()
    spans: Dict[int, Tuple[int, int]] = {}
    owners: Dict[int, str] = {}

    def visit(node: ast.AST, owner: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owner = f"{owner}.{node.name}" if owner else node.name
        if isinstance(node, ast.stmt):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                best = spans.get(line)
                if best is None or (node.end_lineno - node.lineno) <= (best[1] - best[0]):
                    spans[line], owners[line] = (node.lineno, node.end_lineno), owner
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(ast.parse(source), "")
    return {line: owners[line] + ": " + "\n".join(text.strip() for text in lines[first - 1:last])
            for line, (first, last) in spans.items()}


def mutants_of(path: str) -> Tuple[List[Mutant], List[Tuple]]:
    with open(os.path.join(REPOSITORY, path)) as source_file:
        source = source_file.read()
    sites = _Sites()
    sites.visit(ast.parse(source))
    texts = _statement_texts(source)
    mutants, seen = [], {}
    for index, site in enumerate(sites.sites):
        statement = texts.get(site[3], "")
        occurrence = seen.get((site[2], statement), 0)
        seen[(site[2], statement)] = occurrence + 1
        mutants.append(Mutant(path, site[3], site[2], index, statement=statement, occurrence=occurrence))
    return mutants, sites.sites


# --- running ----------------------------------------------------------------------------------------------------
def _copy_repository(destination: str) -> None:
    for name in ("aitoolbox", "tests"):
        shutil.copytree(os.path.join(REPOSITORY, name), os.path.join(destination, name),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"))
    shutil.copy(os.path.join(REPOSITORY, "pytest.ini"), destination)


def _pytest_arguments(tests: Optional[List[str]] = None) -> List[str]:
    """The selection (or ``tests``, node ids of it), stopping at the first failure."""
    arguments = list(tests or TESTS) + ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "--no-header",
                                        "-o", "addopts=--import-mode=importlib"]
    return arguments + [f"--ignore={path}" for path in DESELECTED]


class _TestContexts:
    """A pytest plugin naming coverage's context after the test that runs (its setup, call and teardown), so that
    the baseline knows which tests execute each line; the lines executed outside any test (at import, at collection)
    keep the empty context."""

    def __init__(self, measured):
        self.measured = measured
        self.test_ids: List[str] = []  # in the order they ran
        self.tracer = None  # coverage's trace function, as the first test found it
        # The tests that left another trace function than coverage's (a test tracing with its own and then
        # clearing it, sys.settrace(None)): coverage's is put back after each, else every later test goes unmeasured
        # and the mutants only those execute run against too few tests, or are reported not covered.
        self.trace_put_back_after: List[str] = []

    def pytest_runtest_setup(self, item):
        if self.tracer is None:
            self.tracer = sys.gettrace()
        self.test_ids.append(item.nodeid)
        self.measured.switch_context(item.nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.measured.switch_context("")
        if self.tracer is not None and sys.gettrace() is not self.tracer:
            self.trace_put_back_after.append(nodeid)
            sys.settrace(self.tracer)


def _start_tests(copy_root: str, log_path: str, coverage_of: Optional[List[str]] = None,
                 threads: Optional[int] = None, tests: Optional[List[str]] = None) -> int:
    """Start the selection (or ``tests``) in a process forked from this one, inside ``copy_root``; its pid.

    With ``coverage_of``, the lines of those files the tests execute are written to ``copy_root``'s
    ``.coverage-lines.json``, with the tests that execute each (see :func:`_covering_tests`). ``threads`` caps
    torch's threads (parallel workers must not oversubscribe the cores).
    """
    pid = os.fork()
    if pid:
        return pid
    code = 3  # the child: imports the package from the copy, runs pytest, exits with its code
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is for the parent
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setpgrp()  # its own process group: a timeout kills the processes its tests started too
        os.chdir(copy_root)
        sys.path.insert(0, copy_root)
        os.environ["PYTHONPATH"] = copy_root + os.pathsep + os.environ.get("PYTHONPATH", "")  # tests' subprocesses
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if threads:
            # The tests' own subprocesses (a resume in a fresh process, compared bitwise with this one) must compute
            # with the same number of threads: another reduction order is another result.
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
            import torch
            torch.set_num_threads(threads)
        import pytest
        plugins = []
        if coverage_of:
            import coverage
            measured = coverage.Coverage(include=[os.path.join(copy_root, path) for path in coverage_of],
                                         data_file=None)
            plugins.append(_TestContexts(measured))
            measured.start()
        code = pytest.main(_pytest_arguments(tests), plugins=plugins)
        if coverage_of:
            measured.stop()
            data = measured.get_data()
            test_ids = plugins[0].test_ids
            position = {test_id: index for index, test_id in enumerate(test_ids)}
            position[""] = -1  # executed outside any test (at import): every test may depend on it
            lines, tests_by_line = {}, {}
            for path in data.measured_files():
                relative = os.path.relpath(path, copy_root)
                lines[relative] = sorted(data.lines(path) or [])
                tests_by_line[relative] = {line: sorted(position[context] for context in contexts)
                                           for line, contexts in data.contexts_by_lineno(path).items()}
            with open(os.path.join(copy_root, ".coverage-lines.json"), "w") as handle:
                json.dump({"lines": lines, "test_ids": test_ids, "tests_by_line": tests_by_line,
                           "trace_put_back_after": plugins[0].trace_put_back_after}, handle)
    finally:
        os._exit(int(code))


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _outcome(status: int) -> str:
    return {0: "survived", 1: "killed"}.get(os.waitstatus_to_exitcode(status), "error")


def _run_baseline(copy_root: str, log_path: str, coverage_of: Optional[List[str]]) -> Tuple[str, float, Optional[dict]]:
    """The unmutated selection: ``(outcome, seconds, coverage)``: the executed lines of coverage_of's files
    (``lines``), the tests in the order they ran (``test_ids``) and which of them execute each line
    (``tests_by_line``, positions in ``test_ids``; -1 for lines executed outside any test)."""
    started = time.monotonic()
    pid = _start_tests(copy_root, log_path, coverage_of)
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - started
    coverage_file = os.path.join(copy_root, ".coverage-lines.json")
    lines = None
    if coverage_of and os.path.exists(coverage_file):
        with open(coverage_file) as handle:
            lines = json.load(handle)
        os.remove(coverage_file)
    return _outcome(status), seconds, lines


def _statement_lines(source: str, line: int) -> Set[int]:
    """The lines of the innermost statement that contains ``line`` (a mutation's node may start on a line coverage
    does not list, inside a statement spanning several)."""
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or (node.end_lineno - node.lineno) <= (best.end_lineno - best.lineno):
                best = node
    return set(range(best.lineno, best.end_lineno + 1)) if best is not None else {line}


def _covering_tests(coverage: dict, path: str, lines: Set[int]) -> Optional[List[str]]:
    """The tests of the selection that execute any of ``lines`` of ``path``, in the order they ran; None where a line
    is executed outside any test (at import: a module constant, a class attribute) or the baseline recorded no
    tests by line: then the whole selection runs."""
    by_line = (coverage.get("tests_by_line") or {}).get(path)
    if by_line is None:
        return None
    positions: Set[int] = set()
    for line in lines:
        positions.update(by_line.get(str(line), ()))
    if -1 in positions:
        return None
    test_ids = coverage["test_ids"]
    return [test_ids[position] for position in sorted(positions)]


def _first_failure(log_path: str) -> str:
    """The node id of the first test pytest reported failed (or in error) in ``log_path``."""
    with open(log_path, errors="replace") as log:
        for line in log:
            if line.startswith(("FAILED ", "ERROR ")):
                return line.split()[1]
    return ""


class _Worker:
    """One copy of the repository, running one mutant's tests at a time (a mutant is written into its copy only)."""

    def __init__(self, copy_root: str, log_dir: str, timeout_s: float, threads: Optional[int]):
        self.copy_root, self.log_dir, self.timeout_s, self.threads = copy_root, log_dir, timeout_s, threads
        self.mutant: Optional[Mutant] = None
        self.pid = 0
        self._original = ""
        self._started = 0.0
        self._log_path = ""

    def start(self, mutant: Mutant, number: int, original: str, mutated: str, tests: Optional[List[str]]) -> None:
        """Run ``tests`` (node ids; None: the whole selection) against ``mutated``, ``mutant.path``'s mutated source."""
        self.mutant, self._original = mutant, original
        with open(os.path.join(self.copy_root, mutant.path), "w") as handle:
            handle.write(mutated)
        self._started = time.monotonic()
        self._log_path = os.path.join(self.log_dir, f"{number}.log")
        self.pid = _start_tests(self.copy_root, self._log_path, threads=self.threads, tests=tests)

    def poll(self) -> Optional[Mutant]:
        """The mutant, with its outcome, once its tests ended (or were killed at the timeout); else None."""
        finished, status = os.waitpid(self.pid, os.WNOHANG)
        seconds = time.monotonic() - self._started
        if finished:
            outcome = _outcome(status)
        elif seconds > self.timeout_s:
            _kill(self.pid)
            outcome = "timeout"
        else:
            return None
        mutant, self.mutant, self.pid = self.mutant, None, 0
        mutant.status, mutant.seconds = outcome, seconds
        mutant.killed_by = _first_failure(self._log_path) if outcome == "killed" else ""
        self._restore(mutant)
        return mutant

    def stop(self) -> None:
        """Abandon the mutant in flight (it stays pending)."""
        if self.pid:  # 0 before the fork: never killpg(0), this process's own group
            _kill(self.pid)
            self.pid = 0
        if self.mutant is not None:
            self._restore(self.mutant)
            self.mutant = None

    def _restore(self, mutant: Mutant) -> None:
        with open(os.path.join(self.copy_root, mutant.path), "w") as handle:
            handle.write(self._original)


# --- the report: written after every mutant, read back by --resume ------------------------------------------------
def _key(mutant: Mutant) -> Tuple:
    return mutant.path, mutant.index, mutant.line, mutant.description


def _anchor(mutant: Mutant) -> Tuple:
    return mutant.path, mutant.description, mutant.statement, mutant.occurrence


def _carry_over(recorded: Dict[Tuple, Mutant], files: List[str]) -> Tuple[List[Mutant], int, int]:
    """A report's records, matched to ``files``' current mutants: ``(records, moved, dropped)``.

    A record of one of ``files`` that has its statement keeps its outcome under the mutant of the same function,
    statement text, description and occurrence (its line and index as they are now: code added or removed above
    it moved it); one without (a report of an older tool) under the mutant of the same index, line and
    description, and takes its statement from it. A record that matches none is dropped: its statement changed or
    is gone, and the mutant of the changed statement is another one, to run. Records of other files are kept as
    they are."""
    current = [mutant for path in files for mutant in mutants_of(path)[0]]
    by_anchor = {_anchor(mutant): mutant for mutant in current}
    by_key = {_key(mutant): mutant for mutant in current}
    records, moved, dropped, taken = [], 0, 0, set()
    for earlier in recorded.values():
        if earlier.path not in files:
            records.append(earlier)
            continue
        now = by_anchor.get(_anchor(earlier)) if earlier.statement else by_key.get(_key(earlier))
        if now is None or _key(now) in taken:
            dropped += 1
            continue
        taken.add(_key(now))
        moved += (earlier.line, earlier.index) != (now.line, now.index)
        records.append(dataclasses.replace(now, status=earlier.status, seconds=earlier.seconds,
                                           killed_by=earlier.killed_by))
    return records, moved, dropped


def _fingerprint() -> str:
    """What the baseline's outcome, time and coverage depend on: the package, the tests (this tool aside) and the
    selection. A report's baseline is reused only under the same fingerprint."""
    digest = hashlib.sha256(json.dumps([TESTS, DESELECTED, COVERAGE_FORMAT]).encode())
    paths = [os.path.join(REPOSITORY, "pytest.ini")]
    for name in ("aitoolbox", "tests"):
        paths += glob.glob(os.path.join(REPOSITORY, name, "**", "*.py"), recursive=True)
    mutation_dir = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(path for path in paths if not path.startswith(mutation_dir + os.sep)):
        digest.update(os.path.relpath(path, REPOSITORY).encode())
        with open(path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def _write_report(path: str, mutants: List[Mutant], baseline: dict) -> None:
    """Replace ``path`` atomically: an interrupted run leaves the previous report whole."""
    report = {"summary": _summary(mutants), "tests": TESTS, "baseline": baseline,
              "mutants": [dataclasses.asdict(mutant) for mutant in mutants]}
    with open(path + ".tmp", "w") as handle:
        json.dump(report, handle, indent=1)
    os.replace(path + ".tmp", path)


def _read_report(path: str) -> Tuple[Dict[Tuple, Mutant], dict]:
    """The mutants a report recorded (by key) and its baseline (empty if it has none)."""
    with open(path) as handle:
        report = json.load(handle)
    recorded = {}
    for fields in report["mutants"]:
        mutant = Mutant(**fields)
        recorded[_key(mutant)] = mutant
    return recorded, report.get("baseline") or {}


# --- the command ----------------------------------------------------------------------------------------------
def _line_ranges(text: str) -> List[Tuple[int, int]]:
    """``FIRST-LAST`` ranges or single line numbers, comma-separated, as ``(first, last)`` pairs; an error naming
    the bad part otherwise."""
    ranges = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            bounds = int(first), int(last or first)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--lines {text!r}: {part!r} is not FIRST-LAST (e.g. 330-350) nor a "
                                             "line number") from None
        if bounds[0] > bounds[1]:
            raise argparse.ArgumentTypeError(f"--lines {text!r}: in {part!r} the first line is after the last")
        ranges.append(bounds)
    return ranges


def _plan(targets: Optional[str], limit: Optional[int],
          lines: Optional[List[Tuple[int, int]]] = None) -> Tuple[List[str], List[Tuple[Mutant, Tuple]]]:
    """The files and ``(mutant, site)`` pairs to run, target by target in the order ``targets`` names them; with
    ``lines``, only the mutants of those lines (before ``limit`` spreads what is left)."""
    files: List[str] = []
    for target in (targets.split(",") if targets else [None]):
        files += [path for path in target_files(target) if path not in files]
    plan: List[Tuple[Mutant, Tuple]] = []
    for path in files:
        mutants, sites = mutants_of(path)
        pairs = list(zip(mutants, sites))
        if lines is not None:
            pairs = [(mutant, site) for mutant, site in pairs
                     if any(first <= mutant.line <= last for first, last in lines)]
        if limit and len(pairs) > limit:
            step = len(pairs) / limit
            pairs = [pairs[int(i * step)] for i in range(limit)]
        plan += pairs
    return files, plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="only the target files whose path contains this; several, comma-separated, "
                                         "run in the order given (step_runner,run_state)")
    parser.add_argument("--limit", type=int, help="at most this many mutants per file (spread over it)")
    parser.add_argument("--lines", type=_line_ranges, metavar="FIRST-LAST,...",
                        help="only the mutants on these lines of each target file (with one --target): ranges or "
                             "line numbers, comma-separated")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--report", help="write every mutant's outcome to this JSON file (after each mutant)")
    parser.add_argument("--resume", metavar="REPORT",
                        help="skip the mutants this report decided (and reuse its baseline if nothing changed); "
                             "the report is written back to it unless --report names another file")
    parser.add_argument("--retry", default="", help="with --resume: statuses to run again, comma-separated "
                                                    "(survived,not covered after new tests)")
    parser.add_argument("--jobs", type=int, default=1, help="run this many mutants at once (one thread each)")
    parser.add_argument("--timeout-factor", type=float, default=3.0,
                        help="a mutant's tests may take this many times the unmutated run (then: killed, timeout)")
    parser.add_argument("--no-coverage", action="store_true", help="run every mutant, covered or not")
    parser.add_argument("--whole-selection", action="store_true",
                        help="run the whole selection against each mutant (default: the tests that execute the "
                             "mutated statement, measured by the unmutated run)")
    parser.add_argument("--baseline-only", action="store_true", help="run the unmutated selection only")
    options = parser.parse_args()
    report_path = options.report or options.resume

    files, pairs = _plan(options.target, options.limit, options.lines)
    plan = [mutant for mutant, _ in pairs]
    sites = {_key(mutant): site for mutant, site in pairs}
    if options.list:
        for mutant in plan:
            print(mutant.name)
        print(f"{len(plan)} mutants in {len(files)} files")
        return 0

    baseline: dict = {}
    reported = plan  # what the report holds: the plan, and what an earlier report recorded outside it
    if options.resume and os.path.exists(options.resume):
        recorded, baseline = _read_report(options.resume)
        records, moved, dropped = _carry_over(recorded, files)
        if moved or dropped:
            print(f"{options.resume}: {moved} recorded mutants moved to other lines (code changed above them), "
                  f"{dropped} dropped (their statement changed or is gone: run again where planned)")
        recorded = {_key(mutant): mutant for mutant in records}
        planned = set(sites)
        reported = plan + [mutant for key, mutant in recorded.items() if key not in planned]
        retry = {status.strip() for status in options.retry.split(",") if status.strip()}
        for mutant in plan:
            earlier = recorded.get(_key(mutant))
            if earlier is not None and earlier.status not in retry | {"pending"}:
                mutant.status, mutant.seconds, mutant.killed_by = earlier.status, earlier.seconds, earlier.killed_by

    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's module must never be read from a stale .pyc
    sys.dont_write_bytecode = True
    import torch  # noqa: F401  (imported once here: every forked test run starts with it)
    import pytest  # noqa: F401
    import hypothesis  # noqa: F401

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)  # kill PID stops the run as Ctrl-C does: report kept, copies removed

    workspace = tempfile.mkdtemp(prefix="aitoolbox_mutants_")
    log_dir = os.path.join(workspace, "logs")
    os.makedirs(log_dir)
    workers: List[_Worker] = []
    try:
        roots = [os.path.join(workspace, f"repository{number}") for number in range(max(1, options.jobs))]
        for root in roots:
            _copy_repository(root)
        fingerprint = _fingerprint()
        all_targets = target_files(None)  # coverage of every target: a reused baseline serves any --target
        if baseline.get("fingerprint") == fingerprint and (baseline.get("covered") is None) == options.no_coverage:
            print(f"unmutated: the selection passed in {baseline['seconds']:.0f} s (reused from {options.resume})")
        else:
            outcome, seconds, covered = _run_baseline(roots[0], os.path.join(log_dir, "baseline.log"),
                                                      None if options.no_coverage else all_targets)
            if outcome != "survived":
                with open(os.path.join(log_dir, "baseline.log")) as log:
                    print(f"the unmutated tests do not pass ({outcome}); the end of their output:\n"
                          + "".join(log.readlines()[-80:]))
                return 2
            baseline = {"fingerprint": fingerprint, "seconds": seconds, "covered": covered}
            print(f"unmutated: the selection passes in {seconds:.0f} s")
            for test_id in (covered or {}).get("trace_put_back_after", []):
                print(f"warning: {test_id} left another trace function than coverage's (put back after it: fix the "
                      "test to restore sys.gettrace())")
        if options.baseline_only:
            return 0
        coverage = baseline["covered"]
        covered = coverage and {path: set(lines) for path, lines in coverage["lines"].items()}
        timeout_s = options.timeout_factor * baseline["seconds"] + 30
        threads = 1 if options.jobs > 1 else None
        workers = [_Worker(root, log_dir, timeout_s, threads) for root in roots]
        sources = {path: open(os.path.join(REPOSITORY, path)).read() for path in files}
        queue = [(number, mutant) for number, mutant in enumerate(plan, start=1) if mutant.status == "pending"]
        print(f"{len(plan)} mutants, {len(plan) - len(queue)} decided already, {len(queue)} to run", flush=True)

        def record(number: int, mutant: Mutant) -> None:
            print(f"[{number}/{len(plan)}] {mutant.status:11s} {mutant.seconds:5.0f} s  {mutant.name}", flush=True)
            if report_path:
                _write_report(report_path, reported, baseline)

        numbers: Dict[int, int] = {}  # id(mutant) -> its number in the plan, for the progress line
        while queue or any(worker.mutant is not None for worker in workers):
            for worker in workers:
                while worker.mutant is None and queue:
                    number, mutant = queue.pop(0)
                    original = sources[mutant.path]
                    if covered is not None and not (_statement_lines(original, mutant.line)
                                                    & covered.get(mutant.path, set())):
                        mutant.status = "not covered"
                        record(number, mutant)
                        continue
                    numbers[id(mutant)] = number
                    tests = None if options.whole_selection or not coverage else \
                        _covering_tests(coverage, mutant.path, _statement_lines(original, mutant.line))
                    worker.start(mutant, number, original, mutated_source(original, sites[_key(mutant)]), tests)
            time.sleep(0.2)
            for worker in workers:
                if worker.mutant is not None:
                    done = worker.poll()
                    if done is not None:
                        record(numbers.pop(id(done)), done)
    except KeyboardInterrupt:
        print("interrupted: the mutants in flight stay pending", flush=True)
        return 130
    finally:
        for worker in workers:
            worker.stop()
        print(_summary(reported))
        if report_path and baseline:
            _write_report(report_path, reported, baseline)
        shutil.rmtree(workspace, ignore_errors=True)
    return 0


def _summary(mutants: List[Mutant]) -> str:
    """The score, the counts of each file, the surviving and uncovered mutants (pending: not run yet)."""
    def counts_of(group: List[Mutant]) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for mutant in group:
            counts[mutant.status] = counts.get(mutant.status, 0) + 1
        return counts

    counts = counts_of(mutants)
    killed = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("error", 0)
    ran = sum(counts.values()) - counts.get("pending", 0)
    lines = [f"score: {killed} killed of {ran} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})"]
    for path in dict.fromkeys(mutant.path for mutant in mutants):
        file_counts = counts_of([mutant for mutant in mutants if mutant.path == path])
        lines.append(f"  {path}: {', '.join(f'{k} {v}' for k, v in sorted(file_counts.items()))}")
    lines += [f"  survived: {mutant.name}" for mutant in mutants if mutant.status == "survived"]
    lines += [f"  not covered: {mutant.name}" for mutant in mutants if mutant.status == "not covered"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
