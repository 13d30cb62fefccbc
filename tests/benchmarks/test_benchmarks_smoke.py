"""Smoke tests of the benchmark scripts: each runs with --quick in a fresh process and prints its table.

The numbers themselves are not checked (the machine is shared and timings vary); only that the scripts run
end to end and print one table row per scenario or mode. Each takes 5-15 s on 2 idle cores (much of it
importing torch and building the models), hence the ``slow`` mark.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Generous: designed to finish in well under 30 s, but other processes may be competing for the 2 cores.
TIMEOUT_S = 300


def run_benchmark(script: str, *args: str) -> str:
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / script), "--quick", *args],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert completed.returncode == 0, f"{script} failed:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def table_rows(output: str) -> list:
    """Markdown table rows (the header and separator lines excluded), split into stripped cells."""
    rows = [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("| scenario")
            and not line.startswith("| mode")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


@pytest.mark.slow
@pytest.mark.extended
def test_overhead_quick_prints_a_row_per_scenario_with_identical_weights():
    output = run_benchmark("overhead.py", "--no-lightning")
    rows = table_rows(output)
    assert [(row[0], row[1]) for row in rows] == [
        ("bare", "TrainLoop"), ("bars+metrics", "TrainLoop"), ("tiny-model", "TrainLoop"),
        ("tiny-model", "TrainLoop+ThroughputMonitor")]
    for row in rows:
        float(row[5])  # ratio of medians
        float(row[6])  # median paired ratio
        float(row[7])  # ratio of minima
        # TrainLoop and the hand loop did the same arithmetic: their final weights are bitwise equal.
        assert row[-1] == "yes", row
    assert re.search(r"<= 1\.02: (met|MISSED)", output)
    assert re.search(r"monitor over TrainLoop [+-][0-9.]+ us/batch \(<= \+5: (met|MISSED)\)", output)
    assert re.search(r"ThroughputMonitor's batch hooks alone: [0-9.]+ us per batch", output)
    assert "torch threads: 2" in output
    assert "Lightning column: skipped (--no-lightning)" in output


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("model", ["vit", "cnn"])
def test_amp_modes_quick_prints_a_row_per_mode(model):
    output = run_benchmark("amp_modes.py", "--model", model)
    rows = table_rows(output)
    assert [row[0] for row in rows] == ["fp32", "O1", "O2", "O3", "hand-autocast", "hand-fp32"]
    by_mode = {row[0]: row for row in rows}
    assert float(by_mode["fp32"][-1]) == 1.0  # the speed-up of fp32 over itself
    weights_grads = {mode: float(row[2]) for mode, row in by_mode.items()}
    # O3 holds the weights and gradients in 16 bits: exactly half of float32's bytes.
    assert weights_grads["O3"] == pytest.approx(weights_grads["fp32"] / 2, rel=0.02)
    assert "O1 speed-up" in output and "O2 weights+grads cut" in output


@pytest.mark.slow
@pytest.mark.extended
def test_the_spike_rollback_benchmarks_quick_run_without_a_false_alarm():
    alarms = run_benchmark("spike_alarms.py")
    assert "false alarms in 2 healthy runs: 0" in alarms and "NaN losses caught: 2 of 2 (100%)" in alarms
    assert [row[0] for row in table_rows(alarms)][1:] == ["quickstart CNN b32", "quickstart CNN b8"]
    cost = run_benchmark("spike_rollback.py")
    assert "same weights at the end (nothing spiked, so nothing was rolled back): yes" in cost


@pytest.mark.slow
@pytest.mark.extended
def test_batch_roads_quick_prints_the_excess_of_both_roads():
    output = run_benchmark("batch_roads.py")
    assert "2 epochs of 20 batches per runner" in output
    for road in ("general road", "as it runs"):
        assert re.search(rf"TrainLoop, {road}: median [0-9.]+ ms/epoch, [+-][0-9.]+ us a batch over the hand loop",
                         output), output
