"""Smoke test of benchmarks/fsdp.py: ``--quick`` (a tiny transformer, two epochs of 32 sequences) in a fresh process.

The timings are not checked (the machine is shared); what is: a row per runner, one intra-op thread in every
process, the byte counts (exact, so FSDP's shards must come out at about half of DDP's), the three runners
training the same thing (same epoch losses, weights equal up to the gradients' reduction order) and the verdict
lines. It starts three jobs of two spawned processes each: about 30 s on 2 idle cores, hence the ``slow`` mark.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # generous: other processes may be competing for the 2 cores


def table_rows(output: str) -> dict:
    """The result table's rows by runner name, split into stripped cells."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| runner |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_benchmark_quick_prints_every_runner_and_the_verdicts():
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "fsdp.py"), "--quick"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert completed.returncode == 0, f"fsdp.py failed:\n{completed.stdout}\n{completed.stderr}"
    output = completed.stdout
    rows = table_rows(output)
    assert list(rows) == ["ddp", "fsdp", "hand_fsdp"]
    for name, row in rows.items():
        assert row[1] == "1"  # one timed run
        assert float(row[2]) > 0  # samples/s
        assert float(row[4]) > 0  # rank 0's CPU ms per batch
        assert row[9] == "1", row  # OMP_NUM_THREADS=1 reached every process
        start, peak = (float(value) for value in row[8].split(",")[0].split("->"))
        assert 0 < start <= peak, row
    # Exact byte counts: FSDP holds about half of every tensor (a shard, padded to the world size), both sharded
    # runners the same amounts.
    assert rows["ddp"][7] == "1.000, 1.000"
    for name in ("fsdp", "hand_fsdp"):
        assert all(0.45 <= float(ratio) <= 0.55 for ratio in rows[name][7].split(",")), rows[name]
    assert rows["fsdp"][5:7] == rows["hand_fsdp"][5:7]
    # The three trained the same model on the same data order.
    assert rows["ddp"][10] == rows["fsdp"][10] == rows["hand_fsdp"][10]
    for name in ("ddp", "fsdp"):
        assert float(rows[name][11]) <= 1e-5, rows[name]
    assert re.search(r"held bytes fsdp / ddp .*: 0\.\d+; target <= 0\.55: met", output)
    assert re.search(r"samples/s fsdp / hand_fsdp: median paired \d+\.\d+ .*target >= 0\.97: (met|MISSED)", output)
    assert re.search(r"CPU time per batch fsdp / hand_fsdp .*: median paired \d+\.\d+", output)
    assert "in every run: yes" in output
    assert "runs that failed and were run again: " in output
    assert "1 per process (OMP_NUM_THREADS=1)" in output
