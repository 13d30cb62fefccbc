"""examples/amp_training: apex-style AMP with TrainLoop on one device and with fit_distributed."""
import re

import pytest

from tests.examples.support import EXAMPLES, clean_environment, run

SCRIPTS = EXAMPLES / "amp_training"


def test_accuracy(output: str) -> float:
    match = re.search(r"^Test accuracy: ([0-9.]+) \(opt_level (O\d)", output, re.MULTILINE)
    assert match, output
    return float(match.group(1))


test_accuracy.__test__ = False  # a helper, not a test


def test_single_device_amp_initialize_then_trainloop_learns_the_digits():
    completed = run([SCRIPTS / "single_device_training.py", "--epochs", "1", "--no-progress"])
    # 10 classes: chance is 0.1; one epoch of the small CNN reaches about 0.9.
    assert test_accuracy(completed.stdout) > 0.5
    assert "opt_level O1" in completed.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_multi_device_fit_distributed_with_amp_init_args_on_two_cpu_processes():
    completed = run([SCRIPTS / "multi_device_training.py", "--epochs", "2", "--cpu-processes", "2", "--no-progress"],
                    env=clean_environment(threads=1))
    assert test_accuracy(completed.stdout) > 0.5
    assert "2 processes" in completed.stdout
