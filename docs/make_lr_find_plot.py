"""Draw ``docs/lr_find_digits.png``, the LR search shown on the "Finding a learning rate" page, from a real run.

The quickstart's CNN on scikit-learn's bundled digits (``examples/quickstart.py``), Adam, batch size 32, float32:
``tl.lr_find()`` with its defaults except the range, 1e-6 to 1. Under a minute on 2 CPU cores.

Run from the repository root:  python docs/make_lr_find_plot.py
"""
import logging
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from quickstart import DigitsCNN, digits_loaders  # noqa: E402  (the example is a script, not a package)

from aitoolbox.torchtrain.train_loop import TrainLoop  # noqa: E402

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lr_find_digits.png")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    train_loader, val_loader, test_loader = digits_loaders(batch_size=32, seed=0)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    tl = TrainLoop(model, train_loader, val_loader, test_loader, optimizer, nn.CrossEntropyLoss(),
                   show_progress=False)
    result = tl.lr_find(start_lr=1e-6, end_lr=1.0, num_iterations=100)
    for rule in ("steepest", "minimum"):  # the other rules on the same curve, for the page's table
        from aitoolbox.torchtrain.train_loop.lr_suggestion import suggestion_index
        index = suggestion_index(result.lrs, result.losses, rule)
        logging.info("%s: %.3g", rule, result.lrs[index] / (10.0 if rule == "minimum" else 1.0))
    figure, _ = result.plot()
    figure.set_size_inches(6.4, 4.0)
    figure.tight_layout()
    figure.savefig(OUTPUT, dpi=80)
    logging.info("valley: %.3g, %d steps, diverged: %s -> %s", result.suggestion, len(result.lrs), result.diverged,
                 OUTPUT)


if __name__ == "__main__":
    main()
