"""The quickstart script, run as a user runs it: it saves the best epoch's checkpoint in the default run folder and
reports the test accuracy of that best model (issue 35, item 1's "Done when")."""
import re
import sys

import pytest
import torch

from tests.examples.support import EXAMPLES, clean_environment, run


@pytest.mark.slow
def test_the_quickstart_keeps_the_best_checkpoint_and_tests_the_best_model(tmp_path):
    completed = run([str(EXAMPLES / "quickstart.py"), "--epochs", "4", "--no-progress"], cwd=tmp_path,
                    env=clean_environment({"PYTHONPATH": str(EXAMPLES.parent)}))
    output = completed.stdout + completed.stderr
    best_path, best_score = re.search(r"Best checkpoint: (\S+) \(val_Accuracy ([0-9.]+)\)", output).groups()
    (run_folder,) = re.findall(r"^Run folder: (\S+)$", output, flags=re.MULTILINE)
    assert best_path.startswith(str(tmp_path / "aitoolbox_runs" / "run_")) and best_path.startswith(run_folder)
    scores = [float(value) for value in re.findall(r"^Epoch \d+/4 - .* - val_Accuracy ([0-9.]+)", output,
                                                    flags=re.MULTILINE)]
    best_epoch = max(range(len(scores)), key=lambda index: (scores[index], -index))  # the earliest of the best
    assert best_path.endswith(f"_E{best_epoch}.pth") and float(best_score) == pytest.approx(scores[best_epoch],
                                                                                            abs=1e-4)
    # The test accuracy printed is that of the best checkpoint's weights.
    sys.path.insert(0, str(EXAMPLES))
    try:
        from quickstart import DigitsCNN, digits_loaders
    finally:
        sys.path.remove(str(EXAMPLES))
    model = DigitsCNN()
    model.load_state_dict(torch.load(best_path, weights_only=True)["model_state_dict"])
    model.eval()
    _, _, test_loader = digits_loaders(32, 0)
    correct = total = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for images, labels in test_loader:
            correct += int((model(images).argmax(dim=1) == labels).sum())
            total += len(labels)
    printed = float(re.search(r"Test accuracy of the best model: ([0-9.]+)", output).group(1))
    assert printed == pytest.approx(correct / total, abs=1e-4)
