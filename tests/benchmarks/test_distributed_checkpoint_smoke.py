"""Smoke tests of benchmarks/distributed.py and benchmarks/checkpoint.py: each runs with --quick in a fresh process.

Only the shape of the output is checked (a table row per runner or variant, numbers where numbers belong, the
verdict lines); the timings themselves depend on the shared machine. The distributed run starts four
training processes (two jobs of two) and the checkpoint run writes about 40 MB three times; on 2 idle cores they
take about 30 s and 7 s, hence the ``slow`` mark.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Generous: other processes may be competing for the 2 cores.
TIMEOUT_S = 300


def run_benchmark(script: str) -> str:
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / script), "--quick"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert completed.returncode == 0, f"{script} failed:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def table(output: str, first_header: str) -> list:
    """The rows of the markdown table whose first column is ``first_header``, split into stripped cells."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    header_index = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = lines[header_index + 2:]  # after the header and the |---| line
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


@pytest.mark.slow
@pytest.mark.extended
def test_distributed_quick_prints_both_runners_with_identical_weights():
    output = run_benchmark("distributed.py")
    rows = table(output, "runner")
    assert [row[0] for row in rows] == ["hand", "fit_distributed"]
    for row in rows:
        assert row[1] == "1"  # one timed run each
        assert float(row[2]) > 0  # first-batch latency, s
        assert float(row[4]) > 0  # samples/s
        assert row[7] == "1"  # OMP_NUM_THREADS=1 reached every process of both runners
    # fit_distributed trained exactly what the hand-written DDP script trained.
    assert rows[1][-1] == "yes"
    assert re.search(r"samples/s ratio fit_distributed / hand: median paired \d+\.\d+ .*target >= 0\.97: "
                     r"(met|MISSED)", output)
    assert re.search(r"first-batch latency fit_distributed - hand: median paired [+-]\d+\.\d+ s .*target <= 1 s: "
                     r"(met|MISSED)", output)


@pytest.mark.slow
@pytest.mark.extended
def test_checkpoint_quick_prints_a_row_per_variant_and_the_stall():
    output = run_benchmark("checkpoint.py")
    rows = table(output, "variant")
    assert [row[0] for row in rows] == ["ours", "bare", "save+fsync"]
    by_variant = {row[0]: row for row in rows}
    assert float(by_variant["bare"][7]) == 1.0  # bare's ratio to itself (median paired)
    assert float(by_variant["bare"][8]) == 1.0  # ... and of minima
    assert float(by_variant["save+fsync"][9]) == 1.0
    for row in rows:
        assert 0 < float(row[3]) <= float(row[2])  # minimum <= median
    # The same state dicts: the three files hold the same tensors, ours adds a few small entries.
    sizes = {name: float(row[6]) for name, row in by_variant.items()}
    assert sizes["bare"] == sizes["save+fsync"]
    assert sizes["bare"] <= sizes["ours"] <= sizes["bare"] * 1.01
    assert "5.2 M parameters" in output
    assert re.search(r"ours / bare torch\.save: \d+\.\d+ \(median paired\), \d+\.\d+ \(of minima\); "
                     r"target <= 1\.1: (met|MISSED)", output)
    for mode in ("in place", "background"):
        assert re.search(rf"training stall per checkpoint, {mode} .*: median \d+\.\d+ s", output)
