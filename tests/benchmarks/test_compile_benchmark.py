"""Smoke test of benchmarks/compile.py: tiny epochs compiled with ``aot_eager`` (no C++ compile), in a fresh process.

The numbers are not checked (the machine is shared); what is: every loop of the model has its row, the hand
compiled loop really compiled its forward and its optimizer step, nothing compiled after the warm-up epoch (the
smaller last batch compiled there), the three loops trained to similar losses and compute the eager loop's
gradients, and the first-compile processes (with their own empty inductor caches) reported back.
"""
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # well under a minute on 2 idle cores; generous for a busy machine


def table_rows(output: str, first_header: str) -> list:
    """The rows of the markdown table whose header starts with ``first_header``, split into stripped cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.slow
@pytest.mark.extended
def test_compile_benchmark_runs_every_loop_with_no_recompile_after_warmup():
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "compile.py"), "--models", "mlp", "--batches", "3",
         "--epochs", "1", "--repeats", "2", "--backend", "aot_eager"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert completed.returncode == 0, f"compile.py failed:\n{completed.stdout}\n{completed.stderr}"
    output = completed.stdout
    assert "b compiled (dynamo cache entries): mlp: forward+step" in output
    assert "torch threads: 2" in output

    speed = table_rows(output, "model | loop | samples/s")
    assert [row[1] for row in speed] == ["a: hand eager", "b: hand compiled", "c: TrainLoop torch_compile"]
    for row in speed:
        assert float(row[2]) > 0  # samples/s
        assert row[6].split()[0] == "0", row  # graphs compiled after the warm-up epoch
        assert "DIFFERS" not in row[7], row  # losses close to the eager loop's
    assert "(compile_stats: 0)" in speed[2][6]
    # One batch's gradients from the eager loop's weights: no parameter left with a zero gradient.
    assert [row[8].split()[0] for row in speed] == ["(reference)", "norms", "norms"], speed
    assert "c/a >= 1.5: " in speed[2][5] and "c/b >= 0.97: " in speed[2][5]

    first_compile = table_rows(output, "model | loop | steady epoch")
    by_loop = {row[1][0]: row for row in first_compile}
    assert by_loop["a"][3] == ""  # the eager loop compiles nothing: no cold measurement
    for loop in ("b", "c"):
        float(by_loop[loop][3])  # first compile from a cold cache, in a fresh process
        # Warm-up: forward (a static and a dynamic graph, or one dynamic graph) and optimizer step.
        assert int(by_loop[loop][5]) >= 2
    assert by_loop["c"][6].startswith("cold ") and "warm " in by_loop["c"][6]
